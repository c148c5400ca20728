"""FP4 weights: NVFP4 / MXFP4 sizes with their scales, W4A4 on FP4 tensor cores, W4A16
(weight-only) on GPUs without them, experts in their own format, rejections (4-bit KV caches
and training)."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import sympy as sp

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.cost.time import gemm_precision_weights
from stage_dse.errors import ConfigError
from stage_dse.graph.ir import Role
from stage_dse.graph.symbols import S
from stage_dse.graph.transformer import build_serving_graphs
from stage_dse.runner.serving import serving_row
from stage_dse.spec import DType, ParallelPlan, TrainingSpec
from stage_dse.spec.serving import ServingSpec, weight_only

B200 = load_hardware("b200")


def serve(weights: str, hardware=B200, cluster: str = "hgx_b200", batch: int = 1, tp: int = 1):
    model = load_model("llama3_70b")
    spec = ServingSpec(prompt_len=2048, output_tokens=256, batch_size=batch, weights_dtype=weights)
    row, key = serving_row(model, spec, hardware, load_cluster(cluster, num_gpus=8), tp)
    return row, evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]


def test_block_scaled_formats_count_their_scales():
    """NVFP4: E2M1 values with one E4M3 scale per 16 (4.5 bits); MXFP4: one E8M0 per 32."""
    assert DType.NVFP4.bytes == (4 + 8 / 16) / 8 == 0.5625
    assert DType.MXFP4.bytes == (4 + 8 / 32) / 8 == 0.53125
    assert ServingSpec(prompt_len=8, weights_dtype="fp4").weights_dtype is DType.NVFP4
    assert ServingSpec(prompt_len=8, weights_dtype="FP4").weights_dtype is DType.NVFP4


@pytest.mark.parametrize("weights, bits", [("nvfp4", 4.5), ("mxfp4", 4.25), ("fp4", 4.5)])
def test_fp4_weights_are_a_quarter_of_bf16_plus_scales(weights, bits):
    _, bf16 = serve("bf16")
    _, fp4 = serve(weights)
    ratio = fp4["serve_weights_bytes"] / bf16["serve_weights_bytes"]
    assert ratio == pytest.approx(bits / 16, rel=1e-12)
    assert 0.25 < ratio < 0.29


def test_nvfp4_runs_w4a4_on_the_fp4_peak_and_mxfp4_w4a8():
    row, _ = serve("nvfp4")
    assert row["gemm_bytes"] == 0.5625 and row["param_bytes"] == 0.5625
    assert row["peak_fp4_flops"] == 9000e12
    row, _ = serve("mxfp4")  # MXFP4 weights x MXFP8 activations (TensorRT-LLM on Blackwell)
    assert row["gemm_bytes"] == 1 and row["param_bytes"] == 0.53125
    like = ServingSpec(prompt_len=8, weights_dtype="nvfp4").step_like(B200)
    assert like.gemm_dtype is DType.NVFP4


@pytest.mark.parametrize(
    "gemm_bytes, expected", [(2, (1, 0, 0)), (1, (0, 1, 0)), (0.5625, (0, 0, 1))]
)
def test_precision_weights_pick_one_tensor_core_class(gemm_bytes, expected):
    got = tuple(
        float(w.subs(S.gemm_bytes, sp.nsimplify(gemm_bytes))) for w in gemm_precision_weights()
    )
    assert got == expected


def test_decode_and_prefill_are_faster_with_fp4_than_fp8_on_b200():
    """Decode at batch 1 streams the weights: 4.5 bits instead of 8; prefill runs on the FP4
    peak (twice FP8's, at a lower measured efficiency)."""
    _, fp8 = serve("fp8")
    _, fp4 = serve("fp4")
    assert fp4["serve_tpot_s"] < 0.8 * fp8["serve_tpot_s"]
    assert fp4["serve_ttft_s"] < fp8["serve_ttft_s"]
    _, fp4_8 = serve("fp4", batch=8)
    assert fp4_8["serve_tpot_s"] < serve("fp8", batch=8)[1]["serve_tpot_s"]


def test_activations_stay_16_bit_under_fp4_weights():
    """Only the weights (and each GEMM's quantized input) are 4-bit: every activation has the
    size it has under bf16 weights (16-bit; the attention's log-sum-exp fp32)."""
    model = load_model("llama3_8b")
    sizes = {}
    for weights in ("bf16", "nvfp4"):
        spec = ServingSpec(prompt_len=128, weights_dtype=weights)
        _, key = serving_row(model, spec, B200, load_cluster("hgx_b200", num_gpus=8), 1)
        graphs = build_serving_graphs(key.graph, "decode", key.kv_bytes)
        outs = [t for g in graphs.sections for op in g.ops for t in op.outputs]
        sizes[weights] = {t.name: t.dtype_bytes for t in outs if t.role is Role.ACTIVATION}
        weight_sizes = {w.dtype_bytes for g in graphs.sections for w in g.weights}
    assert sizes["nvfp4"] == sizes["bf16"] and set(sizes["bf16"].values()) == {2, 4}
    assert weight_sizes == {sp.Rational(9, 16)}


@pytest.mark.parametrize("hw", ["h100_sxm", "a100_80gb", "h200", "l40s", "gh200"])
@pytest.mark.parametrize("weights", ["fp4", "mxfp4"])
def test_gpus_without_fp4_tensor_cores_run_4_bit_weights_w4a16(hw, weights):
    """No FP4 tensor cores: the weights stay 4-bit in memory (scales included), the GEMMs run
    on the 16-bit tensor cores (gemm_bytes 2), and the row says weight-only."""
    hardware = load_hardware(hw)
    spec = ServingSpec(prompt_len=8, weights_dtype=weights)
    like = spec.step_like(hardware)
    assert like.gemm_dtype is DType.BF16 and like.params_dtype.is_fp4
    assert weight_only(spec, hardware) and not weight_only(spec, B200)
    row, _ = serve(weights, hardware, "dgx_h100")
    assert row["gemm_bytes"] == 2 and row["param_bytes"] == spec.weights_dtype.bytes < 0.6
    assert row["weight_only"]
    assert [float(w.subs(S.gemm_bytes, row["gemm_bytes"])) for w in gemm_precision_weights()] == [
        1,
        0,
        0,
    ]


H100 = load_hardware("h100_sxm")


def test_w4a16_reads_4_bit_weights_at_the_bf16_gemm_rate():
    """Against bf16 weights on the same GPU: weight bytes x 4.25/16, batch-1 decode (streaming
    the weights) faster, and a long prefill (compute bound at the same 16-bit peak) the same
    to within what the weights' bytes add to its kernels' roofline."""
    _, bf16 = serve("bf16", H100, "dgx_h100", tp=8)
    _, w4 = serve("mxfp4", H100, "dgx_h100", tp=8)
    ratio = w4["serve_weights_bytes"] / bf16["serve_weights_bytes"]
    assert ratio == pytest.approx(4.25 / 16, rel=1e-12)
    assert w4["serve_tpot_s"] < 0.8 * bf16["serve_tpot_s"]
    # (the W4A16 shape law counts tokens r = 4 times against the weights' width, which binds
    # only past the fused gate-up GEMM's 7,168 columns: a few % faster, not 4x)
    assert w4["serve_ttft_s"] == pytest.approx(bf16["serve_ttft_s"], rel=0.03)
    assert w4["serve_ttft_s"] <= bf16["serve_ttft_s"]


def test_expert_weights_in_their_own_format():
    """gpt-oss: MXFP4 experts, the rest bf16 (weight bytes by hand from the parameter
    counts), the GEMMs in bf16; a dense model has no experts to give a format."""
    model = load_model("gpt_oss_120b")
    params = evaluate_plan(model, TrainingSpec(seq_len=8, global_batch_size=1), ParallelPlan())
    experts = model.num_layers * model.num_experts * 3 * model.hidden_size**2  # width 2880
    rest = params["params"] - experts
    spec = ServingSpec(prompt_len=1024, weights_dtype="bf16", expert_weights_dtype="mxfp4")
    row, key = serving_row(model, spec, H100, load_cluster("dgx_h100", num_gpus=8), 1)
    got = evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]
    assert got["serve_weights_bytes"] == pytest.approx(2 * rest + experts * 17 / 32, rel=1e-12)
    assert got["serve_weights_bytes"] < H100.usable_bytes  # one 80 GB GPU, as the card says
    assert row["gemm_bytes"] == 2 and row["param_bytes"] == 2 and row["weight_only"]
    assert key.graph.expert_param_bytes == 0.53125
    plain = ServingSpec(prompt_len=1024, expert_weights_dtype="bf16")
    assert serving_row(model, plain, H100, load_cluster("dgx_h100", num_gpus=8), 1)[
        1
    ].graph == (serving_row(model, ServingSpec(prompt_len=1024), H100,
                            load_cluster("dgx_h100", num_gpus=8), 1)[1].graph)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^serving\.expert_weights_dtype=mxfp4 needs a mix"):
        serving_row(load_model("llama3_8b"), spec, H100, load_cluster("dgx_h100", num_gpus=8), 1)


