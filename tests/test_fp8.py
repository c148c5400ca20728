"""FP8 GEMMs: linear layers on FP8 tensor cores, their kept inputs cached in one byte."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from conftest import gpt

from stage_dse.config import load_cluster, load_hardware
from stage_dse.cost.bind import bind, bind_hardware, evaluate_plan
from stage_dse.cost.derive import cost_key
from stage_dse.cost.recompute import is_linear
from stage_dse.cost.time import _fp8_quantized_numel, section_time
from stage_dse.errors import ConfigError
from stage_dse.graph import OpKind, build_graphs
from stage_dse.graph.symbols import Symbols
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import ParallelPlan, TrainingSpec

H100 = load_hardware("h100_sxm")
S_, B_, H_, L_ = 2048, 2, 1024, 4


def training(gemm: str) -> TrainingSpec:
    return TrainingSpec(seq_len=S_, global_batch_size=B_, gemm_dtype=gemm)


@pytest.mark.parametrize(("attention", "per_layer"), [("flash", 6), ("materialized", 7)])
def test_fp8_caches_exactly_the_inputs_only_linear_layers_keep(attention, per_layer):
    """Korthikanti et al. Table 2's tensors that only a linear layer keeps: the QKV input
    (sbh), the MLP input (sbh) and the GeLU output feeding fc2 (4sbh), plus the attention
    output under the unfused kernel, where only o_proj keeps it (flash keeps it too); and the
    final norm output the logits GEMM keeps. Each drops from two bytes to one per element."""
    plan = ParallelPlan(dp=1, micro_batch_size=B_, attention=attention)
    got = {
        g: evaluate_plan(gpt(layers=L_, hidden=H_, heads=16), training(g), plan)
        for g in ("bf16", "fp8")
    }
    saved = got["bf16"]["mem_activations_bytes"] - got["fp8"]["mem_activations_bytes"]
    assert saved == (per_layer * L_ + 1) * S_ * B_ * H_
    for k in ("params", "model_flops", "mem_weights_bytes", "mem_optimizer_bytes"):
        assert got["bf16"][k] == got["fp8"][k]


def test_fp8_halves_the_time_of_compute_bound_linear_gemms_only():
    """On FP8 tensor cores at twice the bf16 peak (H100: 1979 vs 989 TFLOP/s, made exactly 2x
    here), every linear GEMM of a layer that is compute bound takes half the time, plus a
    quantize kernel for its 16-bit input (forward: the activation; input gradient: the output
    gradient; the weight gradient reuses both): 3 bytes per element streamed, never below the
    element-wise floor. Attention and element-wise kernels do not change."""
    model = gpt(layers=4, hidden=8192, heads=64)
    plan = ParallelPlan(dp=1, micro_batch_size=1)
    key = cost_key(model, plan, training("fp8"))
    st = section_time(build_graphs(model, plan, training("fp8")).block, key)
    cl = load_cluster("dgx_h100", num_gpus=1)

    # exactly twice the peak at the same efficiency and no shape dependence (the presets'
    # FP8 GEMMs reach less of their peak, and only at larger shapes: the test below)
    hw = dataclasses.replace(
        H100,
        peak_fp8_flops=2 * H100.peak_flops,
        fp8_gemm_efficiency=H100.gemm_efficiency,
        gemm_half_dim=1e-9,
        fp8_gemm_half_dim=1e-9,
    )

    def num(expr, gemm):
        values = {**bind(model, training(gemm), plan), **bind_hardware(hw, cl)}
        return float(expr.xreplace({Symbols.all()[k]: v for k, v in values.items()}))

    graph = build_graphs(model, plan, training("fp8")).block
    bandwidth = hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency
    quantize = 0.0
    for op in graph.ops:
        if op.kind is OpKind.EINSUM and is_linear(op):
            numel = num(_fp8_quantized_numel(op), "fp8")
            if numel:
                quantize += max(3 * numel / bandwidth, hw.elementwise_floor_s)
    assert quantize > 0
    gemm_bf16 = num(st.gemm, "bf16")
    assert num(st.gemm, "fp8") == pytest.approx(gemm_bf16 / 2 + quantize, rel=1e-12)
    layer = st.fwd + st.bwd
    assert num(layer, "bf16") - num(layer, "fp8") == pytest.approx(
        gemm_bf16 / 2 - quantize, rel=1e-9
    )
    assert num(st.attention, "fp8") == num(st.attention, "bf16")


def test_fp8_needs_fp8_tensor_cores():
    a100 = load_hardware("a100_80gb")
    with pytest.raises(ConfigError, match="gemm_dtype=fp8 needs FP8 tensor cores; hardware a100"):
        evaluate_plan(
            gpt(), training("fp8").replace(global_batch_size=64), ParallelPlan(dp=8), hardware=a100,
            cluster=load_cluster("dgx_a100", num_gpus=8),
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"training\.gemm_dtype='fp32' is not one of"):
        TrainingSpec(seq_len=2048, global_batch_size=8, gemm_dtype="fp32")


def test_fp8_rows_are_distinct_configurations_in_a_sweep(tmp_path):
    def spec(gemm: str) -> SweepSpec:
        return SweepSpec(
            name="fp8",
            models=(gpt(layers=4, hidden=1024, heads=16),),
            training=TrainingSpec(seq_len=2048, global_batch_size=32, gemm_dtype=gemm),
            # without the host's issue of each op, which bounds this 4-layer model's steps in
            # both precisions alike
            hardware=(H100.replace(host_op_s=0.0),),
            cluster=load_cluster("dgx_h100"),
            gpu_counts=(8,),
            space=SearchSpace(micro_batch_size=(1, 2), zero_stage=(1,)),
        )

    store = ResultStore(tmp_path / "fp8")
    a = run_grid(spec("bf16"), LocalExecutor(), store, progress=False)
    b = run_grid(spec("fp8"), LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert a.evaluated == b.evaluated == len(df) / 2 and df["config_hash"].is_unique
    ok = df[df.status == "ok"]
    by = ok.pivot_table(index=["dp", "tp", "pp", "micro_batch", "recompute"], columns="gemm_bytes",
                        values="step_s")  # fmt: skip
    # distinct results; on this small model (hidden 1024) FP8's quantize kernels eat part of the
    # GEMM speed-up, so it need not win everywhere (the GEMM-time rule is tested above)
    assert isinstance(by, pd.DataFrame) and len(by) and (by[1] != by[2]).all()


def test_mfu_is_measured_against_the_peak_of_the_gemm_precision():
    model, plan = gpt(layers=4, hidden=2048, heads=16), ParallelPlan(dp=8)
    t = TrainingSpec(seq_len=2048, global_batch_size=64, gemm_dtype="fp8")
    r = evaluate_plan(model, t, plan, hardware=H100, cluster=load_cluster("dgx_h100", num_gpus=8))
    per_gpu = r["model_flops"] / (r["step_s"] * 8)
    assert r["mfu"] == pytest.approx(per_gpu / H100.peak_fp8_flops, rel=1e-12)


def test_fp8_gemms_saturate_at_larger_shapes_than_bf16_ones():
    """FP8 GEMMs reach half their large-GEMM rate at a weight dimension of
    ``fp8_gemm_half_dim`` (H100: 1,030, fitted to AIConfigurator's FP8 GEMM table) and a token
    dimension of twice ``gemm_half_dim``; bf16 ones at ``gemm_half_dim`` (128) for both: the
    compute-bound time of fc1 (8,192 tokens, 2,048 x 8,192 weights) is
    flops / (peak x efficiency x d / (d + half)) with d = 2,048, in each precision."""
    assert H100.fp8_gemm_half_dim == 1030 and H100.gemm_half_dim == 128
    assert load_hardware("a100_80gb").fp8_gemm_half_dim == 128  # none given: the bf16 one
    model = gpt(layers=2, hidden=2048, heads=16)
    plan = ParallelPlan(dp=1, micro_batch_size=4)
    cl = load_cluster("dgx_h100", num_gpus=1)
    from stage_dse.cost.kernel_time import _gemm_time, gemm_mnk

    for gemm, peak, eff, half in (
        ("bf16", H100.peak_flops, H100.gemm_efficiency, H100.gemm_half_dim),
        ("fp8", H100.peak_fp8_flops, H100.fp8_gemm_efficiency, H100.fp8_gemm_half_dim),
    ):
        values = {**bind(model, training(gemm), plan), **bind_hardware(H100, cl)}

        def num(expr, values=values):
            return float(expr.xreplace({Symbols.all()[k]: v for k, v in values.items()}))

        graph = build_graphs(model, plan, training(gemm)).block
        fc1 = next(op for op in graph.ops if op.name == "fc1" and op.kind is OpKind.EINSUM)
        d = min(num(x) for x in gemm_mnk(fc1))
        assert d == 2048
        expected = num(fc1.flops) / (peak * H100.sustained_clock * eff * d / (d + half))
        assert num(_gemm_time(fc1)[0]) == pytest.approx(expected + H100.kernel_launch_s)


def test_fp8_gemms_in_a_training_step_run_at_the_step_share_of_their_efficiency():
    """``fp8_step_efficiency`` scales the FP8 GEMMs of a training step (per-tensor and MXFP8
    alike) and nothing else: a compute-bound FP8 GEMM takes 1 / share of its time, bf16
    GEMMs and attention keep theirs, and a serving row of the same part binds 1 (engine
    iterations run as the kernel tables time them)."""
    import math

    from stage_dse.config import load_model
    from stage_dse.cost.kernel_time import _gemm_time
    from stage_dse.cost.serving import evaluate_serving_table
    from stage_dse.runner.serving import serving_row
    from stage_dse.spec.serving import ServingSpec

    share = 0.8
    b200 = dataclasses.replace(load_hardware("b200"), fp8_step_efficiency=1.0)  # the tables' rate
    slow = dataclasses.replace(b200, fp8_step_efficiency=share)
    model = gpt(layers=2, hidden=8192, heads=64)
    plan = ParallelPlan(dp=1, micro_batch_size=4)
    cl = load_cluster("hgx_b200", num_gpus=1)
    for gemm, ratio in (("fp8", 1 / share), ("bf16", 1.0)):
        graph = build_graphs(model, plan, training(gemm)).block
        fc1 = next(op for op in graph.ops if op.name == "fc1" and op.kind is OpKind.EINSUM)
        times = []
        for hw in (b200, slow):
            values = {**bind(model, training(gemm), plan), **bind_hardware(hw, cl)}
            subs = {Symbols.all()[k]: v for k, v in values.items()}
            times.append(float(_gemm_time(fc1)[0].xreplace(subs)) - hw.kernel_launch_s)
        assert times[1] / times[0] == pytest.approx(ratio, rel=1e-12)
    serving = ServingSpec(prompt_len=2048, output_tokens=128, batch_size=8, weights_dtype="fp8")
    out = []
    for hw in (b200, slow):
        row, key = serving_row(load_model("llama3_8b"), serving, hw, cl, 1)
        assert row["fp8_step_efficiency"] == 1.0
        out.append(evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0])
    assert math.isclose(out[0]["serve_tpot_s"], out[1]["serve_tpot_s"], rel_tol=1e-15)
    with pytest.raises(ConfigError, match="fp8_step_efficiency"):
        dataclasses.replace(b200, fp8_step_efficiency=1.5)
