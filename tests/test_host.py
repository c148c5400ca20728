"""The host's issue of a step's ops: eagerly issued ops bound a phase whose kernels are shorter
than issuing them, CUDA graphs remove what they capture, and a grouped expert GEMM that loops
over its experts is issued once per local expert."""

from __future__ import annotations

import dataclasses

import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.cost.kernel_time import host_launches
from stage_dse.errors import ConfigError
from stage_dse.graph import Phase, build_graphs
from stage_dse.graph.ir import Module
from stage_dse.graph.symbols import S
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.spec.plan import parse_cuda_graphs

QWEN = load_model("qwen3_30b_a3b")
LLAMA = load_model("llama3_8b")
B200 = load_hardware("b200")
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=64, gemm_dtype="fp8", fp8_recipe="mxfp8")


def _step(plan, hw=B200, model=QWEN, training=TRAINING, gpus=8):
    cluster = load_cluster("hgx_b200", num_gpus=gpus)
    return evaluate_plan(model, training, plan, hardware=hw, cluster=cluster)["step_s"]


def _host(seconds: float):
    return dataclasses.replace(B200, host_op_s=seconds)


MOE_PLAN = ParallelPlan(dp=8, ep=8, zero_stage=1, micro_batch_size=1, expert_gemm_loop=True)


def test_a_fast_host_costs_nothing_and_a_slow_one_bounds_the_step():
    """With the host far faster than the kernels the step is the GPU's; as issuing an op
    grows slower the small-batch MoE step grows with it, never shrinking."""
    times = [_step(MOE_PLAN, _host(s)) for s in (0.0, 1e-6, 20e-6, 60e-6, 120e-6)]
    assert times[1] == pytest.approx(times[0])
    assert times == sorted(times)
    assert times[-1] > 1.5 * times[0]
    # the host-bound part is linear in the host's time per op
    assert times[-1] - times[0] > 1.8 * (times[-2] - times[0])


def test_cuda_graphs_remove_what_they_capture():
    slow = _host(80e-6)
    eager = _step(MOE_PLAN, slow)
    partial = _step(dataclasses.replace(MOE_PLAN, cuda_graphs=("attn", "moe_router")), slow)
    full = _step(dataclasses.replace(MOE_PLAN, cuda_graphs=("full_iteration",)), slow)
    assert full < partial < eager
    # a whole-step graph leaves no host time: the GPU's step
    assert full == pytest.approx(_step(MOE_PLAN, _host(0.0)))


def test_grouped_expert_gemms_loop_over_local_experts():
    """Transformer Engine's GroupedLinear issues one GEMM per local expert: with ep 8 of 128
    experts, 16 launches for each expert GEMM; a single grouped kernel, one."""
    block = build_graphs(QWEN, MOE_PLAN, TRAINING).block
    gemms = [op for op in block.ops if op.name.startswith("experts.") and op.kind.value == "einsum"]
    assert len(gemms) == 3
    values = {S.expert_gemm_loop: 1, S.ep_data: 8, S.experts: 128, S.tp: 1, S.dp: 8, S.ep: 8}
    values.update({S.graph_attn: 0, S.graph_mlp: 0, S.graph_router: 0, S.graph_full: 0})
    assert all(host_launches(op).subs(values) == 16 for op in gemms)
    values[S.expert_gemm_loop] = 0
    assert all(host_launches(op).subs(values) == 1 for op in gemms)
    # the router's GEMM is one launch whatever the experts
    router = next(op for op in block.ops if op.name == "router")
    assert host_launches(router).subs({**values, S.expert_gemm_loop: 1}) == 1


def test_layer_parts_carry_the_modules_graphs_capture():
    block = build_graphs(QWEN, MOE_PLAN, TRAINING).block
    module = {op.name: op.module for op in block.ops if op.phase is Phase.FORWARD}
    assert module["core_attention"] is module["q_proj"] is Module.ATTN
    assert module["router"] is module["post_attention_norm"] is Module.ROUTER
    assert module["experts.up_proj"] is module["moe_dispatch"] is Module.EXPERTS
    # backward ops belong to the part of their forward op
    grads = [op for op in block.ops if op.phase is Phase.BACKWARD and "core_attention" in op.name]
    assert grads and all(op.module is Module.ATTN for op in grads)
    dense = build_graphs(LLAMA, ParallelPlan(dp=8), TRAINING).block
    assert {op.module for op in dense.ops if op.name.startswith("mlp")} <= {Module.MLP}


def test_large_dense_layers_stay_gpu_bound():
    """A dense 8B model at 4k tokens per micro-batch issues far fewer ops than its kernels
    take: at a realistic op cost the host adds at most its embedding's few ops (0.1%)."""
    plan = ParallelPlan(dp=8, zero_stage=1, micro_batch_size=1)
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    a = _step(plan, _host(0.0), LLAMA, t)
    assert _step(plan, _host(40e-6), LLAMA, t) == pytest.approx(a, rel=1e-3)


@pytest.mark.parametrize(
    "value, message",
    [
        ("attn+bogus", "plan.cuda_graphs: unknown module 'bogus'"),
        ("full_iteration+attn", "plan.cuda_graphs=full_iteration captures the whole step"),
        (3, "plan.cuda_graphs must be none or modules joined by '+'"),
    ],
)
def test_bad_cuda_graphs_name_the_field(value, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        ParallelPlan(cuda_graphs=value)


def test_cuda_graphs_labels():
    assert parse_cuda_graphs("none") == ()
    assert parse_cuda_graphs("moe_router+attn") == ("attn", "moe_router")
    assert ParallelPlan(cuda_graphs="attn,moe_preprocess").cuda_graphs_label == (
        "attn+moe_preprocess"
    )


def test_config_hash_keeps_old_rows_and_tells_host_settings_apart():
    """A plan with no CUDA graphs, no per-expert loop and the presets' host time hashes as
    rows written before the host was modelled; each of the three settings gives another hash."""
    import pandas as pd

    from stage_dse.cost.table import plan_row
    from stage_dse.results.schema import HOST_COLUMNS, config_hash_u64

    hw, cl = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=8)
    t = TrainingSpec(seq_len=4096, global_batch_size=8)
    plans = [
        (ParallelPlan(dp=8), hw),
        (ParallelPlan(dp=8), dataclasses.replace(hw, host_op_s=10e-6)),
        (ParallelPlan(dp=8, cuda_graphs="attn"), hw),
        (ParallelPlan(dp=8, expert_gemm_loop=True), hw),
    ]
    rows = pd.DataFrame([plan_row(LLAMA, t, plan, h, cl) for plan, h in plans])
    hashes = config_hash_u64(rows)
    assert len(set(hashes)) == len(plans)
    before = rows.drop(columns=list(HOST_COLUMNS)).iloc[:1]
    assert config_hash_u64(before)[0] == hashes[0]
