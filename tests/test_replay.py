"""Critical-path replay of trace sets against the cost model's step time.

The replay (``stage_dse.trace.replay``) walks each rank's dependency graph with the per-node
durations the trace carries; the trace encodes the schedule (what waits for what), the cost
model a closed form of the same schedule. Where they differ the gap is systematic and named in
the test below."""

from __future__ import annotations

import pytest
from conftest import gpt

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.spec.serving import ServingSpec, serving_plan
from stage_dse.trace import TraceConfig, write_trace_set
from stage_dse.trace import et_def_pb2 as pb
from stage_dse.trace.encode import read_trace
from stage_dse.trace.replay import replay_trace_dir
from stage_dse.trace.serving import write_serving_trace

H100 = load_hardware("h100_sxm")
# the schedule check runs without the closed form's overlap slowdown (NCCL kernels slowing the
# compute beside them) and without the host's issue of each op, which no trace carries; the
# slowdown is checked on its own below
H100_EXACT = H100.replace(overlap_slowdown=0.0, host_op_s=0.0)
LLAMA8 = load_model("llama3_8b").replace(num_layers=8)
LLAMA4 = load_model("llama3_8b").replace(num_layers=4)
MIXTRAL = load_model("mixtral_8x7b").replace(num_layers=4)
DEEPSEEK = load_model("deepseek_v3").replace(num_layers=4)
TIED_GPT = gpt(layers=8, hidden=2048, heads=16, tied_embeddings=True)
STEP = TrainingSpec(seq_len=2048, global_batch_size=16)

AGREE = (0.98, 1.02)
"""Replay / cost model where both render one schedule."""
STAGE_IMBALANCE = (0.92, 0.99)
"""Pipeline stages of unequal time (embedding on the first, output layer and loss on the
last, uneven splits): the closed form runs warm-up and cool-down at the slowest stage's pace,
``(m + pp - 1) t_max``; the replay runs each stage at its own."""
CP_FIRST_EXCHANGE = (1.0, 1.04)
"""Context parallel: each layer's first K/V exchange is exposed in the trace, the closed form
hides the whole ring under attention."""

TRAINING_KINDS = {
    "dense 1f1b": (LLAMA8, dict(tp=2, pp=2, dp=2), STAGE_IMBALANCE),
    "interleaved": (
        LLAMA8,
        dict(tp=2, pp=2, dp=2, schedule="interleaved", virtual_stages=2),
        STAGE_IMBALANCE,
    ),
    "uneven split": (LLAMA8, dict(tp=2, pp=3, dp=1, stage_layers="2,3,3"), STAGE_IMBALANCE),
    "zero-1": (LLAMA8, dict(dp=8, zero_stage=1), AGREE),
    "zero-2": (LLAMA8, dict(dp=8, zero_stage=2), AGREE),
    "zero-3": (LLAMA8, dict(dp=8, zero_stage=3), (0.98, 1.025)),
    "zero-3 full recompute": (LLAMA8, dict(dp=8, zero_stage=3, recompute="full"), AGREE),
    "tp 8 + zero-3, 64 ranks": (LLAMA8, dict(tp=8, dp=8, zero_stage=3), AGREE),
    "tp 8 + zero-2, 64 ranks": (LLAMA8, dict(tp=8, dp=8, zero_stage=2), AGREE),
    "two nodes, dp 16": (LLAMA4, dict(dp=16), AGREE),
    "two nodes, dp 16, zero-1": (LLAMA4, dict(dp=16, zero_stage=1), AGREE),
    "two nodes, dp 16, zero-2": (LLAMA4, dict(dp=16, zero_stage=2), AGREE),
    "sp + cp": (LLAMA8, dict(tp=2, cp=2, dp=2, sequence_parallel=True), CP_FIRST_EXCHANGE),
    "moe / ep 4": (MIXTRAL, dict(dp=4, ep=4, tp=2, sequence_parallel=True), AGREE),
    "mixtral ep 2, zero-1": (
        MIXTRAL,
        dict(tp=4, dp=2, ep=2, sequence_parallel=True, zero_stage=1),
        AGREE,
    ),
    "deepseek ep 8": (DEEPSEEK, dict(dp=8, ep=8), AGREE),
    "deepseek ep 8, zero-1": (DEEPSEEK, dict(dp=8, ep=8, zero_stage=1), AGREE),
    "tied embeddings": (TIED_GPT, dict(tp=2, pp=2, dp=2), AGREE),
}


def _training_set(tmp_path, model, plan, hardware=H100_EXACT):
    cluster = load_cluster("dgx_h100", num_gpus=max(8, plan.num_gpus))
    write_trace_set(TraceConfig(model, STEP, plan, hardware, cluster), tmp_path)
    return tmp_path


def _kind(kind):
    model, plan, bounds = TRAINING_KINDS[kind]
    return model, ParallelPlan(**plan), bounds


@pytest.mark.parametrize("kind", list(TRAINING_KINDS))
def test_replayed_training_step_matches_the_cost_model(tmp_path, kind):
    """Within 2% where trace and closed form render one schedule; otherwise inside the bounds
    of the named effect the replay models and the closed form does not (see the constants)."""
    model, plan, (low, high) = _kind(kind)
    r = replay_trace_dir(_training_set(tmp_path, model, plan))
    assert r.cost_step_s > 0
    assert low <= r.step_s / r.cost_step_s <= high, (r.step_s, r.cost_step_s)


