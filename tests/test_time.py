"""Time model: alpha-beta collectives on network tiers, pipeline bubbles, MFU, compiled
evaluation equal to the symbolic program, and hardware/cluster validation."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import sympy as sp
from conftest import gpt, llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, bind_hardware, evaluate_plan
from stage_dse.cost.columns import COST_COLUMNS
from stage_dse.cost.compile import compile_family, family_program
from stage_dse.cost.derive import cost_key
from stage_dse.cost.table import evaluate_plans, evaluate_table, plans_table
from stage_dse.cost.time import collective_time, group_tiers
from stage_dse.errors import ConfigError
from stage_dse.graph import CollKind
from stage_dse.graph.symbols import Symbols
from stage_dse.spec import MeshAxis, ParallelPlan, TrainingSpec

TP, CP, EP, DP, PP = MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP, MeshAxis.PP
DEFAULT_ORDER = (TP, CP, EP, DP, PP)
H100 = load_hardware("h100_sxm")


def numeric(expr: sp.Expr, **values: float) -> float:
    if "ep" in values:  # expert groups inside the data-parallel ranks
        values.setdefault("ep_data", values["ep"])
    subs = {Symbols.all()[k]: v for k, v in values.items()}
    # all at once: substituting one symbol after another lets sympy settle a Min or Max on a
    # partly bound expression (from the symbols' assumptions) before the rest are bound
    return float(expr.xreplace(subs))


NET = {
    "intra_bandwidth": 450e9,
    "inter_bandwidth": 50e9,
    "intra_efficiency": 0.8,
    "inter_efficiency": 0.9,
    "intra_latency": 3e-6,
    "inter_latency": 10e-6,
    "gpus_per_node": 8,
    "oversubscription": 1.0,
    "pod_gpus": 1 << 20,
    # one protocol, no fixed cost, no one-shot all-reduce: the plain ring formulas
    "collective_base_latency": 0.0,
    "ll_intra_latency": 0.0,
    "ll_inter_latency": 0.0,
    "ll_base_latency": 0.0,
    "oneshot_latency": 0.0,
}


def test_ring_all_reduce_inside_one_node():
    size = 1e9
    t = collective_time(CollKind.ALL_REDUCE, {TP}, sp.Float(size), DEFAULT_ORDER)
    got = numeric(t, tp=8, dp=4, cp=1, ep=1, pp=1, **NET)
    expected = 2 * 7 / 8 * size / (450e9 * 0.8) + 2 * 7 * 3e-6
    assert got == pytest.approx(expected, rel=1e-12)


def test_ring_all_reduce_across_nodes_is_hierarchical():
    """dp=16 on consecutive ranks: 8 per node x 2 nodes."""
    size = 1e9
    t = collective_time(CollKind.ALL_REDUCE, {DP}, sp.Float(size), DEFAULT_ORDER)
    got = numeric(t, tp=1, dp=16, cp=1, ep=1, pp=1, **NET)
    expected = (
        2 * 7 / 8 * size / (450e9 * 0.8)
        + 2 * 1 / 2 * size / (8 * 50e9 * 0.9)
        + 2 * 7 * 3e-6
        + 2 * math.log2(2) * 10e-6
    )
    assert got == pytest.approx(expected, rel=1e-12)


def test_data_parallel_group_strided_across_nodes_rides_the_nic():
    size = 1e9
    t = collective_time(CollKind.ALL_REDUCE, {DP}, sp.Float(size), DEFAULT_ORDER)
    got = numeric(t, tp=8, dp=4, cp=1, ep=1, pp=1, **NET)
    expected = 2 * 3 / 4 * size / (50e9 * 0.9) + 2 * 2 * 10e-6
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("order", "group", "expected"),
    [
        ((TP, CP, EP, DP, PP), {TP}, (8, 1)),
        ((TP, CP, EP, DP, PP), {DP}, (1, 4)),
        ((DP, TP, CP, EP, PP), {DP}, (4, 1)),
        ((DP, TP, CP, EP, PP), {TP}, (2, 4)),
        ((TP, CP, EP, DP, PP), {PP}, (1, 2)),
        ((PP, TP, CP, EP, DP), {PP}, (2, 1)),
        ((TP, CP, EP, DP, PP), {DP, CP}, (1, 4)),
    ],
)
def test_group_tier_detection(order, group, expected):
    n_in, n_out, _ = group_tiers(group, order)
    vals = {"tp": 8, "dp": 4, "pp": 2, "cp": 1, "ep": 1, "gpus_per_node": 8}
    assert (numeric(n_in, **vals), numeric(n_out, **vals)) == expected


def test_all_gather_and_reduce_scatter_move_half_an_all_reduce():
    size = sp.Float(2e8)
    vals = {"tp": 8, "dp": 1, "cp": 1, "ep": 1, "pp": 1, **NET, "intra_latency": 0.0}
    ar = numeric(collective_time(CollKind.ALL_REDUCE, {TP}, size, DEFAULT_ORDER), **vals)
    ag = numeric(collective_time(CollKind.ALL_GATHER, {TP}, size, DEFAULT_ORDER), **vals)
    rs = numeric(collective_time(CollKind.REDUCE_SCATTER, {TP}, size, DEFAULT_ORDER), **vals)
    assert ag == pytest.approx(ar / 2) and rs == pytest.approx(ar / 2)


def test_oversubscription_slows_groups_spanning_pods():
    """A pod's uplinks carry 1/oversubscription of its NIC bandwidth; a ring leaves a pod once
    per group with members in it, so it slows down only when its group has fewer members per
    pod than the oversubscription; an all-to-all's every member sends across."""
    size = sp.Float(1e9)
    vals = {"tp": 8, "dp": 64, "cp": 1, "ep": 1, "pp": 1, **NET}
    pods = {"pod_gpus": 128, "oversubscription": 4.0}
    ring = collective_time(CollKind.ALL_GATHER, {DP}, size, DEFAULT_ORDER)
    flat = numeric(ring, **vals)
    # 16 data-parallel ranks per 128-GPU pod: 16 flows leave a pod of 128 NICs at 1/4
    assert numeric(ring, **{**vals, **pods}) == pytest.approx(flat, rel=1e-12)
    # with pipeline stages laid inside: one data-parallel rank per pod, the full 1:4
    order = (TP, CP, EP, PP, DP)
    deep = {**vals, "pp": 16, "dp": 8}
    strided = collective_time(CollKind.ALL_GATHER, {DP}, size, order)
    slow, fast = numeric(strided, **{**deep, **pods}), numeric(strided, **deep)
    # the ring's scale-out term, 7/8 of the buffer over the NIC, at 1/4 of its bandwidth
    assert slow - fast == pytest.approx(3 * 7 / 8 * 1e9 / (50e9 * 0.9), rel=1e-9)
    # two ranks per pod: half the oversubscription
    two = numeric(strided, **{**deep, "pod_gpus": 256, "oversubscription": 4.0})
    assert two - fast == pytest.approx(1 * 7 / 8 * 1e9 / (50e9 * 0.9), rel=1e-9)
    a2a = collective_time(CollKind.ALL_TO_ALL, {DP}, size, DEFAULT_ORDER)
    assert numeric(a2a, **{**vals, **pods}) > 3 * numeric(a2a, **vals)