def test_a_4_bit_kv_cache_and_4_bit_training_are_rejected():
    with pytest.raises(ConfigError, match=r"^serving\.kv_dtype=nvfp4: a 4-bit KV cache"):
        ServingSpec(prompt_len=8, kv_dtype="fp4")
    with pytest.raises(ConfigError, match=r"^training\.params_dtype=nvfp4 is a serving"):
        TrainingSpec(seq_len=8, global_batch_size=8, params_dtype="nvfp4")
    # NVFP4 GEMMs train (tests/test_nvfp4_training.py); MXFP4 ones do not
    with pytest.raises(ConfigError, match=r"^training\.gemm_dtype='mxfp4' is not one of"):
        TrainingSpec(seq_len=8, global_batch_size=8, gemm_dtype="mxfp4")


def test_fp4_corpus_cases_are_expressible_where_the_gpu_has_fp4():
    from stage_dse.validation.corpus import load_corpus
    from stage_dse.validation.serving import prepare

    cases = [c for c in load_corpus("serving") if c.fields.get("weights") == "fp4"]
    on_b200 = [c for c in cases if c.fields["hardware"] == "b200"][:20]
    assert on_b200
    prepared = prepare(on_b200)
    assert not any("dtype" in r for r in prepared.unexpressible.values())
    assert prepared.index
    hopper = dataclasses.replace(
        on_b200[0], fields={**on_b200[0].fields, "hardware": "h100_sxm", "cluster": "dgx_h100"}
    )
    # on Hopper the same record runs W4A16 rather than being turned away
    assert "dtype" not in prepare([hopper]).unexpressible.get(hopper.id, "")


