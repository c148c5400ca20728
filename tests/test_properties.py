"""Rules that hold for every plan (hypothesis) and invariants of the derived collectives."""

from __future__ import annotations

import pytest
from conftest import gpt, llama, same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage_dse.cost.bind import evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.graph import CollKind, build_graphs
from stage_dse.graph.ir import degree
from stage_dse.spec import ParallelPlan, TrainingSpec, validate_plan

TRAIN = TrainingSpec(seq_len=4096, global_batch_size=256)
MODELS = {"gpt": gpt(layers=8, hidden=1024, heads=16), "llama": llama(layers=8, kv_heads=8)}


@st.composite
def plans(draw):
    pow2 = st.sampled_from([1, 2, 4, 8])
    tp = draw(pow2)
    sp_ = draw(st.booleans()) and tp > 1
    pp = draw(st.sampled_from([1, 2, 4, 8]))
    interleaved = pp > 1 and draw(st.booleans())
    return ParallelPlan(
        dp=draw(pow2),
        tp=tp,
        pp=pp,
        cp=draw(st.sampled_from([1, 2, 4])),
        micro_batch_size=draw(st.sampled_from([1, 2, 4])),
        sequence_parallel=sp_,
        zero_stage=draw(st.integers(0, 3)),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        attention=draw(st.sampled_from(["flash", "materialized"])),
        schedule="interleaved" if interleaved else "1f1b",
        virtual_stages=2 if interleaved else 1,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(), family=st.sampled_from(sorted(MODELS)))
def test_total_flops_do_not_depend_on_the_plan(plan, family):
    model = MODELS[family]
    try:
        validate_plan(model, TRAIN, plan)
    except ConfigError:
        return
    got = evaluate_plan(model, TRAIN, plan)
    ref_plan = ParallelPlan(recompute=plan.recompute, attention=plan.attention)
    ref = evaluate_plan(model, TRAIN, ref_plan)
    assert got["model_flops"] == pytest.approx(ref["model_flops"], rel=1e-12)
    assert got["matmul_flops"] == pytest.approx(ref["matmul_flops"], rel=1e-12)
    # the GEMM work is split, never replicated: per-GPU layer flops x model-parallel GPUs x
    # data-parallel GPUs equals the global layer flops
    assert got["params"] == ref["params"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(), family=st.sampled_from(sorted(MODELS)))
def test_collectives_span_exactly_the_axes_they_change(plan, family):
    graphs = build_graphs(MODELS[family], plan, TRAIN)
    for graph in graphs.sections:
        for op in graph.ops:
            if op.coll is None:
                continue
            (x,), (y,) = op.inputs, op.outputs
            assert op.group, op.name
            if op.coll is CollKind.ALL_REDUCE:
                assert op.group <= x.partial and y.partial == x.partial - op.group
                assert y.layout == x.layout
                assert same(op.comm_bytes, x.local_bytes)
            elif op.coll is CollKind.REDUCE_SCATTER:
                assert op.group <= x.partial
                assert y.split_mesh_axes - x.split_mesh_axes == op.group
                assert same(op.comm_bytes, y.local_bytes * degree(op.group))
            elif op.coll is CollKind.ALL_GATHER:
                assert x.split_mesh_axes - y.split_mesh_axes == op.group
                assert same(op.comm_bytes, x.local_bytes * degree(op.group))
            elif op.coll is CollKind.SLICE:
                assert y.split_mesh_axes - x.split_mesh_axes == op.group
                assert op.comm_bytes == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(), family=st.sampled_from(sorted(MODELS)))
def test_weight_shards_cover_every_parameter(plan, family):
    graphs = build_graphs(MODELS[family], plan, TRAIN)
    for graph in graphs.sections:
        for w in graph.weights:
            assert same(w.local_numel * w.shard_degree, w.numel), w.name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    dp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
    zero_stage=st.integers(0, 3),
)
def test_weights_times_gpus_cover_the_model(tp, dp, cp, zero_stage):
    """One GPU's weights times the GPUs sharing them is at least the model; only the norm
    weights are replicated over tensor-parallel ranks, so it exceeds it by little."""
    model = MODELS["llama"]
    plan = ParallelPlan(dp=dp, tp=tp, cp=cp, zero_stage=zero_stage)
    got = evaluate_plan(model, TRAIN, plan)
    sharing = tp * (dp * cp if zero_stage == 3 else 1)
    held = got["mem_weights_bytes"] / 2 * sharing
    assert held >= got["params"] * (1 - 1e-12)
    assert held <= got["params"] * 1.05


