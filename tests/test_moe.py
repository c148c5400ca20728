"""Mixture-of-experts: parameter counts, flops per token, all-to-all bytes, ZeRO over experts,
validation, sweeps and expert-parallel traces."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, evaluate_plan
from stage_dse.cost.network import node_dedup_share
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.graph import CollKind, build_graphs
from stage_dse.graph.symbols import Symbols
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import MeshAxis, ModelSpec, ParallelPlan, TrainingSpec, validate_plan
from stage_dse.trace import check_trace_dir, write_trace_set
from stage_dse.trace import et_def_pb2 as pb
from stage_dse.trace.encode import read_trace

H100 = load_hardware("h100_sxm")


def all_to_all_group(trace_dir, rank: int) -> list[int]:
    """The ranks of the communicator group of ``rank``'s first all-to-all in a trace set."""
    groups = json.loads((trace_dir / "comm_groups.json").read_text())
    _, nodes = read_trace(trace_dir / f"trace.{rank}.et")
    a2a = [
        n
        for n in nodes
        if n.type == pb.COMM_COLL_NODE
        and any(a.name == "comm_type" and a.int64_val == pb.ALL_TO_ALL for a in n.attr)
    ]
    assert a2a, f"rank {rank} runs no all-to-all"
    return groups[next(a.string_val for a in a2a[0].attr if a.name == "pg_name")]


def small_moe(**kw) -> ModelSpec:
    base = dict(
        name="moe_test",
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=512,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=1024,
        norm="rmsnorm",
        mlp="swiglu",
        position="rope",
        tied_embeddings=False,
        bias=False,
        dropout=False,
        num_experts=8,
        top_k=2,
        moe_ffn_hidden_size=128,
    )
    return ModelSpec(**{**base, **kw})


@pytest.mark.parametrize(
    ("preset", "total", "active", "rel"),
    [
        ("mixtral_8x7b", 46.7e9, 12.9e9, 0.005),  # Jiang et al. 2024
        ("deepseek_v3", 671e9, 37e9, 0.02),  # DeepSeek-V3 report, Table 1 / sec. 4.2
        ("olmoe_1b_7b", 6.9e9, 1.3e9, 0.02),  # Muennighoff et al. 2024
    ],
)
def test_public_parameter_counts(preset, total, active, rel):
    got = evaluate_plan(
        load_model(preset), TrainingSpec(seq_len=4096, global_batch_size=64), ParallelPlan()
    )
    assert got["params"] == pytest.approx(total, rel=rel)
    assert got["params_active"] == pytest.approx(active, rel=rel)


def test_flops_per_token_scale_with_active_not_total_parameters():
    """Doubling the experts (same top-k) doubles routed parameters but not the work."""
    t = TrainingSpec(seq_len=512, global_batch_size=16)
    a = evaluate_plan(small_moe(num_experts=8), t, ParallelPlan())
    b = evaluate_plan(small_moe(num_experts=16), t, ParallelPlan())
    c = evaluate_plan(small_moe(num_experts=8, top_k=4), t, ParallelPlan())
    assert b["params"] > 1.5 * a["params"]
    router = 2 * 16 * 512 * 256 * 8 * 3 * 4  # router GEMM grows with experts: 2*tok*h*E*3*L
    assert b["model_flops"] - a["model_flops"] == pytest.approx(router, rel=1e-9)
    # top-k 2 -> 4 doubles the expert GEMMs: 6 * tokens * (3 h fe) * extra k per layer
    experts = 6 * 16 * 512 * (3 * 256 * 128) * 2 * 4
    assert c["model_flops"] - a["model_flops"] == pytest.approx(experts, rel=1e-9)
    # 6 x active parameters per token (non-attention matmuls) is the published rule of thumb
    tokens = 16 * 512
    attn = 6 * tokens * 512 * 256 * 4 * 2  # q k^T and p v: 2 * 2 * s * h per token, x3, x layers
    assert a["model_flops"] - attn == pytest.approx(
        6 * tokens * (a["params_active"] - 1024 * 256), rel=0.01
    )


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True)])
def test_all_to_all_bytes_per_layer_equal_the_hand_formula(ep, tp, sp):
    """tokens x hidden x top-k x dtype bytes per direction, per GPU; the wire moves the
    (ep-1)/ep part of it (both directions: dispatch and combine, forward and backward)."""
    model = small_moe()
    t = TrainingSpec(seq_len=512, global_batch_size=16)
    plan = ParallelPlan(dp=8, ep=ep, tp=tp, sequence_parallel=sp, micro_batch_size=1)
    got = evaluate_plan(model, t, plan)
    tokens_per_gpu = 1 * 512 / tp  # a micro-batch's tokens, split over tp under SP
    per_direction = tokens_per_gpu * 256 * 2 * 2  # x hidden x top-k x bf16
    m = 16 // 8
    # four all-to-alls per MoE layer and micro-batch (dispatch, combine; forward, backward)
    assert got["comm_all_to_all_ep"] == pytest.approx(4 * 4 * m * per_direction, rel=1e-12)
    wire = per_direction * (ep - 1) / ep
    assert wire == pytest.approx(tokens_per_gpu * 256 * 2 * 2 * (ep - 1) / ep)