def test_gpt_oss_fp4_records_serve_mxfp4_experts():
    from stage_dse.validation.corpus import load_corpus
    from stage_dse.validation.serving import _row

    cases = [c for c in load_corpus("serving") if c.fields.get("model") == "gpt_oss_20b"]
    case = next(c for c in cases if c.fields.get("weights") == "fp4")
    row, key = _row(case)
    assert key.graph.expert_param_bytes == 0.53125 and key.graph.param_bytes == 2
    assert row["weight_only"] == (case.fields["hardware"] in ("h100_sxm", "a100_80gb"))
    # TensorRT-LLM's "FP8" column for gpt-oss on Hopper: the same checkpoint run W4A16
    # (bf16 activations, MXFP4 experts), not FP8 linear layers
    hopper = next(c for c in cases if c.fields.get("weights") == "fp8")
    row, key = _row(hopper)
    assert key.graph.expert_param_bytes == 0.53125 and key.graph.param_bytes == 2
    assert row["gemm_bytes"] == 2 and row["weight_only"]


def test_int4_weights_count_a_scale_and_a_zero_per_group_of_128():
    """AWQ / GPTQ: 4-bit integers, a 16-bit scale and a 4-bit zero per 128 values."""
    assert DType.INT4.bytes == (4 + 20 / 128) / 8 == 0.51953125
    _, bf16 = serve("bf16")
    _, w4 = serve("int4")
    ratio = w4["serve_weights_bytes"] / bf16["serve_weights_bytes"]
    assert ratio == pytest.approx((4 + 20 / 128) / 16, rel=1e-12)