def _time(model, training, plan, gpus, hw=H100, cluster="dgx_h100"):
    cl = load_cluster(cluster, num_gpus=gpus)
    return evaluate_plan(model, training, plan, hardware=hw, cluster=cl)


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_pipeline_bubble(schedule, v):
    # untied: the once-per-step embedding all-reduce would sit in pp_comm_s beside the hops
    model = gpt(layers=16, hidden=2048, heads=16, tied_embeddings=False)
    training = TrainingSpec(seq_len=2048, global_batch_size=64)
    plan = ParallelPlan(dp=2, pp=4, tp=1, micro_batch_size=2, schedule=schedule, virtual_stages=v)
    r = _time(model, training, plan, 8)
    m = 64 // (2 * 2)
    per_mb = (
        r["compute_s"] + r["tp_comm_s"] + r["cp_comm_s"] + r["zero_comm_s"] + r["pp_comm_s"]
    ) / m
    assert r["bubble_s"] == pytest.approx((4 - 1) / v * per_mb, rel=1e-9)
    assert r["bubble_s"] / (m * per_mb) == pytest.approx((4 - 1) / (v * m), rel=1e-9)
    # the breakdown columns (the evaluator's time_* terms but the step and per-layer times)
    parts = [
        column
        for name, column in COST_COLUMNS.items()
        if name.startswith("time_") and name != "time_step_s"
    ]
    assert len(parts) == 10
    assert sum(r[k] for k in parts) == pytest.approx(r["step_s"], rel=1e-12)