def test_expert_states_shard_over_dp_over_ep():
    model = small_moe()
    t = TrainingSpec(seq_len=512, global_batch_size=16)
    z0 = evaluate_plan(model, t, ParallelPlan(dp=8, ep=4, zero_stage=0))
    z1 = evaluate_plan(model, t, ParallelPlan(dp=8, ep=4, zero_stage=1))
    experts = 4 * 8 * 3 * 256 * 128  # layers x experts x 3 matrices x h x fe
    dense = z0["params"] - experts
    # optimizer (12 bytes/param): dense states over all 8 data ranks, expert states (already
    # split 4 ways by EP) over the remaining 8/4 = 2 replicas
    assert z0["mem_optimizer_bytes"] == pytest.approx(12 * (dense + experts / 4))
    assert z1["mem_optimizer_bytes"] == pytest.approx(12 * (dense / 8 + experts / 4 / 2))


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (ParallelPlan(dp=8, ep=3), "ep(3) does not divide experts(8)"),
        (ParallelPlan(dp=2, ep=4), "ep(4) does not divide dp(2)"),
        (ParallelPlan(dp=4, tp=2, ep=2), "needs sequence_parallel=true"),
        (
            ParallelPlan(dp=2, tp=2, ep=4, sequence_parallel=True),
            "ep(4) does not divide dp(2); set ep_over_tp=true to span the tensor-parallel ranks",
        ),
        (
            ParallelPlan(dp=4, tp=2, ep=1, ep_over_tp=True, sequence_parallel=True),
            "ep(1) is not a multiple of tp(2)",
        ),
        (
            ParallelPlan(dp=2, tp=2, ep=8, ep_over_tp=True, sequence_parallel=True),
            "ep(8)/tp(2)=4 does not divide dp(2)",
        ),
    ],
)
def test_moe_validation(plan, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_plan(small_moe(), TrainingSpec(seq_len=512, global_batch_size=16), plan)


def test_moe_model_validation():
    with pytest.raises(ConfigError, match=r"top_k\(9\) must be in 1..num_experts\(8\)"):
        small_moe(top_k=9)
    with pytest.raises(ConfigError, match="needs mlp=swiglu"):
        small_moe(mlp="gelu")


def test_moe_sweep_and_expert_parallel_trace(tmp_path):
    spec = SweepSpec(
        name="moe",
        models=(small_moe(num_shared_experts=1, first_dense_layers=1),),
        training=TrainingSpec(seq_len=256, global_batch_size=16),
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=(8,),
        space=SearchSpace(
            ep="auto",
            micro_batch_size=(1,),
            expert_tensor_parallel=(False, True),
            ep_over_tp=(False, True),
        ),
    )
    store = ResultStore(tmp_path / "moe")
    report = run_grid(spec, LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert report.valid == len(df) > 0 and set(df["ep"]) >= {1, 2, 4, 8}
    assert (df.loc[df.ep > 1, "comm_all_to_all_bytes"] > 0).all()
    assert (df.loc[df.ep > 1, "ep_comm_s"] > 0).all()
    # ep over the tensor-parallel ranks: ep 8 on 4 data-parallel ranks of tp 2
    assert df.loc[df.ep > df.dp, "ep_over_tp"].all()
    assert ((df.ep == 8) & (df.dp == 4) & df.ep_over_tp).any()
    from stage_dse.cli.trace import config_from_row

    etp = df[(df.ep == 4) & (df.tp == 2) & (df.expert_tensor_parallel) & (df.pp == 1)].iloc[0]
    over = df[(df.ep == 8) & (df.tp == 2) & (df.ep_over_tp) & (df.pp == 1)].iloc[0]
    for name, row in (("etp", etp), ("over", over)):
        cfg = config_from_row(row)
        assert cfg.plan.ep_over_tp == (name == "over")
        out = tmp_path / f"trace_{name}"
        write_trace_set(cfg, out)
        assert check_trace_dir(out) == []
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]
        assert len(all_to_all_group(out, 0)) == int(row["ep"])  # the expert-parallel group


def test_latent_attention_rotary_key_gradient_is_reduced_over_tensor_parallel_ranks():
    """MLA's rotary key is one vector per token copied into every head; with heads split over
    tensor-parallel ranks, each rank holds part of its gradient: one all-reduce of
    b x s x rope_dim values per layer, in backward."""
    model = load_model("deepseek_v3")
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    plan = ParallelPlan(dp=8, tp=2, ep=8, sequence_parallel=True, micro_batch_size=2)
    block = build_graphs(model, plan, training).block
    rope = [
        op
        for op in block.ops
        if op.coll is CollKind.ALL_REDUCE
        and op.group == {MeshAxis.TP}
        and op.name.endswith("k_rope")
    ]
    assert len(rope) == 1 and rope[0].phase.value == "backward"
    subs = {Symbols.all()[k]: v for k, v in bind(model, training, plan).items()}
    assert float(rope[0].comm_bytes.xreplace(subs)) == 2 * 4096 * model.rope_head_dim * 2


def test_ep_comm_overlap_hides_all_to_alls_behind_compute():
    """With ep_comm_overlap (DualPipe-style pairing of micro-batches) only the all-to-all time
    beyond the compute it runs under stays exposed, plus the compute's slowdown beside it
    (overlap_slowdown of the overlapped time); nothing else changes."""
    model = load_model("mixtral_8x7b")
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    cl = load_cluster("dgx_h100", num_gpus=64)
    plans = {ov: ParallelPlan(dp=64, ep=8, zero_stage=1, ep_comm_overlap=bool(ov)) for ov in (0, 1)}
    got = {ov: evaluate_plan(model, t, p, hardware=H100, cluster=cl) for ov, p in plans.items()}
    off, on = got[0], got[1]
    assert off["ep_comm_s"] > 0
    k = H100.overlap_slowdown
    expected = max(0.0, off["ep_comm_s"] - off["compute_s"])
    expected += k * min(off["ep_comm_s"], off["compute_s"])
    assert on["ep_comm_s"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # two separately compiled families: equal up to rounding
    assert on["compute_s"] == pytest.approx(off["compute_s"], rel=1e-12)
    assert on["step_s"] == pytest.approx(
        off["step_s"] - (off["ep_comm_s"] - on["ep_comm_s"]), rel=1e-9
    )


def test_deepseek_v3_published_layout_fits():
    """DeepSeek-V3 was trained with PP 16, EP 64 on 2048 H800s (report sec. 3.2). It cached
    more activations in FP8 than the linear-layer inputs modelled here and recomputed norms and
    up-projections; here the layout fits with full recomputation (selective leaves ~105 GiB of
    in-flight activations in bf16, ~93 GiB with FP8 GEMMs)."""
    model = load_model("deepseek_v3")
    t = TrainingSpec(seq_len=4096, global_batch_size=15360 // 4)
    plan = ParallelPlan(dp=128, pp=16, ep=64, zero_stage=1, recompute="full", micro_batch_size=1)
    got = evaluate_plan(
        model, t, plan, hardware=H100, cluster=load_cluster("dgx_h100", num_gpus=2048)
    )
    assert got["mem_total_bytes"] < H100.usable_bytes
    assert got["ep_comm_s"] > 0 and 0 < got["mfu"] < 0.6


@pytest.mark.parametrize(
    ("name", "gpus"), [("mixtral_8x7b_h100", "[64]"), ("deepseek_v3_2048", "[2048]")]
)
def test_named_moe_sweeps_land_in_parquet(tmp_path, name, gpus):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stage_dse.cli import run
    from stage_dse.config import conf_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"+sweep={name}",
                f"results_dir={tmp_path}",
                "runner=local",
                "runner.progress=false",
                f"num_gpus={gpus}",
            ],
        )
    assert run(cfg) > 0
    df = load(tmp_path / name)
    assert (df["status"] == "ok").any() and (df["ep"] > 1).any()
    assert (df.loc[df.status == "ok", "ep_comm_s"] >= 0).all()


def test_a_decode_step_reads_and_runs_only_the_experts_its_tokens_touch():
    """Grouped expert GEMMs run tiles, and read weights, only for experts with tokens: at
    batch 1 a 128-expert top-8 layer touches 8 experts, at a large batch all of them."""
    from stage_dse.runner.serving import serving_row
    from stage_dse.spec.serving import ServingSpec

    model = load_model("qwen3_30b_a3b")
    hw = load_hardware("h100_sxm")
    stream = hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency

    def step(batch):
        serving = ServingSpec(prompt_len=1000, output_tokens=2, batch_size=batch)
        row, key = serving_row(model, serving, hw, load_cluster("dgx_h100"), 1)
        return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]

    one, many = step(1), step(512)
    every_weight_s = one["serve_weights_bytes"] / stream
    # batch 1: about 8 of 128 experts' weights plus attention and embeddings
    assert one["serve_tpot_s"] < 0.3 * every_weight_s
    # batch 512: every expert has tokens, every weight is read
    assert many["serve_tpot_s"] > 0.9 * every_weight_s