@pytest.mark.parametrize("hw", ["h100_sxm", "a100_80gb", "b200"])
def test_int4_weights_are_weight_only_on_every_gpu(hw):
    """No engine multiplies INT4 weights on integer or FP4 tensor cores: the GEMMs run in
    16-bit (Marlin's W4A16) even where the GPU has FP4 ones, and batch-1 decode streams
    the 4-bit weights, faster than bf16; a long prefill stays at the bf16 rate."""
    hardware = load_hardware(hw)
    spec = ServingSpec(prompt_len=8, weights_dtype="int4")
    assert spec.step_like(hardware).gemm_dtype is DType.BF16 and weight_only(spec, hardware)
    row, w4 = serve("int4", hardware, "dgx_h100", tp=8)
    _, bf16 = serve("bf16", hardware, "dgx_h100", tp=8)
    assert row["gemm_bytes"] == 2 and row["weight_only"]
    assert w4["serve_tpot_s"] < 0.8 * bf16["serve_tpot_s"]
    # (the W4A16 shape law counts tokens r = 4 times against the weights' width, which binds
    # only past the fused gate-up GEMM's 7,168 columns: a few % faster, not 4x)
    assert w4["serve_ttft_s"] == pytest.approx(bf16["serve_ttft_s"], rel=0.03)


def test_int4_is_a_serving_format_and_no_kv_cache_format():
    with pytest.raises(ConfigError, match=r"^serving\.kv_dtype=int4: a 4-bit KV cache"):
        ServingSpec(prompt_len=8, kv_dtype="int4")
    with pytest.raises(ConfigError, match=r"^training\.params_dtype=int4 is a serving"):
        TrainingSpec(seq_len=8, global_batch_size=8, params_dtype="int4")


def test_fp4_gemms_saturate_at_larger_weight_dimensions():
    """NVFP4 GEMMs reach half their large-GEMM rate at a weight dimension of
    ``fp4_gemm_half_dim`` (B200: 1,670, fitted to AIConfigurator's NVFP4 GEMM table as the FP8
    half dimensions are) and, like FP8 ones, at a token dimension of twice ``gemm_half_dim``:
    the compute-bound prefill GEMMs of Llama-3-70B in NVFP4 on B200 take
    flops / (FP4 peak x E x min(t / (t + 256), w / (w + 1,670))) for their own t and w."""
    from stage_dse.cost.kernel_time import _gemm_time, gemm_mnk
    from stage_dse.cost.serving import PASSES, serving_key

    assert (B200.fp4_gemm_half_dim, B200.fp4_gemm_efficiency) == (1670, 0.53)
    # a preset without a fit of its own saturates as its FP8 GEMMs do
    h100 = load_hardware("h100_sxm")
    assert h100.fp4_gemm_half_dim == h100.fp8_gemm_half_dim
    model = load_model("llama3_70b")
    spec = ServingSpec(prompt_len=2048, output_tokens=8, weights_dtype="nvfp4")
    plan_row, _ = serving_row(model, spec, B200, load_cluster("hgx_b200", num_gpus=8), 1)
    key = serving_key(model, spec, ParallelPlan(dp=1))
    values = {
        getattr(S, k): v for k, v in plan_row.items() if isinstance(getattr(S, k, None), sp.Symbol)
    }
    values.update({s: e.xreplace(values) for s, e in PASSES["prefill"].items()})
    block = build_serving_graphs(key.graph, "prefill", key.kv_bytes).block
    checked = 0
    for name in ("q_proj", "o_proj", "fc1", "fc2"):
        op = next((o for o in block.ops if o.name == name and o.kind.name == "EINSUM"), None)
        if op is None:
            continue
        m, n, k = (float(x.xreplace(values)) for x in gemm_mnk(op))
        w = min(n, k)
        shape = min(m / (m + 2 * B200.gemm_half_dim), w / (w + B200.fp4_gemm_half_dim))
        flops = float(op.flops.xreplace(values))
        compute = flops / (B200.peak_fp4_flops * B200.sustained_clock * 0.53 * shape)
        got = float(_gemm_time(op)[0].xreplace(values))
        assert got == pytest.approx(compute + B200.kernel_launch_s, rel=1e-9), name
        checked += 1
    assert checked >= 3


