"""DeepSeek Sparse Attention (``ModelSpec.sparse_attention_topk``, DeepSeek-V3.2): validation,
the lightning indexer's key cache and scores, and latent attention over the top-k tokens, each
against a hand formula."""

from __future__ import annotations

import pandas as pd
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, bind_hardware
from stage_dse.cost.serving import evaluate_serving_table, serving_key
from stage_dse.errors import ConfigError
from stage_dse.graph.ir import OpKind
from stage_dse.graph.symbols import S
from stage_dse.graph.transformer import build_serving_graphs
from stage_dse.spec.serving import ServingSpec, serving_plan

H200 = load_hardware("h200")
V32 = load_model("deepseek_v3_2")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sparse_attention_topk": -1}, r"model\.sparse_attention_topk must be an integer >= 0"),
        ({"indexer_heads": 0}, r"needs indexer_heads and indexer_head_dim > 0"),
        ({"q_lora_rank": 0, "kv_lora_rank": 0, "rope_head_dim": 0}, r"needs latent attention"),
        ({"sparse_attention_topk": 0}, r"indexer_heads/indexer_head_dim need sparse_attention"),
    ],
)
def test_sparse_attention_validation(changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        V32.replace(**changes)
    assert "\n" not in str(err.value)


def test_v3_2_is_v3_plus_the_indexer():
    v3 = load_model("deepseek_v3")
    assert (
        V32.replace(name=v3.name, sparse_attention_topk=0, indexer_heads=0, indexer_head_dim=0)
        == v3
    )
    assert (V32.sparse_attention_topk, V32.indexer_heads, V32.indexer_head_dim) == (2048, 64, 128)


def decode_ops(context: int):
    spec = ServingSpec(prompt_len=64, weights_dtype="fp8", kv_dtype="fp8")
    plan = serving_plan(V32, 8, 1, 1)
    key = serving_key(V32, spec, plan)
    graphs = build_serving_graphs(key.graph, "decode", key.kv_bytes)
    values = {**bind(V32, spec.step_like(H200), plan), "context": context, "seq": 1}
    subs = {s: values[s.name] for s in S.all().values() if s.name in values}
    ops = {op.name: op for g in (graphs.dense, graphs.block) for op in g.ops}
    return ops, subs


@pytest.mark.parametrize("context", [512, 16384])
def test_decode_attends_over_the_top_k_and_scores_every_key(context):
    """One query per sequence: latent attention over min(context, 2048) cached latents,
    2 x heads x ((kv_lora + rope) + kv_lora) flops per position; the indexer scores every
    cached key, 2 x index heads x index dim flops each, on every tensor-parallel rank."""
    ops, subs = decode_ops(context)
    a, kc, kl = V32.num_heads, V32.kv_lora_rank + V32.rope_head_dim, V32.kv_lora_rank
    read = min(context, 2048)
    attention = ops["core_attention"]
    assert attention.kind is OpKind.ATTENTION
    assert float(attention.flops.subs(subs)) == 2 * a / 8 * (kc + kl) * read  # heads over tp 8
    scores = ops["indexer.scores"]
    assert float(scores.flops.subs(subs)) == 2 * 64 * 128 * context
    assert float(attention.inputs[1].local_bytes.subs(subs)) == read * kc  # fp8 latents


def serve(model, prompt: int, output: int = 256):
    spec = ServingSpec(prompt_len=prompt, output_tokens=output, batch_size=8,
                       weights_dtype="fp8", kv_dtype="fp8")  # fmt: skip
    plan = serving_plan(model, 8, 1, spec.batch_size)
    key = serving_key(model, spec, plan)
    row = {
        **bind(model, spec.step_like(H200), plan),
        **bind_hardware(H200, load_cluster("dgx_h100", num_gpus=8)),
        "prompt": prompt,
        "output_tokens": output,
    }
    return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]


def test_cache_holds_every_token_with_the_index_keys():
    """The latent cache is not shortened (the indexer may pick any earlier token): per token
    and layer the fp8 latent (kv_lora + rope) plus the indexer's fp8 key (index dim)."""
    got = serve(V32, 4096)
    per_token = V32.num_layers * (V32.kv_lora_rank + V32.rope_head_dim + V32.indexer_head_dim)
    assert got["serve_kv_bytes_per_token"] == per_token


def test_long_contexts_attend_less_than_dense_v3():
    """Past 2048 tokens the latent attention reads 2048 of them; the indexer still scores
    every key, on every tensor-parallel rank."""
    dense = load_model("deepseek_v3")
    long_v3, long_v32 = serve(dense, 32768), serve(V32, 32768)
    assert long_v32["serve_decode_attention_s"] < 0.6 * long_v3["serve_decode_attention_s"]
    # short prompts attend to every token either way: the indexer only adds
    short_v3, short_v32 = serve(dense, 512), serve(V32, 512)
    assert short_v32["serve_tpot_s"] > short_v3["serve_tpot_s"]
    assert short_v32["serve_ttft_s"] > short_v3["serve_ttft_s"]
    indexer = V32.num_layers * (1536 * 64 * 128 + 7168 * 128 + 7168 * 64 + 128)
    assert short_v32["serve_weights_bytes"] - short_v3["serve_weights_bytes"] == pytest.approx(
        indexer, rel=1e-9
    )  # fp8 weights (and the key norm's 128), replicated on every rank


def test_prefill_attention_and_index_scores_of_a_prompt():
    """Prefill: latent attention over a band of 2048 ((2048 + tile) / prompt of the tiles),
    the index scores over the causal pairs (1/2 + tile / 2 prompt)."""
    spec = ServingSpec(prompt_len=8192, weights_dtype="fp8", kv_dtype="fp8")
    plan = serving_plan(V32, 8, 1, 1)
    key = serving_key(V32, spec, plan)
    graphs = build_serving_graphs(key.graph, "prefill", key.kv_bytes)
    values = {**bind(V32, spec.step_like(H200), plan), "context": 8192, "seq": 8192}
    subs = {s: values[s.name] for s in S.all().values() if s.name in values}
    ops = {op.name: op for op in graphs.block.ops}
    attention, scores = ops["core_attention"], ops["indexer.scores"]
    assert float(attention.executed_fraction.subs(subs)) == (2048 + 128) / 8192
    assert float(scores.executed_fraction.subs(subs)) == 0.5 + 128 / (2 * 8192)
    assert float(scores.flops.subs(subs)) == 2 * 8192 * 8192 * 64 * 128