@pytest.mark.parametrize("ep", [1, 8])
def test_uneven_routing_times_the_busiest_expert_parallel_rank(ep):
    """Under a power law of expert loads the roofline runs the routed experts' GEMMs at the
    busiest rank's rows, ``1 + a ln(ep)`` times the mean (ROUTING_SKEW): its flops grow by that
    much and its tiles fill, so a few rows per expert (a short prompt) cost little more and a
    long prefill nearly the whole factor; on one GPU (ep = 1) every expert runs in one grouped
    GEMM and the spread costs nothing. Qwen3-235B-A22B prefills, FP8 experts."""
    import math

    from stage_dse.runner.serving import serving_row
    from stage_dse.spec.serving import ROUTING_SKEW, ServingSpec

    model = load_model("qwen3_235b_a22b")
    hw = load_hardware("b200")

    def prefill(routing, prompt, batch):
        serving = ServingSpec(
            prompt_len=prompt, output_tokens=2, batch_size=batch, weights_dtype="fp8",
            moe_routing=routing,
        )  # fmt: skip
        row, key = serving_row(model, serving, hw, load_cluster("hgx_b200"), 1, 1, ep)
        return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]

    load = 1 + ROUTING_SKEW["power_law_1.2"] * math.log(ep)
    ratios = []
    for prompt, batch in ((16, 1), (4096, 4)):
        even, skewed = prefill("balanced", prompt, batch), prefill("power_law_1.2", prompt, batch)
        # only the routed experts change; the rest of the pass is the same
        rest = even["serve_ttft_s"] - even["serve_prefill_expert_s"]
        assert skewed["serve_ttft_s"] - skewed["serve_prefill_expert_s"] == pytest.approx(rest)
        ratios.append(skewed["serve_prefill_expert_s"] / even["serve_prefill_expert_s"])
    if ep == 1:
        assert ratios == pytest.approx([1.0, 1.0], rel=1e-12)
        return
    short, long = ratios
    assert 1 <= short < 1.1 < long <= load + 1e-9
    assert long > 1 + 0.5 * (load - 1)