def test_tied_embedding_gradients_are_all_reduced_between_the_pipeline_ends():
    """Megatron-LM sums the gradients of the two copies of tied word embeddings over the
    embedding group (first and last stage) once per step: V/tp x h elements in gradient
    precision over the pipeline's hop (a two-rank ring: size/bw and two latencies); nothing
    without pipelining or with untied embeddings."""
    training = TrainingSpec(seq_len=2048, global_batch_size=64)
    V, h, tp = 51200, 2048, 2
    plan = ParallelPlan(dp=2, pp=4, tp=tp, micro_batch_size=2)
    tied = _time(gpt(layers=16, hidden=h, heads=16, vocab=V), training, plan, 16)
    untied_model = gpt(layers=16, hidden=h, heads=16, vocab=V, tied_embeddings=False)
    untied = _time(untied_model, training, plan, 16)
    size = V / tp * h * training.grads_dtype.bytes
    assert tied["comm_all_reduce_embedding"] == size
    assert "comm_all_reduce_embedding" not in untied
    # pp is the slowest axis: stages sit on different nodes, the hop rides the NIC
    cl = load_cluster("dgx_h100")
    hop = size / (cl.inter_bandwidth_bytes_per_s * cl.inter_efficiency) + 2 * cl.inter_latency_s
    assert tied["pp_comm_s"] - untied["pp_comm_s"] == pytest.approx(hop, rel=1e-9)
    tied_model = gpt(layers=16, hidden=h, heads=16, vocab=V)
    flat = _time(tied_model, training, ParallelPlan(dp=8, tp=2), 16)
    assert flat["comm_all_reduce_embedding"] == 0


def test_mfu_of_a_hand_computed_case():
    """MFU = model flops / (step time x GPUs x peak), model flops = 72 B s l h^2 (1 + s/6h) +
    6 B s h V for GPT (Narayanan eq. 3 without recompute)."""
    model = gpt(layers=4, hidden=1024, heads=16, vocab=51200)
    training = TrainingSpec(seq_len=2048, global_batch_size=16)
    plan = ParallelPlan(dp=4, tp=2, recompute="full")
    r = _time(model, training, plan, 8)
    B, s, L, h, V = 16, 2048, 4, 1024, 51200
    flops = 72 * B * s * L * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V
    assert r["model_flops"] == pytest.approx(flops, rel=1e-12)
    assert r["mfu"] == pytest.approx(flops / (r["step_s"] * 8 * H100.peak_flops), rel=1e-12)
    assert r["hfu"] > r["mfu"]  # full recompute adds a forward
    assert r["tokens_per_s"] == pytest.approx(B * s / r["step_s"])


