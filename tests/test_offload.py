"""Activation offload to host memory (``plan.offload_layers``): memory, the copies' exposed
time under Transformer Engine's schedule, and the rules Megatron-Core enforces."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.spec import ParallelPlan, TrainingSpec, validate_plan

MODEL = load_model("llama3_8b")
TRAINING = TrainingSpec(seq_len=8192, global_batch_size=16)
H100 = load_hardware("h100_sxm")
CLUSTER = load_cluster("dgx_h100", num_gpus=8)


def _eval(offload: int, hardware=H100) -> dict:
    plan = ParallelPlan(dp=8, zero_stage=3, micro_batch_size=1, offload_layers=offload)
    return evaluate_plan(MODEL, TRAINING, plan, hardware=hardware, cluster=CLUSTER)


def test_offloaded_layers_leave_device_memory_one_layer_at_a_time():
    base, one = _eval(0), _eval(1)
    per_layer = base["mem_activations_bytes"] - one["mem_activations_bytes"]
    assert per_layer > 0
    # a layer's share of the activation memory, less what the embedding and output layer keep
    # (the logits at 8K tokens and a 128K vocabulary are a few layers' worth)
    average = base["mem_activations_bytes"] / MODEL.num_layers
    assert 0.75 * average < per_layer < average
    for k in (5, 31):
        r = _eval(k)
        assert r["mem_activations_bytes"] == pytest.approx(
            base["mem_activations_bytes"] - k * per_layer, rel=1e-12
        )
        for key in ("mem_weights_bytes", "mem_optimizer_bytes", "model_flops"):
            assert r[key] == base[key]


@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, MODEL.num_layers - 1), gb_s=st.sampled_from([0.5, 4.0, 64.0, 1e4]))
def test_exposed_copy_time_is_what_outlasts_the_other_layers_compute(k, gb_s):
    """Per micro-batch, k layers' activations cross the host link once each way; each copy
    hides under the compute of the layers after it (L - 1 layers' forward, then backward)."""
    hw = dataclasses.replace(H100, host_bandwidth_bytes_per_s=gb_s * 1e9)
    base, r = _eval(0, hw), _eval(k, hw)
    per_layer = base["mem_activations_bytes"] - _eval(1, hw)["mem_activations_bytes"]
    copy_s = k * per_layer / hw.host_bandwidth_bytes_per_s
    spare = MODEL.num_layers - 1
    microbatches = TRAINING.global_batch_size // 8
    expected = microbatches * (
        max(0.0, copy_s - spare * r["time_layer_fwd_s"])
        + max(0.0, copy_s - spare * r["time_layer_bwd_s"])
    )
    assert r["offload_s"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert r["step_s"] == pytest.approx(base["step_s"] + r["offload_s"], rel=1e-9)


def test_a_fast_host_link_hides_the_copies_and_a_slow_one_does_not():
    fast = dataclasses.replace(H100, host_bandwidth_bytes_per_s=1e13)
    assert _eval(16, fast)["offload_s"] == 0
    assert _eval(16, fast)["step_s"] == pytest.approx(_eval(0, fast)["step_s"])
    assert _eval(16)["offload_s"] > 0  # 16 layers over PCIe Gen5 outlast the other layers
    assert _eval(16)["offload_s"] > _eval(8)["offload_s"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"offload_layers": 32}, "offload_layers(32) must be below layers(32)"),
        ({"offload_layers": 4, "pp": 2, "dp": 4}, "offload_layers(4) needs pp=1"),
        ({"offload_layers": 4, "recompute": "full"}, "needs recompute=none"),
    ],
)
def test_plans_megatron_core_refuses_are_refused_with_the_field_named(changes, message):
    plan = ParallelPlan(**{"dp": 8, "zero_stage": 3, **changes})
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_plan(MODEL, TRAINING, plan)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_offload_layers_must_be_a_count(value):
    with pytest.raises(ConfigError, match=r"plan\.offload_layers must be an integer >= 0"):
        ParallelPlan(dp=8, offload_layers=value)


def test_traces_refuse_offload_rather_than_drop_its_copies():
    from stage_dse.trace.build import TraceConfig

    plan = ParallelPlan(dp=8, zero_stage=3, offload_layers=4)
    with pytest.raises(ConfigError, match=r"plan\.offload_layers=4: traces carry no host copies"):
        TraceConfig(MODEL, TRAINING, plan, H100, CLUSTER)


def test_sweeps_range_over_offload_where_megatron_core_allows_it():
    from stage_dse.cost.table import evaluate_plans
    from stage_dse.search import enumerate_plans
    from stage_dse.spec.sweep import SearchSpace

    space = SearchSpace(
        tp=(1,),
        pp=(1, 2),
        micro_batch_size=(1,),
        zero_stage=(3,),
        recompute=("none", "full"),
        sequence_parallel=(False,),
        offload_layers=(0, 8, 32),
    )
    plans = enumerate_plans(MODEL, TRAINING, H100, CLUSTER, space)
    assert plans.candidates == 12
    assert dict(plans.rejected) == {
        "offload_layers must be below layers(32)": 4,
        "offload_layers needs pp=1": 2,
        "offload_layers needs recompute=none": 1,
    }
    rows = evaluate_plans(plans.columns.frame())
    offloaded = rows[rows["offload_layers"] > 0]
    assert len(offloaded) == 1
    assert offloaded["pp"].tolist() == [1] and offloaded["recompute"].tolist() == ["none"]
    direct = _eval(8)
    assert float(offloaded["step_s"].iloc[0]) == pytest.approx(direct["step_s"], rel=1e-9)
    assert float(offloaded["mem_total_bytes"].iloc[0]) == pytest.approx(direct["mem_total_bytes"])


def test_a_sweep_config_lists_offload_layers():
    from stage_dse.config.space import to_search_space

    plan = {
        "tp": [1], "pp": [1], "cp": [1], "ep": [1], "expert_tensor_parallel": [False],
        "ep_over_tp": [False], "micro_batch_size": [1], "zero_stage": [3], "recompute": ["none"],
        "sequence_parallel": [False], "attention": ["flash"], "virtual_stages": [1],
        "rank_order": ["tp-cp-ep-dp-pp"], "offload_layers": 4,
    }  # fmt: skip
    assert list(to_search_space(plan).offload_layers) == [4]
    with pytest.raises(ConfigError, match=r"plan\.offload_layers values must be integers >= 0"):
        to_search_space({**plan, "offload_layers": [-2]})


def test_offload_changes_a_rows_hash_only_where_it_offloads():
    from stage_dse.cost.table import plans_table
    from stage_dse.results.schema import config_hash_u64

    plans = [ParallelPlan(dp=8, zero_stage=3, offload_layers=k) for k in (0, 0, 4)]
    table = plans_table(MODEL, TRAINING, plans, H100, CLUSTER)
    table.loc[1, "host_bandwidth"] = 1e9  # a slower host link, no offload
    hashes = config_hash_u64(table)
    older = config_hash_u64(table.drop(columns=["offload_layers", "host_bandwidth"]))
    assert hashes[0] == hashes[1] == older[0]  # rows without offload keep their hashes
    assert hashes[2] != hashes[0]
    slower = table.copy()
    slower.loc[2, "host_bandwidth"] = 1e9
    assert config_hash_u64(slower)[2] != hashes[2]