@pytest.mark.parametrize("ep", [2, 8])
def test_all_to_all_dispatch_never_moves_more_than_an_all_gather(ep):
    """An all-gather sends each token to every other rank; a rank-deduplicated all-to-all to
    the ranks holding its top-8 experts only: at ep 2 nearly every token has an expert on the
    other rank (1 - 2^-8 of them), at ep 8 about 66% of the ranks are hit."""
    from stage_dse.runner.serving import serving_row
    from stage_dse.spec.serving import ServingSpec

    model = load_model("qwen3_235b_a22b")
    hw = load_hardware("h200")

    def step(dispatch):
        serving = ServingSpec(
            prompt_len=1024, output_tokens=2, batch_size=64, weights_dtype="fp8",
            moe_dispatch=dispatch,
        )  # fmt: skip
        row, key = serving_row(model, serving, hw, load_cluster("dgx_h100"), 1, 1, ep)
        return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]

    gather, a2a = step("allgather"), step("alltoall")
    for out in ("serve_tpot_s", "serve_ttft_s"):
        assert a2a[out] <= gather[out]
        if ep == 2:
            assert a2a[out] == pytest.approx(gather[out], rel=1e-2)
    if ep == 8:
        assert a2a["serve_tpot_s"] < gather["serve_tpot_s"]
    with pytest.raises(ConfigError, match="moe_dispatch"):
        ServingSpec(prompt_len=8, moe_dispatch="broadcast")