def test_decode_of_memory_bound_op_follows_hbm_bandwidth():
    """An element-wise op's time is its bytes over achieved HBM bandwidth (kernel floors, which
    small optimizer kernels of this model would hit, are set aside here)."""
    no_floors = H100.replace(elementwise_floor_s=0.0, gemm_floor_s=0.0, attention_floor_s=0.0)
    faster = no_floors.replace(hbm_bandwidth_bytes_per_s=2 * H100.hbm_bandwidth_bytes_per_s)
    model, training = llama(), TrainingSpec(seq_len=1024, global_batch_size=8)
    plan = ParallelPlan(dp=8)
    slow = _time(model, training, plan, 8, hw=no_floors)
    fast = _time(model, training, plan, 8, hw=faster)
    assert fast["optimizer_s"] == pytest.approx(slow["optimizer_s"] / 2, rel=1e-9)
    assert fast["compute_s"] < slow["compute_s"]


def _symbolic(key, values: dict[str, float], names: list[str]) -> dict[str, float]:
    """Evaluate the family's program with sympy substitution (the reference path)."""
    defs, outputs = family_program(key)
    subs = {Symbols.all()[k]: sp.Float(v, 30) for k, v in values.items()}
    for sym, expr in defs:
        subs[sym] = expr.xreplace(subs).doit()
    return {n: float(outputs[n].xreplace(subs).doit()) for n in names}


@st.composite
def small_plans(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    inter = pp > 1 and draw(st.booleans())
    return ParallelPlan(
        dp=draw(st.sampled_from([1, 2, 4])),
        tp=tp,
        pp=pp,
        cp=draw(st.sampled_from([1, 2])),
        sequence_parallel=tp > 1 and draw(st.booleans()),
        zero_stage=draw(st.integers(0, 3)),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        attention=draw(st.sampled_from(["flash", "materialized"])),
        micro_batch_size=draw(st.sampled_from([1, 2])),
        schedule="interleaved" if inter else "1f1b",
        virtual_stages=2 if inter else 1,
        overlap_grad_reduce=draw(st.booleans()),
        tp_comm_overlap=draw(st.booleans()),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=small_plans())
def test_vectorized_equals_symbolic(plan):
    model = llama(layers=8, kv_heads=4)
    training = TrainingSpec(seq_len=2048, global_batch_size=32)
    cl = load_cluster("dgx_h100", num_gpus=plan.num_gpus)
    table = plans_table(model, training, [plan], H100, cl)
    got = evaluate_table(table).iloc[0]
    values = {**bind(model, training, plan), **bind_hardware(H100, cl)}
    names = [
        "mem_total",
        "mem_activations",
        "flops_hardware",
        "comm_total",
        "time_step_s",
        "time_bubble_s",
        "mfu",
    ]
    ref = _symbolic(cost_key(model, plan, training), values, names)
    for n in names:
        assert got[n] == pytest.approx(ref[n], rel=1e-9), n


def test_table_evaluates_mixed_families_in_one_call():
    model = load_model("llama3_8b")
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    cl = load_cluster("dgx_h100", num_gpus=16)
    plans = [
        ParallelPlan(dp=2, tp=8),
        ParallelPlan(dp=4, tp=4, zero_stage=1, sequence_parallel=True),
        ParallelPlan(dp=16, zero_stage=3, recompute="full"),
        ParallelPlan(dp=2, tp=2, pp=4, schedule="interleaved", virtual_stages=2),
    ]
    table = plans_table(model, training, plans, H100, cl)
    shuffled = table.iloc[[2, 0, 3, 1]]
    res = evaluate_plans(shuffled)
    for i, plan in zip(shuffled.index, [plans[j] for j in (2, 0, 3, 1)]):
        one = evaluate_plan(model, training, plan, hardware=H100, cluster=cl)
        assert res.loc[i, "step_s"] == pytest.approx(one["step_s"], rel=1e-12)
        assert res.loc[i, "mem_total_bytes"] == pytest.approx(one["mem_total_bytes"], rel=1e-12)
    costs = res[[c for c in res.columns if c not in shuffled.columns]]
    assert isinstance(res, pd.DataFrame) and not costs.isna().any().any()


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    fill=st.sampled_from([1, 16, 64, 4096]),
    chunk=st.sampled_from([7, 100, 1 << 17]),
)
def test_symbol_rows_are_the_matrix_slices_asked_for(runs, fill, chunk):
    """The plan table's symbol matrix, written a window at a time (a window runs ahead over
    whole runs of the next families, and is replaced when a run leaves it), gives each run
    its own rows: scalar columns, constant columns and varying columns alike."""
    import stage_dse.cost.table as table_module

    rows = sum(runs)
    rng = np.random.default_rng(rows)
    columns = [2.5, np.full(rows, 7.0), rng.random(rows), np.arange(rows), 3]
    full = np.column_stack([np.broadcast_to(np.asarray(c, float), rows) for c in columns])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(table_module, "_FILL_ROWS", fill)
        mp.setattr(table_module, "CHUNK_ROWS", chunk)
        x = table_module._Rows(columns, rows)
        x.run_ends = list(np.cumsum(runs))
        a = 0
        for n in runs:
            for lo in range(a, a + n, chunk):  # as _evaluate_runs asks
                hi = min(lo + chunk, a + n)
                np.testing.assert_array_equal(x[lo:hi], full[lo:hi])
            a += n