def test_w4a16_expert_gemms_run_at_their_measured_ceiling():
    """gpt-oss's MXFP4 experts on Hopper (W4A16): a long prefill, whose expert GEMMs are compute
    bound, is slower than at the 16-bit GEMM rate, by at most the ratio of the two ceilings;
    batch-1 decode, where the same GEMMs stream their weights, is unchanged; the Hopper value is
    the tables' 380 TFLOP/s, Blackwell's the tables' 541 (its cap binds only where an engine feeds
    the experts bf16, vLLM's default there)."""
    model = load_model("gpt_oss_120b")
    cluster = load_cluster("dgx_h100", num_gpus=8)
    assert H100.w4a16_moe_efficiency == pytest.approx(380 / 989, abs=1e-3)
    assert H100.w4a16_moe_efficiency < H100.gemm_efficiency
    assert B200.w4a16_moe_efficiency == pytest.approx(541 / 2250, abs=1e-3)  # vLLM's W4A16 path
    uncapped = dataclasses.replace(H100, w4a16_moe_efficiency=H100.gemm_efficiency)

    def run(hardware, prompt, batch):
        spec = ServingSpec(
            prompt_len=prompt,
            output_tokens=64,
            batch_size=batch,
            weights_dtype="bf16",
            expert_weights_dtype="mxfp4",
        )
        row, key = serving_row(model, spec, hardware, cluster, 1)
        return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]

    capped, free = run(H100, 8192, 4), run(uncapped, 8192, 4)
    slower = capped["serve_ttft_s"] / free["serve_ttft_s"]
    assert 1.05 < slower <= H100.gemm_efficiency / H100.w4a16_moe_efficiency
    assert run(H100, 128, 1)["serve_tpot_s"] == pytest.approx(
        run(uncapped, 128, 1)["serve_tpot_s"], rel=1e-9
    )


def test_engines_choose_the_activations_of_mxfp4_experts_on_fp4_hardware():
    """gpt-oss's MXFP4 experts on B200: TensorRT-LLM and SGLang feed them MXFP8 (W4A8, the FP8
    tensor cores), vLLM bf16 by default; the rest of the pass stays 16-bit, a long prefill is
    faster under W4A8, and Hopper runs the experts weight-only whatever the engine."""
    from stage_dse.config.presets import load_engine

    model = load_model("gpt_oss_120b")
    cluster = load_cluster("hgx_b200", num_gpus=8)
    spec = ServingSpec(
        prompt_len=8192, output_tokens=64, batch_size=4, weights_dtype="bf16",
        expert_weights_dtype="mxfp4",
    )  # fmt: skip
    trtllm, sglang, vllm = (load_engine(n) for n in ("trtllm", "sglang", "vllm"))
    assert trtllm.expert_gemm_bytes(spec, B200) == 1.0
    assert sglang.expert_gemm_bytes(spec, B200) == 1.0
    assert vllm.expert_gemm_bytes(spec, B200) == 2.0
    assert trtllm.expert_gemm_bytes(spec, H100) == 2.0  # no FP4 tensor cores: W4A16
    assert trtllm.expert_gemm_bytes(spec.replace(expert_weights_dtype=None), B200) == 2.0

    def ttft(engine):
        row, key = serving_row(model, spec, B200, cluster, 1)
        row["expert_gemm_bytes"] = engine.expert_gemm_bytes(spec, B200)
        assert row["gemm_bytes"] == 2.0  # attention, router and embeddings stay bf16
        return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]["serve_ttft_s"]

    assert ttft(trtllm) < ttft(vllm)
    with pytest.raises(ConfigError, match=r"engine\.mxfp4_moe_activations"):
        trtllm.replace(mxfp4_moe_activations="fp4")