def test_quantized_dispatch_sends_the_experts_input_format_and_a_16_bit_combine():
    """TensorRT-LLM quantizes hidden states to the experts' format before its attention-data-
    parallel all-gather (fused_moe_cutlass.py, run_post_quant_allgather): the dispatch moves
    expert_gemm_bytes per element (NVFP4: 0.5625 with block scales), the combine 2."""
    from stage_dse.cost.serving import _exchange, serving_key
    from stage_dse.graph.transformer import build_serving_graphs
    from stage_dse.spec.serving import ServingSpec

    model = load_model("qwen3_30b_a3b")
    serving = ServingSpec(prompt_len=512, output_tokens=2, batch_size=8, weights_dtype="nvfp4")
    plan = ParallelPlan(dp=8, ep=8)
    key = serving_key(model, serving, plan)
    graphs = build_serving_graphs(key.graph, "prefill", key.kv_bytes)
    exchanges = [op for op in graphs.block.ops if op.coll is CollKind.ALL_TO_ALL]
    assert len(exchanges) == 2
    S = Symbols
    values = {S.quantized_dispatch: 1, S.expert_gemm_bytes: sp.Rational(9, 16)}
    kinds = set()
    for dispatch in ("allgather", "alltoall"):
        for op in exchanges:
            kind, size = _exchange(op, dispatch)
            plain = size.subs(S.quantized_dispatch, 0)
            ratio = sp.simplify(size.subs(values) / plain.subs(values))
            sends = any(t.name == "moe_dispatch" for t in op.inputs)
            assert ratio == (sp.Rational(9, 32) if sends else 1), (dispatch, op.name)
            kinds.add(kind)
    assert kinds == {CollKind.ALL_GATHER, CollKind.REDUCE_SCATTER, CollKind.ALL_TO_ALL}


