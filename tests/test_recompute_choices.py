"""Megatron-Core's refinements of activation recompute: selective recompute of named modules
(``recompute="selective:<modules>"``) and full recompute of the first layers of each model
chunk (``recompute="full:<layers>"``, the block method). What each drops and reruns, checked
against the layer's shapes, the order between modes, the errors, and the label through result
rows and traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import RECOMPUTE_MODULES, ParallelPlan, TrainingSpec
from stage_dse.spec.plan import validate_plan
from stage_dse.trace.select import config_from_row

DSV3 = load_model("deepseek_v3")
LLAMA = load_model("llama3_8b")
SEQ, MICRO = 4096, 1
TRAINING = TrainingSpec(seq_len=SEQ, global_batch_size=8)
B200 = load_hardware("b200")
CLUSTER = load_cluster("hgx_b200", num_gpus=8)


def _eval(model, recompute: str, **plan) -> dict:
    plan = {"dp": 8, "ep": 8, **plan} if model.is_moe else {"dp": 8, **plan}
    p = ParallelPlan(zero_stage=1, micro_batch_size=MICRO, recompute=recompute, **plan)
    return evaluate_plan(model, TRAINING, p, hardware=B200, cluster=CLUSTER)


def test_each_module_reruns_its_own_gemms_and_drops_its_own_tensors():
    """Per layer and micro-batch of ``T`` tokens on one GPU (bf16, no tensor parallelism):

    * ``mla_up_proj`` reruns the query and key/value up-projections, ``2 T a (q_lora (nope +
      rope) + kv_lora (nope + v))`` flops in every layer over the whole batch;
    * ``mlp`` reruns the three GEMMs of each dense-MLP layer (DeepSeek-V3's first three);
    * ``moe_act`` reruns no GEMM and drops the routed experts' activation output, ``T k f``
      bf16 values per MoE layer (``k`` experts per token of width ``f``, balanced over EP);
    * ``layernorm`` drops the two norm outputs, ``2 T h`` bf16 values per layer."""
    m = DSV3
    tokens = TRAINING.global_batch_size * SEQ  # the whole step, all GPUs
    a = m.num_heads
    base = _eval(m, "none")
    up = _eval(m, "selective:mla_up_proj")
    per_layer = (
        2
        * tokens
        * a
        * (
            m.q_lora_rank * (m.head_dim + m.rope_head_dim)
            + m.kv_lora_rank * (m.head_dim + m.v_head_dim)
        )
    )
    assert up["matmul_flops"] - base["matmul_flops"] == pytest.approx(
        m.num_layers * per_layer, rel=1e-9
    )
    mlp = _eval(m, "selective:mlp")
    dense = m.num_dense_layers
    assert dense == 3
    assert mlp["matmul_flops"] - base["matmul_flops"] == pytest.approx(
        dense * 2 * tokens * 3 * m.hidden_size * m.ffn_hidden_size, rel=1e-9
    )
    act = _eval(m, "selective:moe_act")
    assert act["matmul_flops"] == base["matmul_flops"]
    t = MICRO * SEQ  # one GPU's micro-batch
    moe_layers = m.num_layers - dense
    assert base["mem_activations_bytes"] - act["mem_activations_bytes"] == pytest.approx(
        moe_layers * t * m.top_k * m.moe_ffn_hidden_size * 2, rel=1e-9
    )
    norm = _eval(m, "selective:layernorm")
    assert base["mem_activations_bytes"] - norm["mem_activations_bytes"] == pytest.approx(
        m.num_layers * 2 * t * m.hidden_size * 2, rel=1e-9
    )


def test_moe_recompute_reruns_the_dispatch_and_combine():
    """Checkpointing the whole MoE layer reruns its all-to-alls in backward; recomputing the
    activation alone does not."""
    base = _eval(DSV3, "none")
    moe = _eval(DSV3, "selective:moe")
    act = _eval(DSV3, "selective:moe_act")
    a2a = [k for k in base if k.startswith("comm_all_to_all")]
    assert a2a
    for k in a2a:
        assert moe[k] == pytest.approx(1.5 * base[k], rel=1e-9)  # forward, rerun, backward
        assert act[k] == base[k]


def test_default_selective_is_megatron_cores_core_attn():
    plain = ParallelPlan(recompute="selective")
    named = ParallelPlan(recompute="selective:core_attn")
    assert named == plain and named.recompute_label == "selective"
    a, b = _eval(LLAMA, "selective"), _eval(LLAMA, "selective:core_attn")
    assert a == b


@settings(max_examples=15, deadline=None)
@given(st.sets(st.sampled_from(RECOMPUTE_MODULES), min_size=1))
def test_any_module_set_sits_between_no_and_full_recompute(modules):
    label = "selective:" + "+".join(sorted(modules))
    none, full, r = _eval(DSV3, "none"), _eval(DSV3, "full"), _eval(DSV3, label)
    tol = 1 + 1e-9
    assert full["mem_activations_bytes"] <= r["mem_activations_bytes"] * tol
    assert r["mem_activations_bytes"] <= none["mem_activations_bytes"] * tol
    assert none["step_s"] <= r["step_s"] * tol
    assert r["step_s"] <= full["step_s"] * tol
    assert none["recompute_flops"] <= r["recompute_flops"] <= full["recompute_flops"]


@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (2, 2)])
def test_block_recompute_covers_its_layers_of_each_chunk(pp, v):
    """``full:n`` recomputes ``n`` layers of each of the ``pp x v`` chunks: activation memory
    and rerun flops move that share of the way from no recompute to full recompute, and a
    count at or above a chunk's layers is full recompute."""
    m = LLAMA  # 32 layers
    training = TrainingSpec(seq_len=SEQ, global_batch_size=32)

    def run(rc: str) -> dict:
        plan = ParallelPlan(
            dp=8 // pp, pp=pp, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b",
            zero_stage=1, recompute=rc,
        )  # fmt: skip
        return evaluate_plan(m, training, plan, hardware=B200, cluster=CLUSTER)

    none, full = run("none"), run("full")
    chunk = m.num_layers // (pp * v)
    # the kept activations of the layers left alone (the rerun layer's working set is there
    # whenever any layer reruns)
    one = run("full:1")
    left_bytes = (one["mem_activations_bytes"] - full["mem_activations_bytes"]) / (1 - 1 / chunk)
    assert 0 < left_bytes < none["mem_activations_bytes"]
    for n in (1, 3):
        share = n / chunk
        r = run(f"full:{n}")
        for key in ("recompute_flops", "matmul_flops", "hardware_flops"):
            assert r[key] == pytest.approx(none[key] + share * (full[key] - none[key]), rel=1e-9)
        if pp == 1:  # (with stages, the heaviest one's: the larger of two such lines)
            assert r["mem_activations_bytes"] == pytest.approx(
                full["mem_activations_bytes"] + (1 - share) * left_bytes, rel=1e-9
            )
        assert (
            full["mem_activations_bytes"]
            < r["mem_activations_bytes"]
            < none["mem_activations_bytes"]
        )
        assert none["step_s"] < r["step_s"] < full["step_s"]
    assert run(f"full:{chunk}") == full
    assert run(f"full:{chunk + 5}")["step_s"] == full["step_s"]


def test_labels_are_canonical():
    p = ParallelPlan(recompute="selective:moe_act+mla_up_proj")
    assert p.recompute_modules == ("mla_up_proj", "moe_act")
    assert p.recompute_label == "selective:mla_up_proj+moe_act"
    assert ParallelPlan(recompute="selective", recompute_modules="moe_act+layernorm") == (
        ParallelPlan(recompute="selective:layernorm+moe_act")
    )
    space = SearchSpace(recompute=("none", "selective:moe_act+mla_up_proj", "full:5"))
    assert space.recompute == ("none", "selective:mla_up_proj+moe_act", "full:5")
    assert ParallelPlan(recompute="full", recompute_layers=5).recompute_label == "full:5"
    assert ParallelPlan(recompute="full:0") == ParallelPlan(recompute="full")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"recompute": "full:mlp"}, "needs recompute=selective, got recompute=full"),
        ({"recompute": "selective:attn"}, "unknown module 'attn'"),
        ({"recompute": "none", "recompute_modules": ("mlp",)}, "needs recompute=selective"),
        ({"recompute": "selective:mlp", "recompute_modules": ("mlp",)}, "names its refinement"),
        (
            {"recompute": "selective", "recompute_layers": 2},
            r"recompute_layers\(2\) needs recompute=full",
        ),
        ({"recompute": "full:two"}, "takes a layer count per model chunk"),
        ({"recompute": "full:-1"}, "recompute_layers"),
    ],
)
def test_bad_recompute_labels_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelPlan(**kwargs)


