"""Serving: KV cache bytes, memory-bound decode, TTFT/TPOT, capacity, sweeps and traces."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, bind_hardware
from stage_dse.cost.serving import evaluate_serving_table, serving_key
from stage_dse.errors import ConfigError
from stage_dse.results import ResultStore, load
from stage_dse.runner.serving import (
    ServingSweepSpec,
    run_serving,
    serving_row,
    serving_top_table,
)
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.spec.serving import (
    ServingSpec,
    replicated_kv_heads,
    serving_plan,
    validate_serving,
)
from stage_dse.trace import check_trace_dir
from stage_dse.trace.serving import write_serving_trace

H100 = load_hardware("h100_sxm")


def serve(model_name, plan, serving, hw=H100):
    model = load_model(model_name)
    key = serving_key(model, serving, plan)
    like = serving.step_like(hw, replicas=plan.dp)
    cluster = load_cluster("dgx_h100", num_gpus=plan.num_gpus)
    row = {
        **bind(model, like, plan.replace(micro_batch_size=serving.batch_size)),
        **bind_hardware(hw, cluster),
        "prompt": serving.prompt_len,
        "output_tokens": serving.output_tokens,
    }
    return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_70b", "llama2_7b", "mixtral_8x7b"])
def test_kv_cache_bytes_per_token(preset):
    model = load_model(preset)
    got = serve(
        preset,
        ParallelPlan(
            tp=1 if preset != "mixtral_8x7b" else 2, expert_tensor_parallel=preset == "mixtral_8x7b"
        ),
        ServingSpec(prompt_len=1024),
    )
    assert (
        got["serve_kv_bytes_per_token"]
        == 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2
    )


def test_latent_attention_caches_one_latent_per_token_and_layer():
    """MLA caches the kv latent and the rotary key, (d_c + d_h^R) x layers elements per token
    (DeepSeek-V2 sec. 2.1.2): 61 x (512 + 64) x 2 bytes = 70,272 for DeepSeek-V3, 1/57 of
    what 128 uncompressed heads of keys and values would take. Shared by all heads, the latent
    is not split over tensor-parallel ranks: per-GPU cache bytes stay with tp (GQA's shrink)."""
    model = load_model("deepseek_v3")
    spec = ServingSpec(prompt_len=2048, output_tokens=256, batch_size=8, weights_dtype="fp8")
    tp4 = serve("deepseek_v3", ParallelPlan(tp=4, pp=4, expert_tensor_parallel=True), spec)
    tp8 = serve("deepseek_v3", ParallelPlan(tp=8, pp=4, expert_tensor_parallel=True), spec)
    per_token = model.num_layers * (model.kv_lora_rank + model.rope_head_dim) * 2
    assert tp4["serve_kv_bytes_per_token"] == per_token == 70_272
    mha = 2 * model.num_layers * model.num_heads * model.head_dim * 2  # the paper's 2 n_h d_h l
    assert mha / per_token == pytest.approx(56.9, abs=0.05)
    assert tp8["serve_kv_cache_bytes"] == tp4["serve_kv_cache_bytes"]
    gqa = [serve("llama3_70b", ParallelPlan(tp=t), spec)["serve_kv_cache_bytes"] for t in (4, 8)]
    assert gqa[1] == gqa[0] / 2


def test_latent_decode_absorbs_the_up_projections():
    """Decode attends over the cached latents with the key up-projection folded into the query
    and the value up-projection applied after: scores over kv_lora + rope_dim, values over
    kv_lora, per head and cached position; the latent is read once (flash kernel)."""
    from stage_dse.graph.ir import Role
    from stage_dse.graph.symbols import Symbols
    from stage_dse.graph.transformer import build_serving_graphs

    model = load_model("deepseek_v3")
    spec = ServingSpec(prompt_len=1024, batch_size=2)
    plan = ParallelPlan(tp=8, expert_tensor_parallel=True)
    key = serving_key(model, spec, plan)
    block = build_serving_graphs(key.graph, "decode", key.kv_bytes).block
    ops = {op.name: op for op in block.ops}
    assert {"q_absorb", "v_absorb", "latent_cache_write"} <= set(ops)
    assert "k_b_proj" not in ops and "v_b_proj" not in ops  # nothing decompressed per position
    attn = ops["core_attention"]
    like = TrainingSpec(seq_len=1, global_batch_size=2)
    values = {**bind(model, like, plan.replace(micro_batch_size=2)), "context": 1024}
    subs = {Symbols.all()[k]: v for k, v in values.items()}
    b, a, t, kl, r = 2, model.num_heads, 1024, model.kv_lora_rank, model.rope_head_dim
    assert float(attn.global_flops.xreplace(subs)) == 2 * b * a * t * (kl + r) + 2 * b * a * t * kl
    cache = next(x for x in attn.inputs if x.role is Role.KV_CACHE)
    read = sum(float(x.local_bytes.xreplace(subs)) for x in attn.inputs)
    assert read == pytest.approx(
        float((cache.local_bytes + attn.inputs[0].local_bytes).xreplace(subs))
    )
    assert float(cache.local_bytes.xreplace(subs)) == b * t * (kl + r) * 2


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_working_set_is_the_peak_of_live_activations(tp):
    """Buffers are reused as tensors die, so the prefill working set is the peak of one layer's
    live activations; for Llama 3 8B that is at the SwiGLU product: the residual stream, the
    gate and up projections and their product, h + 3 f / tp values per token."""
    got = serve("llama3_8b", ParallelPlan(tp=tp), ServingSpec(prompt_len=1024, batch_size=2))
    h, f = 4096, 14336
    assert got["serve_working_bytes"] == 2 * 1024 * (h + 3 * f / tp) * 2


def test_fp8_weights_run_fp8_gemms_where_the_hardware_has_them():
    """FP8 weights on H100 compute on FP8 tensor cores (prefill is compute bound: TTFT nearly
    halves); on A100 they are a storage format and GEMMs stay bf16 (TTFT barely moves)."""
    a100 = load_hardware("a100_80gb")
    ttft = {
        (hw.name, w): serve(
            "llama3_70b", ParallelPlan(tp=4), ServingSpec(prompt_len=4096, batch_size=8,
                                                          weights_dtype=w), hw
        )["serve_ttft_s"]
        for hw in (H100, a100)
        for w in ("bf16", "fp8")
    }  # fmt: skip
    # FP8 GEMMs at 0.59 of twice the peak against 0.65 for bf16; attention stays bf16
    assert ttft[("h100_sxm", "fp8")] < 0.7 * ttft[("h100_sxm", "bf16")]
    assert 0.9 * ttft[("a100_80gb", "bf16")] < ttft[("a100_80gb", "fp8")]
    assert ServingSpec(prompt_len=8, weights_dtype="fp8").step_like(a100).gemm_dtype == "bf16"
    assert ServingSpec(prompt_len=8, weights_dtype="fp8").step_like(H100).gemm_dtype == "fp8"


def test_fp8_cache_halves_the_kv_bytes():
    a = serve("llama3_8b", ParallelPlan(), ServingSpec(prompt_len=1024))
    b = serve("llama3_8b", ParallelPlan(), ServingSpec(prompt_len=1024, kv_dtype="fp8"))
    assert b["serve_kv_bytes_per_token"] == a["serve_kv_bytes_per_token"] / 2


def _kernel_floors_s(model_name: str, plan: ParallelPlan, hw) -> float:
    """Sum over the kernels of one decode step of their class's floor (GEMM, attention,
    element-wise; collectives and views have none)."""
    from stage_dse.graph import OpKind
    from stage_dse.graph.transformer import build_serving_graphs

    model = load_model(model_name)
    key = serving_key(model, ServingSpec(prompt_len=8), plan)
    graphs = build_serving_graphs(key.graph, "decode", key.kv_bytes)
    floor = {
        OpKind.EINSUM: hw.gemm_floor_s,
        OpKind.ATTENTION: hw.attention_floor_s,
        **{
            k: hw.elementwise_floor_s
            for k in (OpKind.ELEMENTWISE, OpKind.BIAS, OpKind.NORM, OpKind.LOSS, OpKind.EMBEDDING)
        },
    }

    def section(graph) -> float:
        return sum(floor.get(op.kind, 0.0) for op in graph.ops)

    blocks = model.num_layers * section(graphs.block)
    return section(graphs.embed) + blocks + section(graphs.head)


def test_decode_step_is_never_faster_than_its_kernels_floors():
    """Batch 1, TP 8: each GPU reads 1/8 of the weights, so bandwidth alone would make a token
    cheap; every one of the step's kernels still takes at least its measured floor."""
    plan = ParallelPlan(tp=8)
    got = serve("llama3_8b", plan, ServingSpec(prompt_len=512, output_tokens=64))
    floors = _kernel_floors_s("llama3_8b", plan, H100)
    assert floors > 0
    assert got["serve_tpot_s"] >= floors


def test_a_routed_expert_layer_pays_its_chain_latency_once_per_decode_step():
    """A mixture-of-experts decode step pays ``moe_layer_latency_s`` once per routed-expert
    layer (the kernel chain of routing, permutation and un-permutation that fused-MoE tables
    measure beyond the kernels' floors), the prefill once per layer too; a dense model pays
    nothing."""
    assert H100.moe_layer_latency_s == pytest.approx(25e-6)
    spec = ServingSpec(prompt_len=512, output_tokens=64)
    none = H100.replace(moe_layer_latency_s=0.0)
    for name, plan, layers in (
        ("mixtral_8x7b", serving_plan(load_model("mixtral_8x7b"), 1, 1, 1, 2), 32),
        ("llama3_8b", ParallelPlan(), 0),
    ):
        got, base = serve(name, plan, spec), serve(name, plan, spec, hw=none)
        extra = layers * H100.moe_layer_latency_s
        assert got["serve_tpot_s"] - base["serve_tpot_s"] == pytest.approx(extra, abs=1e-12)
        assert got["serve_ttft_s"] - base["serve_ttft_s"] == pytest.approx(extra, abs=1e-12)
        expert = got["serve_decode_expert_s"] - base["serve_decode_expert_s"]
        assert expert == pytest.approx(extra, abs=1e-12)


def test_decode_of_llama3_8b_on_one_h100_is_memory_bound():
    """Batch 1: every weight is read once per token, so the time per token is bounded below by
    weights / HBM bandwidth (16.1 GB / 3.35 TB/s = 4.8 ms); the model says why: its memory term
    dominates its compute term by orders of magnitude. Kernel floors (a few microseconds each)
    add at most their sum on top of the bandwidth estimate."""
    got = serve("llama3_8b", ParallelPlan(), ServingSpec(prompt_len=2048, output_tokens=256))
    floor = got["serve_weights_bytes"] / H100.hbm_bandwidth_bytes_per_s
    assert floor == pytest.approx(16.06e9 / 3.35e12, rel=0.01)
    assert got["serve_tpot_s"] >= floor
    # the achieved-bandwidth estimate: every weight but the input embedding table (a decode
    # step looks up one row per sequence) plus the KV cache, at memory_efficiency
    kv = got["serve_kv_bytes_per_token"] * (2048 + 128)
    embedding_table = 128256 * 4096 * 2
    bound = (got["serve_weights_bytes"] - embedding_table + kv) / (
        H100.hbm_bandwidth_bytes_per_s * H100.memory_efficiency
    )
    floors = _kernel_floors_s("llama3_8b", ParallelPlan(), H100)
    assert bound <= got["serve_tpot_s"] <= bound + floors
    assert got["serve_decode_memory_s"] > 100 * got["serve_decode_compute_s"]


def test_prefill_is_compute_bound_and_scales_with_prompt():
    a = serve("llama3_8b", ParallelPlan(), ServingSpec(prompt_len=2048, batch_size=8))
    b = serve("llama3_8b", ParallelPlan(), ServingSpec(prompt_len=4096, batch_size=8))
    assert 2.0 <= b["serve_ttft_s"] / a["serve_ttft_s"] < 2.4  # linear, plus attention's s^2
    flops = 2 * 8.03e9 * 8 * 2048  # 2 x params x tokens
    assert a["serve_ttft_s"] >= flops / H100.peak_flops


def test_batching_raises_throughput_and_tensor_parallel_cuts_latency():
    one = serve("llama3_70b", ParallelPlan(tp=8), ServingSpec(prompt_len=2048, batch_size=1))
    many = serve("llama3_70b", ParallelPlan(tp=8), ServingSpec(prompt_len=2048, batch_size=64))
    assert many["serve_tokens_per_s_per_gpu"] > 20 * one["serve_tokens_per_s_per_gpu"]
    tp4 = serve("llama3_70b", ParallelPlan(tp=4), ServingSpec(prompt_len=2048, batch_size=1))
    assert one["serve_tpot_s"] < tp4["serve_tpot_s"]


def test_kv_capacity():
    got = serve("llama3_8b", ParallelPlan(), ServingSpec(prompt_len=2048, output_tokens=256))
    per_seq = got["serve_kv_bytes_per_token"] * (2048 + 256)
    free = H100.usable_bytes - got["serve_weights_bytes"] - got["serve_working_bytes"]
    assert got["serve_kv_capacity_seqs"] == int(free // per_seq)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (ParallelPlan(dp=2), "serving plans use tp, pp and ep"),
        (ParallelPlan(dp=2, ep=2), "ep(2) > 1 needs a mixture-of-experts model"),
        (ParallelPlan(tp=16), "tp(16) does not divide kv_heads(8)"),
        (ParallelPlan(pp=100), "pp(100) > layers(32)"),
    ],
)
def test_serving_validation(plan, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_serving(load_model("llama3_8b"), ServingSpec(prompt_len=128), plan)


def test_expert_parallel_serving_splits_experts_and_counts_every_rank():
    """Mixtral with the experts over ep ranks, attention data-parallel over them: each GPU
    holds 1/ep of the expert weights (3 x h x f_e per expert and layer) and every dense weight;
    tokens/s per GPU counts the batches of all ep ranks; an all-to-all per layer moves tokens."""
    model = load_model("mixtral_8x7b")
    spec = ServingSpec(prompt_len=2048, batch_size=16)
    got = {ep: serve("mixtral_8x7b", serving_plan(model, 1, 1, 16, ep), spec) for ep in (2, 4)}
    expert_bytes = model.num_layers * 8 * 3 * 4096 * 14336 * 2
    split = got[2]["serve_weights_bytes"] - got[4]["serve_weights_bytes"]
    assert split == pytest.approx(expert_bytes * (1 / 2 - 1 / 4), rel=1e-12)
    r = got[4]
    assert r["serve_tokens_per_s_per_gpu"] == pytest.approx(4 * 16 / r["serve_tpot_s"] / 4)
    with pytest.raises(ConfigError, match=r"ep\(3\) does not divide experts\(8\)"):
        validate_serving(model, spec, serving_plan(model, 1, 1, 16, 3))
    with pytest.raises(ConfigError, match="dp = ep"):
        validate_serving(model, spec, serving_plan(model, 1, 1, 16, 2).replace(dp=4))


def test_serving_sweep_lands_in_parquet(tmp_path):
    spec = ServingSweepSpec(
        name="serve",
        model=load_model("llama3_70b"),
        hardware=(H100, load_hardware("h200")),
        cluster=load_cluster("dgx_h100"),
        tp=(2, 4, 8),
        pp=(1, 2),
        batch_sizes=(1, 32),
        prompt_lens=(2048, 8192),
    )
    store = ResultStore(tmp_path / "serve")
    report = run_serving(spec, store, log=lambda s: None)
    df = pd.read_parquet(tmp_path / "serve")
    assert len(df) == report.valid == 2 * 3 * 2 * 2 * 2 and df["config_hash"].is_unique
    assert set(df["workload"]) == {"serving"}
    ok = df[df.status == "ok"]
    assert len(ok) and (ok.mem_total_bytes <= ok.usable_memory).all()
    # H200's bandwidth makes decode faster for the same plan
    h100 = ok[
        (ok.hardware == "h100_sxm")
        & (ok.tp == 8)
        & (ok.pp == 1)
        & (ok.micro_batch == 32)
        & (ok.prompt == 2048)
    ]
    h200 = ok[
        (ok.hardware == "h200")
        & (ok.tp == 8)
        & (ok.pp == 1)
        & (ok.micro_batch == 32)
        & (ok.prompt == 2048)
    ]
    assert h200["tpot_s"].iloc[0] < h100["tpot_s"].iloc[0]
    assert run_serving(spec, store, log=lambda s: None).evaluated == 0  # rerun skips
    assert len(load(tmp_path / "serve")) == len(df)


def test_expert_parallel_serving_sweep(tmp_path):
    spec = ServingSweepSpec(
        name="moe",
        model=load_model("mixtral_8x7b"),
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        tp=(1, 2),
        ep=(1, 2, 4, 3),
        batch_sizes=(8,),
        prompt_lens=(1024,),
    )
    report = run_serving(spec, ResultStore(tmp_path / "moe"), log=lambda s: None)
    df = load(tmp_path / "moe")
    assert len(df) == report.valid == 2 * 3 and report.rejected  # ep 3 does not divide 8
    assert (df["num_gpus"] == df["tp"] * df["ep"]).all() and (df["dp"] == df["ep"]).all()
    assert set(serving_top_table(df).columns) >= {"tp", "pp", "ep", "batch"}


def test_serving_sweep_through_the_cli(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stage_dse.cli",
            "+sweep=llama3_70b_serving",
            f"results_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "top 10 serving configurations" in proc.stdout
    df = pd.read_parquet(tmp_path / "llama3_70b_serving")
    assert set(df["hardware"]) == {"h100_sxm", "h200"} and len(df) > 100


@pytest.mark.parametrize(
    ("preset", "plan"),
    [
        ("llama3_8b", ParallelPlan(tp=2, pp=2)),
        ("llama3_8b", ParallelPlan(pp=4)),
        ("mixtral_8x7b", ParallelPlan(tp=4, expert_tensor_parallel=True)),
        ("deepseek_v3", ParallelPlan(tp=8, pp=2, expert_tensor_parallel=True)),
        ("mixtral_8x7b", ParallelPlan(dp=4, ep=4, pp=2)),
    ],
)
def test_decode_trace_passes_the_checker(tmp_path, preset, plan):
    ts = write_serving_trace(
        load_model(preset),
        ServingSpec(prompt_len=1024, batch_size=4),
        plan,
        H100,
        load_cluster("dgx_h100", num_gpus=plan.num_gpus),
        tmp_path,
        steps=3,
    )
    assert ts.files == plan.num_gpus
    assert check_trace_dir(tmp_path) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]
    assert manifest["decode_steps"] == 3


def test_serving_sweep_without_a_valid_configuration_is_an_error(tmp_path):
    """Like a training sweep, a serving sweep whose every configuration breaks a rule stops
    with the rule, the model's numbers kept (tp(3) does not divide heads(32))."""
    spec = ServingSweepSpec(
        name="serve",
        model=load_model("llama3_8b"),
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        tp=(3,),
        batch_sizes=(1, 8),
    )
    with pytest.raises(ConfigError, match=r"most often: tp does not divide heads\(32\) \(2 of"):
        run_serving(spec, ResultStore(tmp_path / "serve"), log=lambda s: None)


def test_tensor_parallelism_beyond_the_kv_heads_replicates_them_one_per_rank():
    model = load_model("llama3_70b")  # 8 KV heads
    serving = ServingSpec(prompt_len=1024, output_tokens=128, batch_size=4)
    cluster = load_cluster("dgx_h100", num_gpus=16)
    hw = load_hardware("h100_sxm")
    row, key = serving_row(model, serving, hw, cluster, 16)
    out = evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]
    # each of the 16 ranks caches one KV head per layer: K and V of 128 bf16 values
    per_token = 2 * model.num_layers * 1 * model.head_dim * 2
    assert out["serve_kv_cache_bytes"] == pytest.approx(4 * (1024 + 128) * per_token, rel=0.01)
    assert replicated_kv_heads(model, 8) is model
    assert replicated_kv_heads(model, 16).num_kv_heads == 16
    glm = load_model("glm_4_5_air")  # 96 query heads, 8 KV heads
    with pytest.raises(ConfigError, match=r"tp\(12\) is neither a divisor nor a multiple"):
        validate_serving(glm, serving, serving_plan(glm, 12, 1, 4))