def test_trtllm_s_quantized_dispatch_shortens_steps_where_tokens_cross_pcie():
    """Qwen3-30B-A3B in NVFP4 with attention data-parallel over 8 PCIe GPUs: the all-gather of
    every token dominates prefill; sent in NVFP4 it costs 0.28 of the 16-bit one. Nothing
    changes without expert parallelism or for a dense model."""
    from stage_dse.config import load_engine
    from stage_dse.runner.serving import serving_row
    from stage_dse.spec.serving import ServingSpec

    trt, vllm = load_engine("trtllm"), load_engine("vllm")
    assert trt.quantized_dispatch and not vllm.quantized_dispatch
    assert trt.cost_columns()["quantized_dispatch"] == 1.0
    hw, cluster = load_hardware("rtx_pro_6000"), load_cluster("rtx_pro_6000_server")
    serving = ServingSpec(prompt_len=1024, output_tokens=2, batch_size=64, weights_dtype="nvfp4")

    def both(model_name, ep):
        row, key = serving_row(load_model(model_name), serving, hw, cluster, 1, 1, ep)
        assert row["quantized_dispatch"] == 0.0  # an engine sets it
        table = pd.DataFrame([row, {**row, **trt.cost_columns()}])
        return evaluate_serving_table(table, [key, key])

    out = both("qwen3_30b_a3b", 8)
    plain, quant = out.iloc[0], out.iloc[1]
    for name in ("serve_ttft_s", "serve_tpot_s"):
        assert quant[name] < plain[name]
    # the experts' own time does not change, only the exchange
    assert quant["serve_prefill_expert_s"] == plain["serve_prefill_expert_s"]
    assert quant["serve_ttft_s"] < 0.8 * plain["serve_ttft_s"]
    for model_name, ep in (("qwen3_30b_a3b", 1), ("llama3_8b", 1)):
        out = both(model_name, ep)
        assert out.iloc[0]["serve_ttft_s"] == out.iloc[1]["serve_ttft_s"]
        assert out.iloc[0]["serve_tpot_s"] == out.iloc[1]["serve_tpot_s"]
    with pytest.raises(ConfigError, match="quantized_dispatch"):
        load_engine("trtllm", quantized_dispatch="yes")


def test_expert_parallelism_over_tensor_parallel_ranks_splits_experts_over_both():
    """ep_over_tp: the expert group is tp ranks of ep/tp data-parallel replicas, so ep may
    exceed dp; each GPU holds experts / ep experts (not experts / (ep/tp) replicated over TP),
    their states replicate over the dp/(ep/tp) remaining data ranks, and the all-to-alls run
    over EP x TP with the same bytes per GPU."""
    model = small_moe()
    t = TrainingSpec(seq_len=512, global_batch_size=16)
    over = ParallelPlan(dp=2, tp=2, ep=4, ep_over_tp=True, sequence_parallel=True)
    within = ParallelPlan(dp=2, tp=2, ep=2, sequence_parallel=True)  # same ep/tp data ranks
    a, b = evaluate_plan(model, t, over), evaluate_plan(model, t, within)
    experts = 4 * 8 * 3 * 256 * 128  # layers x experts x 3 matrices x h x fe
    # expert weights per GPU: experts/4 over EP x TP against experts/2 replicated over TP
    assert b["mem_weights_bytes"] - a["mem_weights_bytes"] == pytest.approx(
        2 * experts * (1 / 2 - 1 / 4)
    )
    assert a["comm_all_to_all_tp-ep"] == pytest.approx(b["comm_all_to_all_ep"], rel=1e-12)
    # expert gradients: replicated over TP they are all-reduced over it too; split, they are not
    assert b["comm_all_reduce_tp-cp-dp"] > 0 and "comm_all_reduce_tp-cp-dp" not in a
    assert a["model_flops"] == pytest.approx(b["model_flops"], rel=1e-12)
    one_group = ParallelPlan(dp=2, tp=2, ep=2, ep_over_tp=True, sequence_parallel=True)
    validate_plan(model, t, one_group)  # the experts over one tensor-parallel group
    graphs = build_graphs(model, over, t)
    groups = {op.group for op in graphs.block.ops if op.coll is CollKind.ALL_TO_ALL}
    assert groups == {frozenset({MeshAxis.EP, MeshAxis.TP})}
    with pytest.raises(ConfigError, match=r"ep_over_tp=true needs tp > 1"):
        ParallelPlan(dp=4, ep=4, ep_over_tp=True)
    with pytest.raises(ConfigError, match=r"set expert_tensor_parallel=false"):
        ParallelPlan(dp=2, tp=2, ep=4, ep_over_tp=True, expert_tensor_parallel=True)
    with pytest.raises(ConfigError, match=r"ep_over_tp needs a mixture-of-experts model"):
        validate_plan(
            load_model("llama3_8b"),
            TrainingSpec(seq_len=4096, global_batch_size=16),
            ParallelPlan(dp=2, tp=2, ep_over_tp=True, sequence_parallel=True),
        )