@pytest.mark.parametrize(
    "model, module, what",
    [
        ("llama3_8b", "mla_up_proj", "latent-attention"),
        ("llama3_8b", "moe_act", "mixture-of-experts"),
        ("qwen3_30b_a3b", "shared_experts", "shared experts"),
        ("qwen3_30b_a3b", "mlp", "dense-MLP layers"),
    ],
)
def test_modules_a_model_lacks_are_refused(model, module, what):
    m = load_model(model)
    plan = ParallelPlan(dp=8, ep=8 if m.is_moe else 1, recompute=f"selective:{module}")
    with pytest.raises(ConfigError, match=f"{module} needs .*{what}"):
        validate_plan(m, TRAINING, plan)
    with pytest.raises(ConfigError, match="bad_space"):
        SearchSpace(recompute=("selective:bad_space",))


def test_sweep_rows_carry_the_label_and_rebuild_the_plan(tmp_path):
    labels = ("selective", "selective:mla_up_proj+moe_act")
    spec = SweepSpec(
        name="modules",
        models=(DSV3,),
        training=TrainingSpec(seq_len=SEQ, global_batch_size=64),
        hardware=(B200,),
        cluster=load_cluster("hgx_b200"),
        gpu_counts=(64,),
        space=SearchSpace(
            tp=(1,), pp=(1,), cp=(1,), ep=(8,), micro_batch_size=(1,), zero_stage=(1,),
            sequence_parallel=(False,), recompute=labels,
        ),
    )  # fmt: skip
    store = ResultStore(tmp_path / "modules")
    run_grid(spec, LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert set(df["recompute"]) == set(labels) and df["config_hash"].is_unique
    by = {r: df[df["recompute"] == r].iloc[0] for r in labels}
    assert by[labels[1]]["mem_activations_bytes"] < by[labels[0]]["mem_activations_bytes"]
    plan = config_from_row(by[labels[1]]).plan
    assert plan.recompute_modules == ("mla_up_proj", "moe_act")
    assert config_from_row(by[labels[0]]).plan.recompute_modules == ()


@pytest.mark.parametrize("recompute", ["full:1", "selective:moe", "selective:layernorm+mlp"])
def test_traces_rerun_what_the_costs_count_in_mixed_layer_models(tmp_path, recompute):
    """A mixture-of-experts model with a leading dense layer: block recompute reruns the dense
    layer in one chunk and an MoE layer in the other, so the trace's flops must come from the
    layers the schedule reruns, not from an average layer; the checker agrees."""
    import json

    from stage_dse.spec import ModelSpec
    from stage_dse.trace import TraceConfig, check_trace_dir, write_trace_set

    model = ModelSpec(
        name="moe_tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_heads=4,
        num_kv_heads=2, head_dim=64, vocab_size=1024, norm="rmsnorm", mlp="swiglu",
        position="rope", num_experts=8, top_k=2, moe_ffn_hidden_size=128,
        num_shared_experts=1, first_dense_layers=1,
    )  # fmt: skip
    plan = ParallelPlan(dp=4, ep=4, pp=2, zero_stage=1, recompute=recompute)
    cfg = TraceConfig(
        model=model,
        training=TrainingSpec(seq_len=128, global_batch_size=8),
        plan=plan,
        hardware=load_hardware("h100_sxm"),
        cluster=load_cluster("dgx_h100", num_gpus=8),
    )
    write_trace_set(cfg, tmp_path)
    assert check_trace_dir(tmp_path) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]
