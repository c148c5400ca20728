"""Model presets of models served today (Qwen3, Mistral, DeepSeek-R1, GLM-4.5/4.6, GPT-J, gpt-oss,
Llama 4) against their published parameter counts, and the interleave of dense and MoE layers
(``moe_layer_interval``, Llama 4 Maverick) through parameters, per-stage costs, serving
weights and traces."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sympy as sp
from conftest import llama

from stage_dse.cli.trace import config_from_row
from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, evaluate_plan
from stage_dse.cost.derive import section_costs
from stage_dse.errors import ConfigError
from stage_dse.graph import build_graphs
from stage_dse.graph.layers import dense_layers_among
from stage_dse.graph.symbols import Symbols
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.spec.serving import ServingSpec
from stage_dse.spec.stages import stage_values, virtual_stage_layers
from stage_dse.trace import check_trace_dir, write_trace_set
from stage_dse.trace.schedule import layer_runs

H100 = load_hardware("h100_sxm")
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=64)

# (preset, published total, published active or None for a dense model, whether the published
# active count includes the embedding and output matrices, relative tolerance, source). The
# tolerance covers the rounding of the published figure (two or three significant digits) and
# what the preset leaves out (listed in each preset's header).
PUBLISHED = [
    # Qwen3 Technical Report (arXiv:2505.09388) Tables 1-2 and the model cards: 8.2B, 14.8B (13.2B
    # without embeddings), 32.8B (31.2B), 30.5B / 3.3B active, 235B / 22B active
    ("qwen3_8b", 8.2e9, None, True, 0.005, "Qwen3 report, model card"),
    ("qwen3_14b", 14.8e9, None, True, 0.005, "Qwen3 report, model card"),
    ("qwen3_32b", 32.8e9, None, True, 0.005, "Qwen3 report, model card"),
    ("qwen3_30b_a3b", 30.5e9, 3.3e9, True, 0.02, "Qwen3 report, model card"),
    ("qwen3_235b_a22b", 235e9, 22e9, True, 0.01, "Qwen3 report, model card"),
    # Mistral-7B-v0.3's checkpoint: 7,248,023,552 parameters (7.25B on its model page)
    ("mistral_7b", 7.25e9, None, True, 0.001, "Mistral-7B-v0.3 checkpoint"),
    # DeepSeek-R1 report (arXiv:2501.12948) / DeepSeek-V3 report Table 1: 671B, 37B active
    ("deepseek_r1", 671e9, 37e9, True, 0.02, "DeepSeek-R1 / V3 reports"),
    # GLM-4.5 report (arXiv:2508.06471) Table 1: Air 106B / 12B active, GLM-4.5 (and 4.6)
    # 355B / 32B active; GLM's active counts leave the embedding and output matrices out
    ("glm_4_5_air", 106e9, 12e9, False, 0.02, "GLM-4.5 report"),
    ("glm_4_6", 355e9, 32e9, False, 0.01, "GLM-4.5 report, GLM-4.6 model card"),
    # GPT-J-6B model card: 6,053,381,344 parameters
    ("gpt_j_6b", 6_053_381_344, None, True, 0.001, "GPT-J-6B model card"),
    # Llama 4 model card: Scout 109B / 17B active, Maverick 400B / 17B active; the totals
    # include the vision encoder, which the presets leave out (about 1% of Scout)
    ("llama4_scout", 109e9, 17e9, True, 0.015, "Llama 4 model card"),
    ("llama4_maverick", 400e9, 17e9, True, 0.015, "Llama 4 model card"),
    # gpt-oss model card (arXiv:2508.10925) Table 1: 116.83B / 5.13B active, 20.91B / 3.61B
    # active; the active counts hold the unembedding and not the embedding
    ("gpt_oss_120b", 116.83e9, 5.13e9, "output", 0.001, "gpt-oss model card"),
    ("gpt_oss_20b", 20.91e9, 3.61e9, "output", 0.001, "gpt-oss model card"),
    # DeepSeek-V3.2-Exp report: DeepSeek-V3.1-Terminus (the V3 architecture, 671B / 37B active)
    # with the indexer added, which a training graph leaves out (0.85B)
    ("deepseek_v3_2", 671e9, 37e9, True, 0.02, "DeepSeek-V3.2-Exp / V3 reports"),
]


@pytest.mark.parametrize(
    ("preset", "total", "active", "with_embeddings", "rel"),
    [p[:5] for p in PUBLISHED],
    ids=[p[0] for p in PUBLISHED],
)
def test_published_parameter_counts(preset, total, active, with_embeddings, rel):
    model = load_model(preset)
    got = evaluate_plan(model, TRAINING, ParallelPlan())
    assert got["params"] == pytest.approx(total, rel=rel)
    if active is None:
        assert not model.is_moe
        return
    # matrices of hidden x vocab the published active count leaves out
    left_out = 1 if with_embeddings == "output" else 0 if with_embeddings else 2
    embeddings = left_out * model.hidden_size * model.vocab_size
    assert got["params_active"] - embeddings == pytest.approx(active, rel=rel)


def test_gpt_oss_layouts():
    """config.json: 128 / 32 experts of 2880, top-4; 64 query and 8 KV heads of 64; layer_types
    alternate sliding_attention (window 128) and full_attention, starting with sliding."""
    for name, layers, experts in (("gpt_oss_120b", 36, 128), ("gpt_oss_20b", 24, 32)):
        m = load_model(name)
        assert (m.num_layers, m.num_experts, m.top_k, m.moe_ffn_hidden_size) == (
            layers,
            experts,
            4,
            2880,
        )
        assert (m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size) == (64, 8, 64, 2880)
        assert m.bias and m.vocab_size == 201088 and m.sliding_window == 128
        assert [m.is_windowed_layer(i) for i in range(4)] == [True, False, True, False]
        assert m.num_windowed_layers == layers // 2 and m.num_moe_layers == layers


def test_deepseek_r1_is_the_deepseek_v3_architecture():
    r1, v3 = load_model("deepseek_r1"), load_model("deepseek_v3")
    assert dataclasses.replace(r1, name=v3.name) == v3


def test_qwen3_moe_and_llama4_layouts():
    for name in ("qwen3_30b_a3b", "qwen3_235b_a22b"):
        m = load_model(name)
        assert (m.num_experts, m.top_k, m.num_shared_experts) == (128, 8, 0)
        assert m.num_moe_layers == m.num_layers and not m.has_dense_layers
    scout, maverick = load_model("llama4_scout"), load_model("llama4_maverick")
    assert (scout.num_experts, scout.top_k, scout.num_shared_experts) == (16, 1, 1)
    assert scout.num_moe_layers == 48
    assert (maverick.num_experts, maverick.top_k, maverick.num_shared_experts) == (128, 1, 1)
    # Hugging Face: moe_layers = range(step - 1, num_hidden_layers, step)
    assert [i for i in range(48) if maverick.is_moe_layer(i)] == list(range(1, 48, 2))
    assert (maverick.num_dense_layers, maverick.num_moe_layers) == (24, 24)


# ------------------------------------------------------------------- the interleave


def interleaved(**kw) -> ModelSpec:
    """A small MoE model with a leading dense layer and MoE on every second layer after it."""
    base = dict(
        name="interleave_test",
        num_experts=8,
        top_k=2,
        moe_ffn_hidden_size=128,
        num_shared_experts=1,
        first_dense_layers=1,
        moe_layer_interval=2,
    )
    small = llama(layers=7, hidden=256, heads=4, kv_heads=2, ffn=1024, vocab=1024)
    return small.replace(**{**base, **kw})


def test_interleave_layer_pattern():
    m = interleaved()  # layer 0 dense, then MoE on every second layer: 2, 4, 6
    assert [m.is_moe_layer(i) for i in range(7)] == [False, False, True, False, True, False, True]
    assert (m.num_dense_layers, m.num_moe_layers) == (4, 3)
    assert interleaved(moe_layer_interval=1).num_moe_layers == 6
    assert interleaved(first_dense_layers=0, moe_layer_interval=3).num_moe_layers == 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"moe_layer_interval": 0}, r"model\.moe_layer_interval must be > 0"),
        ({"moe_layer_interval": 7}, r"model\.moe_layer_interval\(7\) leaves no MoE layer"),
        (
            {"num_experts": 0, "top_k": 0, "num_shared_experts": 0, "first_dense_layers": 0},
            r"model\.moe_layer_interval\(2\) needs num_experts > 0",
        ),
    ],
)
def test_interleave_validation(changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        interleaved(**changes)
    assert "\n" not in str(err.value)


def subs_of(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> dict:
    return {Symbols.all()[k]: v for k, v in bind(model, training, plan).items()}


def by_hand(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> dict[str, float]:
    """Parameters and per-stage flops summed layer by layer from the section costs, each layer
    taken as dense or MoE by ``ModelSpec.is_moe_layer``."""
    graphs = build_graphs(model, plan, training)
    subs = subs_of(model, plan, training)
    mode = plan.recompute

    def section(graph, tied=None) -> tuple[float, float]:
        sc = section_costs(graph, tied)
        return float(sc.params.xreplace(subs)), float(sc.compute_flops[mode].xreplace(subs))

    emb = section(graphs.embed)
    head = section(graphs.head, graphs.tied_head_weight)
    blk = section(graphs.block)
    dns = section(graphs.dense) if graphs.dense is not None else None

    def layer(i: int) -> tuple[float, float]:
        return blk if dns is None or model.is_moe_layer(i) else dns

    counts = virtual_stage_layers(model.num_layers, plan.pp, 1, plan.stage_layers)
    last_start = model.num_layers - counts[-1]
    first = emb[1] + sum(layer(i)[1] for i in range(counts[0])) + (head[1] if plan.pp == 1 else 0)
    last = sum(layer(i)[1] for i in range(last_start, model.num_layers)) + head[1]
    params = emb[0] + head[0] + sum(layer(i)[0] for i in range(model.num_layers))
    return {"params": params, "stage_first_flops": first, "stage_last_flops": last}


@pytest.mark.parametrize(
    ("preset", "pp"),
    [
        ("llama4_maverick", 1),
        ("llama4_maverick", 2),
        ("llama4_maverick", 16),
        ("deepseek_v3", 4),
        ("glm_4_6", 8),
        (None, 2),
        (None, 3),
        (None, 5),
    ],
)
def test_parameters_and_stage_flops_count_each_layer_as_it_is(preset, pp):
    """The closed forms (stage_dse.graph.layers.dense_layers_among) give the first and
    last stage the dense and MoE layers they hold, for interleaved and leading dense layers."""
    model = load_model(preset) if preset else interleaved()
    training = TrainingSpec(seq_len=1024, global_batch_size=16)
    plan = ParallelPlan(pp=pp, dp=2, ep=2)
    got = evaluate_plan(model, training, plan)
    want = by_hand(model, plan, training)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


@pytest.mark.parametrize(("layers", "pp"), [(48, 16), (48, 4), (7, 3), (9, 4), (11, 3)])
def test_middle_stage_holds_the_most_moe_layers_its_length_allows(layers, pp):
    model = interleaved(num_layers=layers)
    counts = virtual_stage_layers(layers, pp, 1, "balanced")
    values = stage_values(layers, pp, 1, "balanced")
    n = values["mid_layers"]
    starts = [sum(counts[:s]) for s in range(pp)]
    moe_on = [sum(model.is_moe_layer(i) for i in range(a, a + c)) for a, c in zip(starts, counts)]
    subs = {
        Symbols.layers: layers,
        Symbols.dense_layers: model.first_dense_layers,
        Symbols.moe_interval: model.moe_layer_interval,
    }
    dense_mid = int(dense_layers_among(sp.Integer(n), "mid").xreplace(subs))
    middles = [moe_on[s] for s in range(1, pp - 1) if counts[s] == n]
    assert n - dense_mid == max(middles)  # exact: some middle stage of that length holds them
    first = int(dense_layers_among(sp.Integer(counts[0]), "first").xreplace(subs))
    last = int(dense_layers_among(sp.Integer(counts[-1]), "last").xreplace(subs))
    assert counts[0] - first == moe_on[0] and counts[-1] - last == moe_on[-1]


def test_maverick_serving_weights_count_dense_layers_as_dense():
    """Half of Maverick's layers are dense: the weights a GPU holds are the model's parameters
    over the stages (the sum of the stages is every parameter once), not 48 MoE layers."""
    import pandas as pd

    from stage_dse.cost.bind import bind_hardware
    from stage_dse.cost.serving import evaluate_serving_table, serving_key

    model = load_model("llama4_maverick")
    params = evaluate_plan(model, TRAINING, ParallelPlan())["params"]
    spec = ServingSpec(prompt_len=1024, output_tokens=128, batch_size=1, weights_dtype="fp8")
    got = {}
    for pp in (1, 2, 4):
        plan = ParallelPlan(tp=8, pp=pp, expert_tensor_parallel=True)
        like = spec.step_like(H100, replicas=plan.dp)
        row = {
            **bind(model, like, plan.replace(micro_batch_size=spec.batch_size)),
            **bind_hardware(H100, load_cluster("dgx_h100", num_gpus=plan.num_gpus)),
            "prompt": spec.prompt_len,
            "output_tokens": spec.output_tokens,
        }
        out = evaluate_serving_table(pd.DataFrame([row]), [serving_key(model, spec, plan)])
        got[pp] = out.iloc[0]["serve_weights_bytes"] * 8  # bytes on the tp group of a stage
    # fp8 weights: one byte per parameter (norms and the router, 16-bit, are < 0.01%). The
    # heaviest stage is the last: its share of the 48 layers (half of them dense) and the
    # output layer, a vocab x hidden matrix as large as the embedding on the first stage
    matrix = model.vocab_size * model.hidden_size
    assert got[1] == pytest.approx(params, rel=1e-3)
    for pp in (2, 4):
        assert got[pp] == pytest.approx((params - 2 * matrix) / pp + matrix, rel=1e-3), pp


def test_interleaved_layer_runs_alternate_in_the_trace_schedule():
    model = interleaved()
    plan = ParallelPlan(pp=2, dp=2, ep=2)
    graphs = build_graphs(model, plan, TrainingSpec(seq_len=256, global_batch_size=16))
    kinds = [
        ("dense" if g is graphs.dense else "moe", n) for g, n in layer_runs(graphs, model, 0, 7)
    ]
    assert kinds == [("dense", 2), ("moe", 1), ("dense", 1), ("moe", 1), ("dense", 1), ("moe", 1)]


def test_interleaved_sweep_rows_give_back_the_model_and_its_trace(tmp_path):
    """Through a sweep and its Parquet rows (moe_interval column) back to the specs, and a
    trace whose compute flops are the cost layer's."""
    model = interleaved(num_layers=6)
    spec = SweepSpec(
        name="interleave",
        models=(model,),
        training=TrainingSpec(seq_len=256, global_batch_size=16),
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=(8,),
        space=SearchSpace(ep="auto", micro_batch_size=(1,)),
    )
    store = ResultStore(tmp_path / "interleave")
    report = run_grid(spec, LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert report.valid == len(df) > 0
    row = df[(df.pp == 2) & (df.ep == 2)].iloc[0]
    cfg = config_from_row(row)
    assert (cfg.model.moe_layer_interval, cfg.model.num_moe_layers) == (2, 2)
    assert cfg.model == dataclasses.replace(
        model, name=cfg.model.name, max_positions=cfg.model.max_positions
    )
    out = tmp_path / "trace"
    write_trace_set(cfg, out)
    assert check_trace_dir(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]
