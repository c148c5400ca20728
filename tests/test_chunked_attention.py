"""Chunked local attention (``ModelSpec.attention_chunk_size``, Llama 4's iRoPE): the keys a
chunked layer reads against a brute-force count, validation, and what it changes in the
serving program (attention in prefill and decode, not the cache) and in training."""

from __future__ import annotations

import pandas as pd
import pytest
import sympy as sp
from conftest import llama
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, bind_hardware, evaluate_plan
from stage_dse.cost.serving import evaluate_serving_table, serving_key
from stage_dse.errors import ConfigError
from stage_dse.graph.dims import chunked_decode_keys, chunked_keys
from stage_dse.graph.forward import causal_fraction, chunked_fraction
from stage_dse.graph.ir import OpKind, Role
from stage_dse.graph.symbols import S
from stage_dse.graph.transformer import build_serving_graphs, graph_key
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.spec.serving import ServingSpec, serving_plan

H100 = load_hardware("h100_sxm")
CHUNK = 1024


def chunked(interval: int = 4, chunk: int = CHUNK) -> ModelSpec:
    """A small GQA model whose every ``interval``-th layer is global, the others chunked."""
    base = llama(layers=8, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=1024)
    return base.replace(attention_chunk_size=chunk, full_attention_interval=interval)


def unchunked(model: ModelSpec) -> ModelSpec:
    return model.replace(attention_chunk_size=0, full_attention_interval=0)


@settings(max_examples=80, deadline=None)
@given(positions=st.integers(1, 5000), chunk=st.integers(1, 700))
def test_chunked_keys_count_every_query(positions, chunk):
    """Query p reads the positions from its chunk's start to itself: p mod chunk + 1."""
    brute = sum(p % chunk + 1 for p in range(positions))
    assert int(chunked_keys(sp.Integer(positions), sp.Integer(chunk))) == brute


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 3000), output=st.integers(1, 3000), chunk=st.integers(1, 900))
def test_chunked_decode_keys_are_the_mean_over_the_output(prompt, output, chunk):
    brute = sum(p % chunk + 1 for p in range(prompt, prompt + output)) / output
    got = float(chunked_decode_keys(sp.Integer(prompt), sp.Integer(output), sp.Integer(chunk)))
    assert got == pytest.approx(brute, rel=1e-12)


def test_chunked_fraction_is_causal_within_a_chunk_and_a_band_beyond():
    for seq in (64, 1000, 8192):
        got = float(chunked_fraction(sp.Integer(seq), sp.Integer(8192)))
        assert got == float(causal_fraction(sp.Integer(seq)))
    # 20,000 positions in chunks of 8,192: two whole chunks and 3,616 positions
    keys = 2 * 8192 * 8193 / 2 + 3616 * 3617 / 2
    got = float(chunked_fraction(sp.Integer(20000), sp.Integer(8192)))
    assert got == pytest.approx((keys / 20000 + 128) / 20000, rel=1e-12)
    assert got < float(causal_fraction(sp.Integer(20000))) / 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_chunk_size": -8}, r"model\.attention_chunk_size must be >= 0"),
        ({"sliding_window": 128}, r"sliding_window\(128\) and attention_chunk_size\(1024\)"),
        ({"full_attention_interval": 1}, r"full_attention_interval\(1\) leaves no windowed"),
        ({"attention_chunk_size": 0}, r"needs sliding_window or attention_chunk_size > 0"),
    ],
)
def test_chunk_validation(changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        chunked().replace(**changes)
    assert "\n" not in str(err.value)


def test_chunk_rejected_with_latent_attention():
    with pytest.raises(ConfigError, match=r"attention_chunk_size needs grouped-query attention"):
        load_model("deepseek_v3", attention_chunk_size=8192)


def test_llama4_presets_chunk_three_of_four_layers():
    for name in ("llama4_scout", "llama4_maverick"):
        m = load_model(name)
        assert m.attention_chunk_size == 8192 and m.num_windowed_layers == 36
        assert [i for i in range(8) if not m.is_windowed_layer(i)] == [3, 7]


def serve(model: ModelSpec, spec: ServingSpec) -> pd.Series:
    plan = serving_plan(model, 1, 1, spec.batch_size)
    key = serving_key(model, spec, plan)
    row = {
        **bind(model, spec.step_like(H100, replicas=plan.dp), plan),
        **bind_hardware(H100, load_cluster("dgx_h100", num_gpus=plan.num_gpus)),
        "prompt": spec.prompt_len,
        "output_tokens": spec.output_tokens,
    }
    return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]


