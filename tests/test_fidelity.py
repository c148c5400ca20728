"""Fidelity of the time model where plan decisions turn: causal attention, gradient dtypes,
ZeRO-3 schedules, latency floors, per-stage layer splits."""

from __future__ import annotations

import math

import pytest
import sympy as sp

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.graph import OpKind, Phase, build_graphs
from stage_dse.graph.forward import ATTENTION_TILE, causal_fraction
from stage_dse.graph.symbols import S
from stage_dse.spec import ParallelPlan, TrainingSpec

H100 = load_hardware("h100_sxm")


def _eval(model, training, plan, gpus):
    cluster = load_cluster("dgx_h100", num_gpus=max(gpus, 8))
    return evaluate_plan(model, training, plan, hardware=H100, cluster=cluster)


# --------------------------------------------------------------------------- causal attention
def test_causal_fraction_counts_whole_diagonal_tiles():
    # T tile rows compute 1 + 2 + ... + T tiles of T^2: (T + 1) / 2T
    for seq in (2048, 8192, 131072):
        t = seq // ATTENTION_TILE
        assert causal_fraction(sp.Integer(seq)).doit() == sp.Rational(t + 1, 2 * t)
    assert causal_fraction(sp.Integer(ATTENTION_TILE)).doit() == 1
    assert causal_fraction(sp.Integer(64)).doit() == 1


def test_causal_attention_executes_about_half_and_flops_model_keeps_the_convention():
    """At 131K tokens the fused causal kernel executes ~half of the s x s work; the published
    convention (Narayanan et al. eq. 3: full s^2 terms) stays in ``flops_model``."""
    model = load_model("llama3_8b")
    seq = 131072
    training = TrainingSpec(seq_len=seq, global_batch_size=8)
    flash = ParallelPlan(dp=1, tp=8, cp=8, sequence_parallel=True, recompute="full")
    graphs = build_graphs(model, flash, training)
    attn = [op for op in graphs.block.ops if op.kind is OpKind.ATTENTION]
    assert {op.phase for op in attn} == {Phase.FORWARD, Phase.BACKWARD}
    for op in attn:
        frac = float(op.executed_fraction.subs(S.seq, seq))
        assert frac == pytest.approx(0.5 + ATTENTION_TILE / (2 * seq))
    r = _eval(model, training, flash, 64)
    # same model flops as if the scores were materialized (both count the full s^2 terms)
    s_b = 2 * model.num_layers * seq * seq * model.num_heads * model.head_dim
    attention_share = 3 * 2 * s_b * 8 / r["flops_model"]  # 2 GEMMs, fwd+bwd, 8 sequences
    assert attention_share > 0.5
    ratio = r["flops_model_causal"] / r["flops_model"]
    expected = 1 - attention_share * (1 - (0.5 + ATTENTION_TILE / (2 * seq)))
    assert ratio == pytest.approx(expected, rel=1e-9)
    assert r["mfu_causal"] / r["mfu"] == pytest.approx(ratio)


def test_decode_attention_is_not_masked():
    from stage_dse.graph.transformer import build_serving_graphs, graph_key

    model = load_model("llama3_8b")
    plan = ParallelPlan(dp=1, tp=1)
    key = graph_key(model, plan, TrainingSpec(seq_len=1, global_batch_size=1))
    decode = build_serving_graphs(key, "decode", 2)
    prefill = build_serving_graphs(key, "prefill", 2)
    (dec,) = [op for op in decode.block.ops if op.kind is OpKind.ATTENTION]
    (pre,) = [op for op in prefill.block.ops if op.kind is OpKind.ATTENTION]
    assert dec.executed_fraction == 1
    assert pre.executed_fraction != 1


def test_causal_kernel_shortens_long_context_steps():
    """Attention time follows executed flops: at 32K context the step is shorter than the same
    work timed as full s x s (the counted flops over the step's matmul time would say)."""
    model = load_model("llama3_8b")
    plan = ParallelPlan(dp=1, tp=8, cp=4, sequence_parallel=True, recompute="full")
    short = _eval(model, TrainingSpec(seq_len=8192, global_batch_size=4), plan, 32)
    long = _eval(model, TrainingSpec(seq_len=32768, global_batch_size=1), plan, 32)
    # same tokens per step; counted flops grow with s, executed attention only by half of it
    counted = long["flops_model"] / short["flops_model"]
    executed = long["flops_model_causal"] / short["flops_model_causal"]
    assert executed < counted
    assert long["time_step_s"] / short["time_step_s"] < counted
    assert math.isfinite(long["mfu_causal"])


# --------------------------------------------------------------------------- gradient dtype
@pytest.mark.parametrize(("grads", "per_param"), [("bf16", 2), ("fp32", 4)])
def test_data_parallel_gradient_reduction_moves_gradient_bytes(grads, per_param):
    """Megatron-LM accumulates and all-reduces fp32 main gradients: 4 bytes per parameter."""
    model = load_model("llama3_8b")
    training = TrainingSpec(seq_len=4096, global_batch_size=64, grads_dtype=grads)
    r = evaluate_plan(model, training, ParallelPlan(dp=8))
    assert r["comm_all_reduce_cp-ep-dp"] == pytest.approx(per_param * r["params_total"])
    # ZeRO-1/2 reduce-scatter the same gradients; the updated 16-bit weights are gathered
    r1 = evaluate_plan(model, training, ParallelPlan(dp=8, zero_stage=1))
    assert r1["comm_reduce_scatter_cp-ep-dp"] == pytest.approx(per_param * r["params_total"])
    assert r1["comm_all_gather_cp-ep-dp"] == pytest.approx(2 * r["params_total"])