def test_expert_groups_hold_whole_context_parallel_groups(tmp_path):
    """With cp > 1 an expert group of ep > 1 spans the context-parallel ranks (Megatron-Core's
    and torchtitan's layout): ep / cp data-parallel ranks, experts / ep per GPU, expert
    gradients reduced over the data-parallel ranks outside the group only, the all-to-all over
    EP x CP on consecutive ranks."""
    from stage_dse.trace.mesh import Mesh

    model = small_moe()
    t = TrainingSpec(seq_len=512, global_batch_size=16)
    over = ParallelPlan(dp=4, cp=2, ep=4)
    assert over.ep_over_cp and over.ep_data == 2
    validate_plan(model, t, over)
    flat = ParallelPlan(dp=8, ep=4)  # the same ranks and tokens per GPU without cp
    replicated = ParallelPlan(dp=4, cp=2, ep=1)
    assert not replicated.ep_over_cp and replicated.ep_data == 1
    a, b, r = (evaluate_plan(model, t, p) for p in (over, flat, replicated))
    experts = 4 * 8 * 3 * 256 * 128 * 2  # layers x experts x 3 matrices x h x fe, 2 bytes
    assert a["mem_weights_bytes"] == pytest.approx(b["mem_weights_bytes"], rel=1e-12)
    assert r["mem_weights_bytes"] - a["mem_weights_bytes"] == pytest.approx(experts * 3 / 4)
    assert a["comm_all_to_all_cp-ep"] == pytest.approx(b["comm_all_to_all_ep"], rel=1e-12)
    # expert gradients: over DP alone (dp / ep_data = 2 replicas), not DP x CP
    assert a["comm_all_reduce_dp"] == pytest.approx(experts / 4)
    assert r["comm_all_reduce_cp-dp"] == pytest.approx(experts)
    graphs = build_graphs(model, over, t)
    groups = {op.group for op in graphs.block.ops if op.coll is CollKind.ALL_TO_ALL}
    assert groups == {frozenset({MeshAxis.EP, MeshAxis.CP})}
    mesh = Mesh(over)
    assert mesh.members(frozenset({MeshAxis.EP, MeshAxis.CP}), 0) == [0, 1, 2, 3]
    from stage_dse.trace.build import TraceConfig

    out = tmp_path / "trace"
    cluster = load_cluster("dgx_h100").replace(num_gpus=8)
    write_trace_set(TraceConfig(model, t, over, H100, cluster), out)
    assert check_trace_dir(out) == []
    assert sorted(all_to_all_group(out, 5)) == [4, 5, 6, 7]  # cp x ep, consecutive ranks
    with pytest.raises(ConfigError, match=r"ep\(2\) is not a multiple of cp\(4\)"):
        validate_plan(model, t, ParallelPlan(dp=2, cp=4, ep=2))
    with pytest.raises(ConfigError, match=r"ep\(8\)/cp\(2\)=4 does not divide dp\(2\)"):
        validate_plan(model, t, ParallelPlan(dp=2, cp=2, ep=8))
    folded = ParallelPlan(dp=2, tp=2, cp=2, ep=8, ep_over_tp=True, sequence_parallel=True)
    assert folded.ep_data == 2
    validate_plan(model, t, folded)
    with pytest.raises(ConfigError, match=r"ep\(2\) is not a multiple of cp\(2\)\*tp\(2\)"):
        validate_plan(
            model, t, ParallelPlan(dp=4, tp=2, cp=2, ep=2, ep_over_tp=True, sequence_parallel=True)
        )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64))