def test_a_serving_sweep_spreads_output_lengths_of_a_burst_and_keeps_both_rows(tmp_path):
    base = dict(
        model=load_model("llama3_8b"),
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        tp=(1,),
        batch_sizes=(256,),
        prompt_lens=(214,),
        output_tokens=200,
        mode="continuous",
        prefill_budgets=(2048,),
        burst=1000,
    )
    store = ResultStore(tmp_path / "burst")
    for spread in ("fixed", "exponential"):
        spec = ServingSweepSpec(name="burst", output_lengths=spread, max_total_tokens=2048, **base)
        run_serving(spec, store, log=lambda s: None)
    df = load(tmp_path / "burst").set_index("output_lengths")
    assert len(df) == 2 and df["config_hash"].is_unique
    # the same mean tokens, but the longest replies drain the burst on a shrinking batch
    fixed, spread = df.loc["fixed"], df.loc["exponential"]
    assert spread["total_tokens_per_s_per_gpu"] < 0.9 * fixed["total_tokens_per_s_per_gpu"]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("serving.output_lengths=zipf", "serving.output_lengths"),
        ("serving.max_total_tokens=-5", "serving.max_total_tokens"),
    ],
)
def test_bad_output_length_options_name_the_field(override, field, tmp_path):
    from bad_inputs import run_case

    args = ["workload=serving", "serving.mode=continuous", override]
    assert run_case("stage-dse", args, field, str(tmp_path)) is None


def test_a_decode_pool_holds_the_decode_working_set_not_its_batchs_prefill():
    model = load_model("llama3_70b")
    serving = ServingSpec(prompt_len=4096, output_tokens=256, batch_size=64)
    row, key = serving_row(model, serving, H100, load_cluster("dgx_h100"), 8)
    out = evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]
    # prefilling 64 x 4096 tokens at once needs far more than one decode token per sequence
    assert out["serve_decode_working_bytes"] < out["serve_working_bytes"] / 100
    assert out["serve_decode_kv_capacity_seqs"] >= out["serve_kv_capacity_seqs"]
    usable = row["usable_memory"]
    expect = (
        usable
        - out["serve_weights_bytes"]
        - out["serve_kv_cache_bytes"]
        - out["serve_decode_working_bytes"]
    )
    assert out["serve_decode_headroom_bytes"] == pytest.approx(expect, rel=1e-9)
    assert out["serve_decode_headroom_bytes"] >= out["serve_mem_headroom_bytes"]
