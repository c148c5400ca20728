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
LLAMA8 = load_model("llama3_8b").replace(num_layers=8)
MIXTRAL = load_model("mixtral_8x7b").replace(num_layers=4)
TIED_GPT = gpt(layers=8, hidden=2048, heads=16, tied_embeddings=True)
STEP = TrainingSpec(seq_len=2048, global_batch_size=16)

TRAINING_KINDS = {
    "dense 1f1b": (LLAMA8, ParallelPlan(tp=2, pp=2, dp=2)),
    "interleaved": (
        LLAMA8,
        ParallelPlan(tp=2, pp=2, dp=2, schedule="interleaved", virtual_stages=2),
    ),
    "uneven split": (LLAMA8, ParallelPlan(tp=2, pp=3, dp=1, stage_layers="2,3,3")),
    "zero-3": (LLAMA8, ParallelPlan(dp=8, zero_stage=3)),
    "zero-3 full recompute": (LLAMA8, ParallelPlan(dp=8, zero_stage=3, recompute="full")),
    "zero-2": (LLAMA8, ParallelPlan(dp=8, zero_stage=2)),
    "sp + cp": (LLAMA8, ParallelPlan(tp=2, cp=2, dp=2, sequence_parallel=True)),
    "moe / ep": (MIXTRAL, ParallelPlan(dp=4, ep=4, tp=2, sequence_parallel=True)),
    "tied embeddings": (TIED_GPT, ParallelPlan(tp=2, pp=2, dp=2)),
}


def _training_set(tmp_path, model, plan):
    cluster = load_cluster("dgx_h100", num_gpus=max(8, plan.num_gpus))
    write_trace_set(TraceConfig(model, STEP, plan, H100, cluster), tmp_path)
    return tmp_path


@pytest.mark.parametrize("kind", list(TRAINING_KINDS))
def test_replayed_training_step_matches_the_cost_model(tmp_path, kind):
    """Within 10% for every kind. Known systematic gaps: the cost model times every stage
    for the slowest one, ``(m + pp - 1) x t_slowest``, so uneven splits replay a few percent
    faster; the trace exposes the first context-parallel K/V gather of each layer that the
    cost model hides under attention; ZeRO-2/3 traces serialise every collective of the
    data-parallel communicator (one NCCL stream), the cost model only per layer."""
    model, plan = TRAINING_KINDS[kind]
    r = replay_trace_dir(_training_set(tmp_path, model, plan))
    assert r.cost_step_s > 0
    assert r.step_s == pytest.approx(r.cost_step_s, rel=0.10), (r.step_s, r.cost_step_s)


@pytest.mark.parametrize("kind", ["dense 1f1b", "tied embeddings", "zero-3", "uneven split"])
def test_one_rank_per_stage_replays_like_every_rank(tmp_path, kind):
    """Ranks of a stage run one template: simulating one per stage gives the all-rank time."""
    model, plan = TRAINING_KINDS[kind]
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
    assert r.step_s == pytest.approx(r.cost_step_s, rel=0.10), (r.step_s, r.cost_step_s)


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