@pytest.mark.parametrize("kind", ["zero-3", "two nodes, dp 16, zero-1"])
def test_overlap_slowdown_is_the_closed_forms_own(tmp_path, kind):
    """The closed form charges ``overlap_slowdown`` of every overlapped collective's time on
    top; the trace's per-node durations cannot carry it, so the replay is faster by at most
    that share of the step."""
    model, plan, _ = _kind(kind)
    exact = replay_trace_dir(_training_set(tmp_path / "exact", model, plan))
    slowed = replay_trace_dir(_training_set(tmp_path / "slowed", model, plan, H100))
    assert slowed.step_s == pytest.approx(exact.step_s, rel=1e-9)
    extra = slowed.cost_step_s - exact.cost_step_s
    assert 0 < extra <= H100.overlap_slowdown * exact.cost_step_s


def test_replicated_gradients_reduce_once_per_step(tmp_path):
    """Gradients replicated over the tensor-parallel ranks (sequence-parallel norms, the
    router, experts without expert tensor parallelism) are summed over them once per step
    after the data-parallel sync, one coalesced all-reduce (Megatron-LM finalize_model_grads),
    not once per micro-batch."""
    model, plan, _ = _kind("mixtral ep 2, zero-1")
    path = _training_set(tmp_path, model, plan)
    nodes = list(read_trace(path / "trace.0.et")[1])
    after = [n for n in nodes if n.name.startswith("all_reduce:after_sync:")]
    assert len(after) == 1
    comps = [n for n in nodes if n.type == pb.COMP_NODE]
    assert comps[-1].name == "optimizer_step" and after[0].id in comps[-1].data_deps
    syncs = {n.id for n in nodes if "(flat)" in n.name and n.name.startswith("reduce_scatter:")}
    assert syncs and syncs <= set(after[0].data_deps)


def test_zero1_gathers_open_the_step(tmp_path):
    """With overlap_param_gather, ZeRO-1/2 parameter gathers run under the first forward, a
    layer ahead (Megatron-LM's forward pre-hook), not after the optimizer; without it they
    follow the optimizer step."""
    model = LLAMA4
    for overlap, where in ((True, "first forward"), (False, "after optimizer")):
        plan = ParallelPlan(dp=8, zero_stage=1, overlap_param_gather=overlap)
        path = _training_set(tmp_path / where.replace(" ", "_"), model, plan)
        nodes = list(read_trace(path / "trace.0.et")[1])
        opt = next(i for i, n in enumerate(nodes) if n.name == "optimizer_step")
        gathers = [i for i, n in enumerate(nodes) if n.name.startswith("all_gather:")]
        assert len(gathers) == 1 + 4 + 1  # embedding, layers, output layer
        if overlap:
            assert max(gathers) < opt
        else:
            assert min(gathers) > opt


@pytest.mark.parametrize("kind", ["dense 1f1b", "tied embeddings", "zero-3", "uneven split"])
def test_one_rank_per_stage_replays_like_every_rank(tmp_path, kind):
    """Ranks of a stage run one template: simulating one per stage gives the all-rank time."""
    model, plan, _ = _kind(kind)
    path = _training_set(tmp_path, model, plan)
    few, every = replay_trace_dir(path), replay_trace_dir(path, all_ranks=True)
    assert few.simulated_ranks == plan.pp < every.simulated_ranks == plan.num_gpus
    assert few.step_s == pytest.approx(every.step_s, rel=1e-12)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("pp", [1, 2])
def test_replayed_serving_passes_match_the_cost_model(tmp_path, phase, pp):
    """Prefill: the time to first token; decode: steps x time per output token (the trace
    also sends the sampled tokens back to the first stage, which the cost model omits)."""
    model = load_model("llama3_8b")
    serving = ServingSpec(prompt_len=2048, output_tokens=256, batch_size=8)
    plan = serving_plan(model, 2, pp, 8, 1)
    cluster = load_cluster("dgx_h100", num_gpus=plan.num_gpus)
    ts = write_serving_trace(model, serving, plan, H100, cluster, tmp_path, 3, phase=phase)
    r = replay_trace_dir(ts.path)
    assert r.step_s == pytest.approx(r.cost_step_s, rel=0.02), (r.step_s, r.cost_step_s)


def test_zero3_gathers_are_prefetched_one_layer_ahead(tmp_path):
    """With ZeRO-3 each layer's parameter gather is issued when the previous layer starts: it
    never waits for the compute node just before its layer's first use (the first gather of
    each forward and backward pass has no earlier layer and is exposed, as in the cost model)."""
    path = _training_set(tmp_path, LLAMA8, ParallelPlan(dp=8, zero_stage=3))
    nodes = list(read_trace(path / "trace.0.et")[1])
    comps = [n for n in nodes if n.type == pb.COMP_NODE]
    prev_compute = {}
    last = None
    for n in nodes:
        if n.type == pb.COMP_NODE:
            prev_compute[n.id] = last
            last = n.id
    gathers = [n for n in nodes if n.type == pb.COMM_COLL_NODE and n.name.startswith("all_gather:")]
    assert len(gathers) >= 2 * 2 * 8  # two micro-batches, forward and backward, 8 layers
    exposed = 0
    for g in gathers:
        user = next(c for c in comps if g.id in c.data_deps)
        before = prev_compute[user.id]
        if before is None or before in g.data_deps:
            exposed += 1  # issued only once the compute ahead of its layer has finished
    assert exposed == 2 * 2  # the first gather of each forward and backward pass