def test_compiled_numpy_backend_matches_symengine():
    model = llama(layers=8, kv_heads=4)
    training = TrainingSpec(seq_len=2048, global_batch_size=32)
    plan = ParallelPlan(
        dp=2, tp=2, pp=2, sequence_parallel=True, zero_stage=2, recompute="selective"
    )
    cl = load_cluster("dgx_h100", num_gpus=8)
    key = cost_key(model, plan, training)
    from stage_dse.cost.compile import SYMBOL_NAMES

    values = {**bind(model, training, plan), **bind_hardware(H100, cl)}
    x = np.array([[values[n] for n in SYMBOL_NAMES]] * 3)
    a = compile_family(key, "numpy")(x)
    b = compile_family(key, "symengine")(x)
    np.testing.assert_allclose(a, b, rtol=1e-10)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: load_hardware("tpu_v9"), "unknown hardware preset 'tpu_v9'; valid: "),
        (
            lambda: load_cluster("dgx_h100", inter_gbit_s=0),
            "cluster.inter_gbit_s must be > 0",
        ),
        (
            lambda: load_cluster("dgx_h100", intra_gb_s=-5),
            "cluster.intra_gb_s must be >= 0, got -5",
        ),
        (
            lambda: load_hardware("h100_sxm", hbm_tb_s=0),
            "hardware.hbm_tb_s must be > 0",
        ),
        (
            lambda: load_hardware("h100_sxm", gemm_efficiency=1.5),
            "hardware.gemm_efficiency must be in (0, 1]",
        ),
        (
            lambda: load_hardware("h100_sxm", hbm_gb=80),
            "hardware.hbm_gb is not a known field; valid: ",
        ),
        (lambda: load_cluster("dgx_h100", num_gpus=-8), "cluster.num_gpus must be > 0, got -8"),
        (
            lambda: load_cluster("dgx_h100", num_gpus=12),
            "cluster.gpus_per_node(8) does not divide cluster.num_gpus(12)",
        ),
        (
            lambda: evaluate_plan(
                load_model("llama3_8b"),
                TrainingSpec(seq_len=4096, global_batch_size=64),
                ParallelPlan(dp=8, tp=8),
                hardware=H100,
                cluster=load_cluster("dgx_h100", num_gpus=32),
            ),
            "plan needs dp(8)*tp(8)*pp(1)*cp(1)=64 GPUs > cluster.num_gpus(32)",
        ),
    ],
)
def test_bad_hardware_and_cluster_input(call, message):
    with pytest.raises(ConfigError) as info:
        call()
    assert message in str(info.value)