def test_chunks_shorten_attention_but_keep_the_whole_cache():
    model = chunked()
    spec = ServingSpec(prompt_len=8 * CHUNK, output_tokens=2 * CHUNK, batch_size=64)
    chunk, full = serve(model, spec), serve(unchunked(model), spec)
    for col in ("serve_kv_cache_bytes", "serve_kv_bytes_per_token", "serve_weights_bytes"):
        assert chunk[col] == full[col]
    for col in ("serve_prefill_attention_s", "serve_decode_attention_s", "serve_tpot_s"):
        assert chunk[col] < full[col]
    # what is not attention is unchanged
    assert chunk["serve_ttft_s"] - chunk["serve_prefill_attention_s"] == pytest.approx(
        full["serve_ttft_s"] - full["serve_prefill_attention_s"], rel=1e-9
    )


def test_sequences_within_one_chunk_change_nothing():
    model = chunked(chunk=8192)
    spec = ServingSpec(prompt_len=2048, output_tokens=512, batch_size=8)
    chunk, full = serve(model, spec), serve(unchunked(model), spec)
    for col in ("serve_ttft_s", "serve_tpot_s", "serve_kv_cache_bytes"):
        assert chunk[col] == pytest.approx(full[col], rel=1e-12)


def _attention_op(graph):
    (op,) = [o for o in graph.ops if o.kind is OpKind.ATTENTION and o.phase.value == "forward"]
    return op


@pytest.mark.parametrize(("prompt", "output"), [(4 * CHUNK, 64), (100, 3 * CHUNK)])
def test_decode_reads_the_current_chunk(prompt, output):
    """Decode: a chunked layer's query reads its chunk's positions so far, the mean over the
    output (4 x 2 x heads x head dim flops and 2 x kv heads x head dim x 2 bytes a position);
    its cache holds the whole context, as a global layer's does."""
    model = chunked()
    plan = serving_plan(model, 1, 1, 1)
    spec = ServingSpec(prompt_len=prompt, output_tokens=output)
    key = graph_key(model, plan, spec.step_like())
    graphs = build_serving_graphs(key, "decode", 2)
    context = prompt + output / 2
    values = {
        **bind(model, spec.step_like(), plan),
        "context": context,
        "seq": 1,
        "prompt": prompt,
        "output_tokens": output,
    }
    subs = {sym: values[sym.name] for sym in S.all().values() if sym.name in values}
    reads = sum(p % CHUNK + 1 for p in range(prompt, prompt + output)) / output
    win, full = _attention_op(graphs.windowed), _attention_op(graphs.block)
    per_position = 4 * model.num_heads * model.head_dim
    assert float(win.flops.subs(subs)) == pytest.approx(per_position * reads, rel=1e-12)
    assert float(full.flops.subs(subs)) == pytest.approx(per_position * context, rel=1e-12)
    per_position_bytes = 2 * model.num_kv_heads * model.head_dim * 2
    assert float(win.inputs[1].local_bytes.subs(subs)) * 2 == pytest.approx(
        per_position_bytes * reads, rel=1e-12
    )
    caches = [t for op in graphs.windowed.ops for t in op.inputs if t.role is Role.KV_CACHE]
    assert {float(t.local_bytes.subs(subs)) * 2 for t in caches} == {per_position_bytes * context}


def test_training_within_a_chunk_is_unchanged_and_beyond_it_cheaper():
    model = chunked(chunk=2048)
    plan = ParallelPlan()
    kw = {"hardware": H100, "cluster": load_cluster("dgx_h100", num_gpus=1)}
    short = TrainingSpec(seq_len=2048, global_batch_size=8)
    assert evaluate_plan(model, short, plan, **kw)["step_s"] == pytest.approx(
        evaluate_plan(unchunked(model), short, plan, **kw)["step_s"], rel=1e-12
    )
    long = TrainingSpec(seq_len=8192, global_batch_size=8)
    got = evaluate_plan(model, long, plan, **kw)
    full = evaluate_plan(unchunked(model), long, plan, **kw)
    assert got["model_flops_causal"] < full["model_flops_causal"]
    assert got["step_s"] < full["step_s"]
    assert got["model_flops"] == full["model_flops"]  # the full-attention convention