def test_node_deduplicated_dispatch_sends_at_most_what_an_all_to_all_does(copies, nodes):
    """Each row goes once to every node that holds one of its copies' destinations: never
    more than the copies themselves, never less than one row per node hit."""
    share = float(node_dedup_share(sp.Integer(copies), sp.Integer(nodes)))
    assert 0 < share <= 1 + 1e-12
    if copies == 1:
        assert share == pytest.approx(1.0)
    # rows per node: the chance it is hit, against copies / nodes without deduplication
    hit = 1 - (1 - 1 / nodes) ** copies
    assert share * copies / nodes == pytest.approx(hit)
    assert share >= 1 / copies - 1e-12


def test_deduplicated_dispatch_shortens_only_all_to_alls_that_cross_nodes():
    model = small_moe(num_experts=32, top_k=4)
    t = TrainingSpec(seq_len=512, global_batch_size=32)
    cl = load_cluster("dgx_h100", num_gpus=32)

    def ep_s(ep, dedup):
        plan = ParallelPlan(dp=32, ep=ep, ep_dispatch_dedup=dedup)
        return evaluate_plan(model, t, plan, hardware=H100, cluster=cl)

    inside, across = (ep_s(8, False), ep_s(8, True)), (ep_s(32, False), ep_s(32, True))
    assert inside[0]["ep_comm_s"] == pytest.approx(inside[1]["ep_comm_s"], rel=1e-12)
    assert across[1]["ep_comm_s"] < across[0]["ep_comm_s"]
    # the bytes on the wire are the same buffers; only their network share shrinks
    assert across[0]["comm_ep_bytes"] == across[1]["comm_ep_bytes"]


@given(
    ep=st.sampled_from([1, 2, 4, 8]),
    top_k=st.sampled_from([1, 2, 4]),
    micro_batch=st.sampled_from([1, 2]),
)
@settings(max_examples=12, deadline=None)
def test_probabilities_in_the_activation_keep_no_expert_outputs(ep, top_k, micro_batch):
    """Megatron-Core's memory-efficient permutation scales the experts' activation by the
    routing probabilities and combines unweighted: each MoE layer stops keeping the experts'
    outputs, its tokens x top_k rows of hidden values (balanced routing), and nothing else
    changes: flops, communication and every other memory term are the same."""
    model = small_moe(top_k=top_k)
    seq = 512
    t = TrainingSpec(seq_len=seq, global_batch_size=64)
    base = dict(dp=8, ep=ep, micro_batch_size=micro_batch)
    kept = evaluate_plan(model, t, ParallelPlan(**base), 8, hardware=H100)
    weighted = evaluate_plan(
        model, t, ParallelPlan(**base, moe_weighted_activation=True), 8, hardware=H100
    )
    rows = micro_batch * seq * top_k  # each rank's experts receive its tokens' top_k copies
    saved = model.num_layers * rows * model.hidden_size * t.params_dtype.bytes
    assert kept["mem_activations_bytes"] - weighted["mem_activations_bytes"] == pytest.approx(
        saved, rel=1e-12
    )
    for name in ("model_flops", "hardware_flops", "comm_ep_bytes", "mem_weights_bytes"):
        assert weighted[name] == pytest.approx(kept[name], rel=1e-12), name


def test_only_moe_graphs_and_megatron_core_take_the_weighted_activation():
    """A dense model's plan with the flag is the same family as without it; the
    ``megatron_core`` profile sets it, the 2024 NeMo profile and torchtitan do not."""
    from stage_dse.config import load_framework
    from stage_dse.graph.dims import graph_key

    dense = load_model("llama3_8b")
    t = TrainingSpec(seq_len=2048, global_batch_size=64)
    on, off = ParallelPlan(moe_weighted_activation=True), ParallelPlan()
    assert graph_key(dense, on, t) == graph_key(dense, off, t)
    assert graph_key(small_moe(), on, t) != graph_key(small_moe(), off, t)
    flags = {n: load_framework(n).moe_weighted_activation for n in ("megatron_core", "nemo")}
    assert flags == {"megatron_core": True, "nemo": False}
    assert not load_framework("torchtitan_fsdp2").moe_weighted_activation
