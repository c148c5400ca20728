"""Sliding-window attention (``ModelSpec.sliding_window``, ``full_attention_interval``): the
layer pattern and its count per stage, validation, the KV cache and attention of the serving
program, and attention flops in training, each against a hand formula."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import llama
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import bind, bind_hardware, evaluate_plan
from stage_dse.cost.serving import evaluate_serving_table, serving_key
from stage_dse.errors import ConfigError
from stage_dse.graph.forward import ATTENTION_TILE
from stage_dse.graph.ir import OpKind
from stage_dse.graph.layers import windowed_layers_among
from stage_dse.graph.symbols import S
from stage_dse.graph.transformer import build_serving_graphs, graph_key
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.spec.serving import ServingSpec, serving_plan

H100 = load_hardware("h100_sxm")
WINDOW = 128


def windowed(interval: int = 2, window: int = WINDOW, **kw) -> ModelSpec:
    """A small GQA model with windowed layers (every ``interval``-th layer full)."""
    base = llama(layers=6, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=1024)
    return base.replace(sliding_window=window, full_attention_interval=interval, **kw)


def test_layer_pattern():
    # every second layer full, from layer 1 (gpt-oss's layer_types)
    m = windowed()
    assert [m.is_windowed_layer(i) for i in range(6)] == [True, False] * 3
    assert m.num_windowed_layers == 3
    assert windowed(interval=3).num_windowed_layers == 4
    every = windowed(interval=0)
    assert every.num_windowed_layers == 6 and all(every.is_windowed_layer(i) for i in range(6))
    assert llama().num_windowed_layers == 0 and not llama().is_windowed_layer(0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sliding_window": -1}, r"model\.sliding_window must be >= 0"),
        ({"full_attention_interval": -2}, r"model\.full_attention_interval must be >= 0"),
        ({"sliding_window": 0}, r"interval\(2\) needs sliding_window or attention_chunk_size"),
        ({"full_attention_interval": 1}, r"full_attention_interval\(1\) leaves no windowed"),
        ({"full_attention_interval": 7}, r"full_attention_interval\(7\) must be <= num_layers"),
        ({"sliding_window": 1.5}, r"model\.sliding_window must be >= 0 \(an integer\)"),
    ],
)
def test_window_validation(changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        windowed().replace(**changes)
    assert "\n" not in str(err.value)


def test_window_rejected_with_latent_attention():
    with pytest.raises(ConfigError, match=r"sliding_window needs grouped-query attention"):
        load_model("deepseek_v3", sliding_window=128)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(2, 40),
    interval=st.integers(2, 8),
    cut=st.data(),
)
def test_windowed_layers_among_counts_the_pattern(layers, interval, cut):
    """First and last stage exactly; a middle stage at most as many windowed layers as any
    run of its length has (the heavier, full-attention case), and at most one fewer."""
    if interval > layers:
        interval = layers
    m = llama(layers=layers).replace(sliding_window=64, full_attention_interval=interval)
    n = cut.draw(st.integers(1, layers))
    values = {S.layers: layers, S.full_interval: interval}
    first = int(windowed_layers_among(sp_int(n), "first").subs(values))
    last = int(windowed_layers_among(sp_int(n), "last").subs(values))
    mid = int(windowed_layers_among(sp_int(n), "mid").subs(values))
    assert first == sum(m.is_windowed_layer(i) for i in range(n))
    assert last == sum(m.is_windowed_layer(i) for i in range(layers - n, layers))
    runs = [sum(m.is_windowed_layer(i) for i in range(a, a + n)) for a in range(layers - n + 1)]
    assert min(runs) - 1 <= mid <= min(runs)
    assert int(windowed_layers_among(sp_int(layers), "whole").subs(values)) == (
        m.num_windowed_layers
    )


def sp_int(n: int):
    import sympy as sp

    return sp.Integer(n)


def serve(model: ModelSpec, serving: ServingSpec, tp: int = 1) -> pd.Series:
    plan = serving_plan(model, tp, 1, serving.batch_size)
    key = serving_key(model, serving, plan)
    like = serving.step_like(H100, replicas=plan.dp)
    cluster = load_cluster("dgx_h100", num_gpus=plan.num_gpus)
    row = {
        **bind(model, like, plan),
        **bind_hardware(H100, cluster),
        "prompt": serving.prompt_len,
        "output_tokens": serving.output_tokens,
    }
    return evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0]


@pytest.mark.parametrize(("prompt", "output"), [(1024, 256), (64, 32)])
def test_serving_kv_cache_of_windowed_layers(prompt, output):
    """A windowed layer caches min(sequence, window) positions, a full one the sequence:
    2 (K and V) x kv heads x head dim x bytes per position, kv heads split over tp."""
    model, batch, tp = windowed(), 4, 2
    got = serve(model, ServingSpec(prompt_len=prompt, output_tokens=output, batch_size=batch), tp)
    seq = prompt + output
    per_position_layer = 2 * model.num_kv_heads * model.head_dim * 2  # bf16 cache
    n_win = model.num_windowed_layers
    n_full = model.num_layers - n_win
    per_seq = per_position_layer * (n_full * seq + n_win * min(seq, WINDOW))
    assert got["serve_kv_cache_bytes"] == pytest.approx(batch * per_seq / tp, rel=1e-12)
    assert got["serve_kv_bytes_per_token"] == pytest.approx(per_seq / seq, rel=1e-12)
    free = H100.usable_bytes - got["serve_weights_bytes"] - got["serve_working_bytes"]
    assert got["serve_kv_capacity_seqs"] == int(free // (per_seq / tp))


def test_serving_window_shortens_attention_only():
    spec = ServingSpec(prompt_len=4096, output_tokens=512, batch_size=8)
    model = windowed()
    full = serve(model.replace(sliding_window=0, full_attention_interval=0), spec)
    win = serve(model, spec)
    assert win["serve_weights_bytes"] == full["serve_weights_bytes"]
    for col in ("serve_prefill_attention_s", "serve_decode_attention_s", "serve_ttft_s"):
        assert win[col] < full[col]
    # what is not attention (projections, MLPs, norms) is unchanged
    assert win["serve_ttft_s"] - win["serve_prefill_attention_s"] == pytest.approx(
        full["serve_ttft_s"] - full["serve_prefill_attention_s"], rel=1e-9
    )
    # a window longer than every sequence changes nothing
    wide = serve(model.replace(sliding_window=8192), spec)
    for col in ("serve_kv_cache_bytes", "serve_tpot_s", "serve_decode_attention_s"):
        assert wide[col] == pytest.approx(full[col], rel=1e-12)


def _attention_op(graph):
    (op,) = [o for o in graph.ops if o.kind is OpKind.ATTENTION and o.phase.value == "forward"]
    return op


@pytest.mark.parametrize("context", [64, 4096])
def test_decode_attention_flops_over_the_window(context):
    """Decode: one query per sequence attends to min(context, window) cached positions:
    QK^T and PV, 2 x 2 x heads x head dim flops per position."""
    model = windowed()
    plan = serving_plan(model, 1, 1, 1)
    spec = ServingSpec(prompt_len=64)
    key = graph_key(model, plan, spec.step_like())
    graphs = build_serving_graphs(key, "decode", 2)
    values = {**bind(model, spec.step_like(), plan), "context": context, "seq": 1}
    subs = {s: values[s.name] for s in S.all().values() if s.name in values}
    win, full = _attention_op(graphs.windowed), _attention_op(graphs.block)
    per_position = 4 * model.num_heads * model.head_dim
    assert float(win.flops.subs(subs)) == per_position * min(context, WINDOW)
    assert float(full.flops.subs(subs)) == per_position * context
    cache_bytes = 2 * model.num_kv_heads * model.head_dim * 2 * min(context, WINDOW)
    assert float(win.inputs[1].local_bytes.subs(subs)) * 2 == cache_bytes


def test_training_attention_flops_of_windowed_layers():
    """Causal attention's executed forward flops are 4 b s^2 a d x (1/2 + tile / 2s); a
    windowed layer computes the tiles of its band, 4 b s a d (window + tile), as long as
    s > 2 window + tile; the model's causal flops (forward + backward, 3x) drop by that
    difference on every windowed layer."""
    model = windowed()
    seq, batch = 4096, 8
    training = TrainingSpec(seq_len=seq, global_batch_size=batch)
    win = evaluate_plan(model, training, ParallelPlan())
    full = evaluate_plan(model.replace(sliding_window=0, full_attention_interval=0), training,
                         ParallelPlan())  # fmt: skip
    a, d, t = model.num_heads, model.head_dim, ATTENTION_TILE
    causal = 4 * batch * seq**2 * a * d * (0.5 + t / (2 * seq))
    band = 4 * batch * seq * a * d * (WINDOW + t)
    drop = 3 * model.num_windowed_layers * (causal - band)
    assert full["model_flops_causal"] - win["model_flops_causal"] == pytest.approx(drop, rel=1e-9)
    assert win["model_flops"] == full["model_flops"]  # the full-attention convention
    assert win["params"] == full["params"]


def test_training_time_drops_with_the_window():
    model = windowed(num_experts=8, top_k=2, moe_ffn_hidden_size=256)
    training = TrainingSpec(seq_len=8192, global_batch_size=64)
    plan = ParallelPlan(dp=8, ep=8)
    # without the host's issue of each op, which bounds this small model's layers in both
    # cases alike (40 us an op eagerly) and hides the attention it saves
    kw = {"hardware": H100.replace(host_op_s=0.0), "cluster": load_cluster("dgx_h100", num_gpus=8)}
    win = evaluate_plan(model, training, plan, **kw)
    full = evaluate_plan(model.replace(sliding_window=0, full_attention_interval=0), training,
                         plan, **kw)  # fmt: skip
    assert win["step_s"] < 0.99 * full["step_s"]
    assert win["mem_total_bytes"] == pytest.approx(full["mem_total_bytes"], rel=1e-12)
