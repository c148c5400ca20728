"""A trace set's numbers come from one compiled function per plan family: they equal the
expressions of the graph and the cost model substituted at the configuration's values."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from conftest import gpt

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.compile import SYMBOL_NAMES, compile_expressions
from stage_dse.cost.derive import embedding_sync_bytes
from stage_dse.cost.time import collective_time, embedding_sync_time, pipeline_hop_time
from stage_dse.graph.ir import CollKind, Phase
from stage_dse.graph.symbols import S
from stage_dse.spec import MeshAxis, ParallelPlan, TrainingSpec
from stage_dse.trace import TraceConfig
from stage_dse.trace.build import analytic_flops, data_buckets
from stage_dse.trace.numbers import op_expressions, set_numbers, symbol_row
from stage_dse.trace.program import config_values, symbol_subs

H100 = load_hardware("h100_sxm")
STEP = TrainingSpec(seq_len=2048, global_batch_size=16)
CASES = {
    "tied gpt, zero-1, pp 2": (
        gpt(layers=4, hidden=1024, heads=8, tied_embeddings=True),
        ParallelPlan(dp=2, tp=2, pp=2, zero_stage=1),
    ),
    "mixtral, ep 2, zero-3": (
        load_model("mixtral_8x7b").replace(num_layers=2),
        ParallelPlan(dp=4, ep=2, tp=2, sequence_parallel=True, zero_stage=3),
    ),
    "deepseek, dense layers, ep 8": (
        load_model("deepseek_v3").replace(num_layers=4),
        ParallelPlan(dp=8, ep=8, recompute="full"),
    ),
}


def _cfg(model, plan) -> TraceConfig:
    cluster = load_cluster("dgx_h100", num_gpus=max(8, plan.num_gpus))
    return TraceConfig(model, STEP, plan, H100, cluster)


@pytest.mark.parametrize("case", list(CASES))
def test_set_numbers_equal_the_substituted_expressions(case):
    cfg = _cfg(*CASES[case])
    nums = set_numbers(cfg)
    subs = symbol_subs(config_values(cfg))

    def num(e) -> float:
        return float(sp.sympify(e).xreplace(subs))

    ops = list(nums.family.ops)
    exprs = op_expressions(ops, cfg.plan.rank_order)
    assert len(ops) > 20
    for i, op in enumerate(ops):
        f, b, c, t = (num(e) for e in exprs[4 * i : 4 * i + 4])
        got = nums.ops[id(op)]
        assert (got.flops, got.bytes, got.comm_bytes) == (round(f), round(b), round(c)), op.name
        assert got.micros == max(1, round(t * 1e6)), op.name
    graphs = nums.graphs
    boundary = graphs.boundary.local_bytes
    assert nums.named["boundary_bytes"] == pytest.approx(num(boundary), rel=1e-15)
    hop = pipeline_hop_time(boundary, nums.family.key)
    assert nums.named["hop_s"] == pytest.approx(num(hop), rel=1e-12)
    if graphs.tied_head_weight is not None:
        size = embedding_sync_bytes(graphs, cfg.training.grads_dtype.bytes)
        assert nums.named["embedding_sync_bytes"] == num(size) > 0
        t = embedding_sync_time(size, cfg.plan.rank_order)
        assert nums.named["embedding_sync_s"] == pytest.approx(num(t), rel=1e-12)
    # a flat bucket: the summed buffer timed as one collective, as the cost model times it
    backward = [op for g in graphs.sections for op in g.ops if op.phase is Phase.BACKWARD]
    buckets = data_buckets(nums, backward)
    assert buckets
    for bucket in buckets:
        members = [
            op
            for op in backward
            if op.is_comm and (op.coll, op.group) == (bucket.coll, bucket.group)
        ]
        size = sum((op.comm_bytes for op in members), sp.Integer(0))
        seconds = num(collective_time(bucket.coll, bucket.group, size, cfg.plan.rank_order))
        assert bucket.output_bytes == round(num(size))
        assert bucket.micros == max(1, round(seconds * 1e6))
    assert analytic_flops(cfg) > 0


def test_bucket_time_is_the_cost_models_at_any_size():
    cfg = _cfg(*CASES["tied gpt, zero-1, pp 2"])
    nums = set_numbers(cfg)
    subs = symbol_subs(config_values(cfg))
    for group in (frozenset({MeshAxis.DP}), frozenset({MeshAxis.TP, MeshAxis.DP})):
        for coll in (CollKind.ALL_REDUCE, CollKind.ALL_GATHER, CollKind.REDUCE_SCATTER):
            for size in (1.0, 4096.0, 3.5e6, 7.25e9):
                t = collective_time(coll, group, sp.Float(size), cfg.plan.rank_order)
                want = float(t.xreplace(subs))
                assert nums.bucket_seconds(coll, group, size) == pytest.approx(want, rel=1e-12)


def test_compiled_expressions_are_read_back_from_the_disk_cache(tmp_path, monkeypatch):
    pytest.importorskip("symengine")
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        return [S.hidden * S.seq / S.tp, sp.Max(S.tp, S.dp) + sp.Integer(3)]

    row = symbol_row({n: float(i + 2) for i, n in enumerate(SYMBOL_NAMES)})
    first = compile_expressions(build, cache_tag="test-exprs")(row)
    second = compile_expressions(build, cache_tag="test-exprs")(row)
    assert len(calls) == 1  # the second function came from the cache, built from nothing
    np.testing.assert_array_equal(first, second)
    values = dict(zip(SYMBOL_NAMES, row[0]))
    assert first[0, 0] == pytest.approx(values["hidden"] * values["seq"] / values["tp"], rel=1e-15)
    assert first[0, 1] == max(values["tp"], values["dp"]) + 3
    compile_expressions(build, cache_tag="another-tag")
    assert len(calls) == 2
    entries = [p for p in tmp_path.iterdir() if p.name.startswith("exprs-")]
    assert len(entries) == 2
    for entry in entries:
        entry.write_bytes(b"truncated")  # a broken entry is rebuilt, never trusted
    again = compile_expressions(build, cache_tag="test-exprs")(row)
    assert len(calls) == 3
    np.testing.assert_array_equal(first, again)