def test_collective_groups_per_strategy():
    """The group kinds each strategy produces, for a plan using every axis."""
    plan = ParallelPlan(dp=2, tp=2, cp=2, pp=2, sequence_parallel=True, zero_stage=1)
    got = evaluate_plan(MODELS["llama"], TRAIN, plan)
    comm = {k for k, v in got.items() if k.startswith("comm_") and v > 0 and k != "comm_total"}
    assert {
        "comm_all_gather_tp",
        "comm_reduce_scatter_tp",
        "comm_all_gather_cp",
        "comm_reduce_scatter_cp",
        "comm_reduce_scatter_cp-ep-dp",
        "comm_all_gather_cp-ep-dp",
        "comm_send_recv_pp",
    } <= comm
    # sequence parallelism replaces the tensor-parallel all-reduces of the layers
    assert got.get("comm_all_reduce_tp", 0) < 1e-3 * got["comm_all_gather_tp"]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_sequence_parallel_gathers_the_layer_input_once_each_way(family):
    """Under sequence parallelism the attention input is all-gathered once in forward and once
    in backward (Korthikanti et al. sec. 4.2.2), however many projections read it: keys and
    values read it through a view, and the backward reissues one gather for all of them."""
    plan = ParallelPlan(dp=2, tp=2, sequence_parallel=True)
    block = build_graphs(MODELS[family], plan, TRAIN).block
    gathers = [
        op
        for op in block.ops
        if op.coll is CollKind.ALL_GATHER and op.name == "all_gather:input_norm"
    ]
    assert sorted(op.phase.value for op in gathers) == ["backward", "forward"]


def test_symbolic_sizes_bind_to_direct_numbers():
    """A hand count of tensor-parallel all-reduce bytes (no SP): per layer two in forward and two
    in backward, each of b*s*h*2 bytes; the vocab-parallel embedding's output in forward; the
    output layer's input gradient in backward; three fp32 per-token loss statistics."""
    model = gpt(layers=4, hidden=1024, heads=16)
    training = TrainingSpec(seq_len=2048, global_batch_size=8)
    plan = ParallelPlan(tp=4, dp=2, micro_batch_size=2)
    got = evaluate_plan(model, training, plan)
    m = 8 // (2 * 2)
    per_layer = 4 * 2 * 2048 * 1024 * 2
    embedding = 2 * 2048 * 1024 * 2
    head_input_grad = 2 * 2048 * 1024 * 2
    ce_stats = 3 * 2 * 2048 * 4
    assert got["comm_all_reduce_tp"] == m * (4 * per_layer + embedding + head_input_grad + ce_stats)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=plans(),
    family=st.sampled_from(sorted(MODELS)),
    flags=st.fixed_dictionaries(
        {
            name: st.booleans()
            for name in (
                "overlap_grad_reduce",
                "overlap_param_gather",
                "tp_comm_overlap",
                "tp_dgrad_overlap",
                "zero_sync_per_tensor",
            )
        }
    ),
    rank_order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]),
)
def test_one_plans_row_and_family_are_those_of_its_specs(plan, family, flags, rank_order):
    """``evaluate_plan`` binds a workload once and memoizes family keys by the plan fields the
    key reads; for every plan the row equals :func:`bind`'s values and the key equals
    :func:`cost_key` of the plan itself."""
    from dataclasses import replace

    from stage_dse.config import load_cluster, load_hardware
    from stage_dse.cost.bind import _context, bind, bind_hardware
    from stage_dse.cost.compile import SYMBOL_NAMES
    from stage_dse.cost.derive import cost_key

    plan = replace(plan, **flags, rank_order=rank_order)
    model = MODELS[family]
    try:
        validate_plan(model, TRAIN, plan)
    except ConfigError:
        return
    hw, cl = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=4096)
    ctx = _context(model, TRAIN, hw, cl)
    assert ctx.key(plan) == cost_key(model, plan, TRAIN)
    values = {**bind(model, TRAIN, plan), **bind_hardware(hw, cl)}
    assert ctx.row(plan)[0].tolist() == [float(values[n]) for n in SYMBOL_NAMES]
