"""Fused projections: query, key and value as one GEMM, gate and up as one (Megatron-Core's
linear_qkv and linear_fc1), against one GEMM per projection (torchtitan's wq, wk, wv, w1, w3)."""

from __future__ import annotations

import pytest
import sympy as sp

from stage_dse.config import load_cluster, load_framework, load_hardware, load_model
from stage_dse.cost.bind import bind, bind_hardware, evaluate_plan
from stage_dse.cost.kernel_time import _gemm_time, gemm_mnk
from stage_dse.graph import build_graphs
from stage_dse.graph.ir import OpKind, Phase, Role
from stage_dse.graph.symbols import S, Symbols
from stage_dse.results.schema import config_hash
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.spec import ParallelPlan, TrainingSpec

TRAINING = TrainingSpec(seq_len=4096, global_batch_size=64)


def _einsums(model: str, plan: ParallelPlan, training: TrainingSpec = TRAINING) -> dict:
    graphs = build_graphs(load_model(model), plan, training)
    return {op.name: op for op in graphs.block.ops if op.kind is OpKind.EINSUM}


@pytest.mark.parametrize("fused", [True, False])
def test_each_projection_and_its_gradients_carry_the_width_of_the_gemm_it_runs_in(fused):
    """Mixtral (32 query heads over 8 key/value heads, R = 4): q runs in a GEMM (4 + 2) / 4 as
    wide as itself, k and v in one 6 times theirs, the experts' gate and up in one twice
    theirs; the input and weight gradients of each inherit it. Off: every width is 1."""
    ops = _einsums("mixtral_8x7b", ParallelPlan(dp=2, tp=4, ep=2, fused_projections=fused))
    rep = S.heads / S.kv_heads
    want = {
        "q_proj": (rep + 2) / rep,
        "k_proj": rep + 2,
        "v_proj": rep + 2,
        "experts.gate_proj": 2,
        "experts.up_proj": 2,
        "o_proj": 1,
        "experts.down_proj": 1,
    }
    for name, width in want.items():
        grads = [op for n, op in ops.items() if n.endswith(f"<-{name}")]
        assert len(grads) == 2, name  # the input gradient and the weight gradient
        for op in (ops[name], *grads):
            expected = sp.sympify(width) if fused else sp.Integer(1)
            assert sp.simplify(op.fused_width - expected) == 0, op.name


def test_the_fused_dimension_is_the_forward_output_features_in_every_pass():
    """Forward: n widens; input gradient (contracting over the output features): k; weight
    gradient (rows of the weight's output features): m. The other two stay as they are."""
    ops = _einsums("llama3_70b", ParallelPlan(dp=1, tp=8))
    fwd = ops["k_proj"]
    dgrad = next(op for n, op in ops.items() if n.endswith("<-k_proj") and "weight" not in n)
    wgrad = ops["d_k_proj.weight<-k_proj"]
    assert fwd.phase is Phase.FORWARD and wgrad.outputs[0].role is Role.GRAD
    f = fwd.fused_width
    for op, widened in ((fwd, 1), (dgrad, 2), (wgrad, 0)):
        plain, fused = gemm_mnk(op), gemm_mnk(op, fused=True)
        for i in range(3):
            expected = plain[i] * f if i == widened else plain[i]
            assert sp.simplify(fused[i] - expected) == 0, (op.name, i)


def _seconds(expr: sp.Expr, values: dict) -> float:
    every = Symbols.all()
    return float(expr.subs({every[k]: v for k, v in values.items() if k in every}))


def test_fused_key_and_value_gemms_run_at_the_query_s_efficiency():
    """Llama-3-70B on 8 B200s at tp 8 in FP8: alone, k and v are 128 columns a rank, far below
    the FP8 tensor cores' saturation; inside the fused GEMM (1,280 columns) every projection runs
    at one shape efficiency, so each takes time in proportion to its flops. Unfused, the
    narrow ones take several times their flops' share."""
    fp8 = TrainingSpec(seq_len=4096, global_batch_size=64, gemm_dtype="fp8")
    model = load_model("llama3_70b")
    values = {
        **bind_hardware(load_hardware("b200"), load_cluster("hgx_b200")),
        **bind(model, fp8, ParallelPlan(dp=1, tp=8)),
    }
    ratios = {}
    for fused in (True, False):
        ops = _einsums("llama3_70b", ParallelPlan(dp=1, tp=8, fused_projections=fused), fp8)
        t = {
            n: _seconds(_gemm_time(ops[n])[0] - S.kernel_launch_s, values)
            for n in ("q_proj", "k_proj")
        }
        ratios[fused] = t["k_proj"] / t["q_proj"]
    flops = model.num_kv_heads / model.num_heads  # 1/8
    assert ratios[True] == pytest.approx(flops, rel=1e-6)
    assert ratios[False] > 2 * flops


def test_fusing_shortens_a_grouped_query_step_and_torchtitan_runs_unfused():
    """The profiles: Megatron-Core fuses, torchtitan does not. A Llama-3-8B step on 8 H100s
    is shorter fused; a sweep's rows say which, and only unfused rows hash apart from the
    hashes rows had before the column existed."""
    assert load_framework("megatron_core").fused_projections
    assert not load_framework("torchtitan_fsdp2").fused_projections
    model, hw, cl = load_model("llama3_8b"), load_hardware("h100_sxm"), load_cluster("dgx_h100")
    steps = [
        evaluate_plan(
            model, TRAINING, ParallelPlan(dp=8, fused_projections=f), hardware=hw, cluster=cl
        )["step_s"]
        for f in (True, False)
    ]
    assert steps[0] < steps[1]
    space = SearchSpace(
        tp=(1, 2),
        pp=(1,),
        zero_stage=(1,),
        recompute=("none",),
        micro_batch_size=(1,),
        frameworks=(load_framework("megatron_core"), load_framework("torchtitan_fsdp2")),
    )
    table = enumerate_plans(model, TRAINING, hw, load_cluster("dgx_h100", num_gpus=8), space).table
    by_framework = table.groupby("framework", observed=True)["fused_projections"].unique()
    assert list(by_framework["megatron_core"]) == [True]
    assert list(by_framework["torchtitan_fsdp2"]) == [False]
    fused = table[table["fused_projections"]]
    before = config_hash(fused.drop(columns="fused_projections"))
    assert list(config_hash(fused)) == list(before)
    assert not set(config_hash(fused.assign(fused_projections=False))) & set(before)
