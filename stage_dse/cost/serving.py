"""Serving costs: time to first token, time per output token, throughput, KV cache.

What lives here: the serving cost program of a model family, derived from the forward-only
prefill and decode graphs (:func:`stage_dse.graph.transformer.build_serving_graphs`) with the
same per-op roofline and collective models as training, compiled once and evaluated over tables
of serving configurations. No I/O.

* **Prefill** runs the prompt (``prompt`` tokens per sequence) through every layer once: the time
  to first token. **Decode** runs one token per sequence against a KV cache of the mean length
  ``prompt + output_tokens / 2``: the time per output token. A pass crosses the pipeline stages
  one after the other (plus a send per stage boundary); with ``pp`` stages, ``pp`` batches are in
  flight, so throughput is ``pp x batch / time per token`` (``batch`` over all expert-parallel
  attention ranks when the experts are split over ``ep = dp`` of them).
* Decode is memory bound when its bytes (weights, KV cache, activations) at achieved HBM
  bandwidth take longer than its flops at achieved peak: the roofline of every op decides, and
  the program reports both sides (``serve_decode_memory_s``, ``serve_decode_compute_s``) and the
  floor of reading every weight once (``serve_weight_read_s``).
* KV cache per token (all layers) is ``2 x layers x kv_heads x head_dim x bytes``, or
  ``layers x (kv_lora + rope_dim) x bytes`` under latent attention, read from the cache tensors
  of the graph; per GPU it is split over tensor-parallel ranks (kv heads; a latent is whole on
  every rank) and pipeline stages (layers). The capacity is how many sequences of
  ``prompt + output_tokens`` fit in the memory left after weights and the prefill working set
  (the peak of one layer's live activations in prefill, buffers reused as they die).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import sympy as sp

from stage_dse.cost.compile import SYMBOL_NAMES, _lambdify_symengine, _to_symengine, _wrap
from stage_dse.cost.time import _compute_time, collective_time
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, OpKind, Phase, Region, Role
from stage_dse.graph.symbols import S
from stage_dse.graph.transformer import GraphKey, build_serving_graphs, graph_key
from stage_dse.spec import MeshAxis, ModelSpec, ParallelPlan
from stage_dse.spec.serving import ServingSpec, validate_serving

__all__ = ["ServingKey", "evaluate_serving_table", "serving_key", "serving_program"]


@dataclass(frozen=True)
class ServingKey:
    graph: GraphKey
    kv_bytes: int
    rank_order: tuple[MeshAxis, ...]


def serving_key(model: ModelSpec, serving: ServingSpec, plan: ParallelPlan) -> ServingKey:
    validate_serving(model, serving, plan)
    like = serving.step_like()
    return ServingKey(graph_key(model, plan, like), serving.kv_dtype.bytes, plan.rank_order)


def _sum(items) -> sp.Expr:
    items = list(items)
    return sp.Add(*items) if items else sp.Integer(0)


def _peak_live_bytes(ops) -> tuple[sp.Expr, ...]:
    """Per-GPU bytes of activations alive at each op of a forward-only pass, their peak being
    the working set (:func:`_peak`): a tensor lives from the op that writes it (the section's
    input from the start) to the last op that reads it, views alias what they view. What an
    inference engine reusing its buffers needs."""
    alias: dict = {}
    for op in ops:
        if op.kind is OpKind.VIEW:
            alias[op.outputs[0]] = alias.get(op.inputs[0], op.inputs[0])
    live = (Role.ACTIVATION, Role.INPUT)
    span: dict = {}  # tensor -> [first, last] op index
    for i, op in enumerate(ops):
        if op.kind is OpKind.VIEW:
            continue
        for t in op.inputs:
            t = alias.get(t, t)
            if t.role in live:
                span.setdefault(t, [0, i])[1] = i
        for t in op.outputs:
            if t.role in live:
                span.setdefault(t, [i, i])
    per_op = (
        _sum(t.local_bytes for t, (a, b) in span.items() if a <= i <= b) for i in range(len(ops))
    )
    return tuple(dict.fromkeys(per_op))


def _peak(terms: tuple[sp.Expr, ...], subs: dict) -> sp.Expr:
    """The largest of ``terms`` after substitution (kept unevaluated: sympy would try to order
    the symbolic terms)."""
    terms = tuple(dict.fromkeys(t.xreplace(subs) for t in terms))
    return sp.Max(*terms, evaluate=False) if len(terms) > 1 else _sum(terms)


def _forward(graph: Graph, order) -> dict[str, sp.Expr]:
    ops = [op for op in graph.ops if op.phase is Phase.FORWARD]
    compute, comm, mem, flops, attention = [], [], [], [], []
    for op in ops:
        if op.is_comm:
            comm.append(collective_time(op.coll, op.group, op.comm_bytes, order))
        elif op.kind not in (OpKind.VIEW, OpKind.COLLECTIVE):
            t = _compute_time(op)
            (attention if op.region is Region.ATTENTION_CORE else compute).append(t)
            mem.append(op.bytes / (S.hbm_bandwidth * S.memory_efficiency))
            eff = S.gemm_efficiency if op.kind is OpKind.EINSUM else S.attention_efficiency
            if op.matmul:
                flops.append(op.flops / (S.peak_flops * S.sustained_clock * eff))
    weights = _sum(w.local_numel * w.dtype_bytes for w in graph.weights)
    caches = {t for op in ops for t in op.inputs if t.role is Role.KV_CACHE}
    kv_global = _sum(t.numel * t.dtype_bytes for t in caches)
    kv_local = _sum(t.local_bytes for t in caches)
    working = _peak_live_bytes(ops)
    return {
        "time": _sum(compute) + _sum(comm) + _sum(attention),
        "attention_time": _sum(attention),
        "memory_time": _sum(mem),
        "compute_time": _sum(flops),
        "weights": weights,
        "kv_global": kv_global,
        "kv_local": kv_local,
        "working": working,
    }


@lru_cache(maxsize=64)
def serving_program(key: ServingKey) -> dict[str, sp.Expr]:
    """Named serving outputs over the symbols (``serve_*``)."""
    L, pp = S.layers, S.pp
    # layers on the fullest stage under the plan's split (stage_dse.spec.stages)
    per_stage = sp.Max(S.first_layers, S.last_layers, S.mid_layers)
    single = sp.Max(0, 2 - pp)
    out: dict[str, sp.Expr] = {}
    passes = {}
    for mode, subs in (
        ("prefill", {S.seq: S.prompt, S.context: S.prompt}),
        ("decode", {S.seq: sp.Integer(1), S.context: S.prompt + S.output_tokens / 2}),
    ):
        graphs = build_serving_graphs(key.graph, mode, key.kv_bytes)
        emb = _forward(graphs.embed, key.rank_order)
        blk = _forward(graphs.block, key.rank_order)
        head = _forward(graphs.head, key.rank_order)
        dns = _forward(graphs.dense, key.rank_order) if graphs.dense is not None else None
        n_dense = S.dense_layers if dns is not None else 0
        boundary = graphs.boundary.local_bytes
        hop = collective_time(CollKind.SEND_RECV, {MeshAxis.PP}, boundary, key.rank_order)

        def total(field: str, emb=emb, blk=blk, head=head, dns=dns, n_dense=n_dense) -> sp.Expr:
            t = emb[field] + (L - n_dense) * blk[field] + head[field]
            return t + (n_dense * dns[field] if dns is not None else 0)

        passes[mode] = {
            "time": (total("time") + (pp - 1) * hop).xreplace(subs),
            "attention_time": total("attention_time").xreplace(subs),
            "memory_time": (total("memory_time") / pp).xreplace(subs),
            "compute_time": (total("compute_time") / pp).xreplace(subs),
            "working": _peak(blk["working"], subs),
            "kv_global": blk["kv_global"],
            "kv_local": blk["kv_local"],
        }
        if mode == "decode":
            weights_first = (
                emb["weights"] + S.first_layers * blk["weights"] + single * head["weights"]
            )
            weights_last = S.last_layers * blk["weights"] + head["weights"]
            weights_mid = S.mid_layers * blk["weights"]
            out["serve_weights_bytes"] = sp.Max(weights_first, weights_last, weights_mid)
    dec, pre = passes["decode"], passes["prefill"]
    batch = S.micro_batch * S.dp
    # per token per layer, from the cache tensors: [batch, context, kv heads, head dim]
    per_token_layer = dec["kv_global"] / (batch * S.context)
    per_token_layer_gpu = dec["kv_local"] / (S.micro_batch * S.context)
    seq_len = S.prompt + S.output_tokens
    kv_per_seq_gpu = seq_len * per_token_layer_gpu * per_stage
    gpus = S.tp * S.pp * S.dp  # dp > 1 only as expert parallelism's attention ranks
    out["serve_ttft_s"] = pre["time"]
    out["serve_tpot_s"] = dec["time"]
    out["serve_tokens_per_s_per_gpu"] = pp * batch / dec["time"] / gpus
    out["serve_kv_bytes_per_token"] = L * per_token_layer
    out["serve_kv_cache_bytes"] = pp * S.micro_batch * kv_per_seq_gpu
    out["serve_working_bytes"] = pre["working"]
    out["serve_mem_total_bytes"] = (
        out["serve_weights_bytes"] + out["serve_kv_cache_bytes"] + out["serve_working_bytes"]
    )
    out["serve_mem_headroom_bytes"] = S.usable_memory - out["serve_mem_total_bytes"]
    free = S.usable_memory - out["serve_weights_bytes"] - out["serve_working_bytes"]
    out["serve_kv_capacity_seqs"] = sp.floor(sp.Max(0, free, evaluate=False) / kv_per_seq_gpu)
    # the attention-core kernels of each pass (what attends over the context), the rest being
    # linear layers, norms, collectives and pipeline hops: the parts of a continuous-batching
    # step (stage_dse.cost.batching)
    out["serve_prefill_attention_s"] = pre["attention_time"]
    out["serve_decode_attention_s"] = dec["attention_time"]
    out["serve_decode_memory_s"] = dec["memory_time"]
    out["serve_decode_compute_s"] = dec["compute_time"]
    out["serve_weight_read_s"] = out["serve_weights_bytes"] / S.hbm_bandwidth
    return out


@lru_cache(maxsize=64)
def _compiled(key: ServingKey):
    outputs = serving_program(key)
    names = tuple(outputs)
    fn = _lambdify_symengine(_to_symengine([], [outputs[n] for n in names]))
    return names, _wrap(fn, len(names))


def evaluate_serving_table(table: pd.DataFrame, keys: list[ServingKey]) -> pd.DataFrame:
    """Serving outputs of every row; ``keys[i]`` is row i's serving key."""
    if len(table) == 0:
        return pd.DataFrame(index=table.index)
    x = table[list(SYMBOL_NAMES)].to_numpy(dtype=np.float64)
    codes: dict[ServingKey, list[int]] = {}
    for i, k in enumerate(keys):
        codes.setdefault(k, []).append(i)
    frames = []
    for k, rows in codes.items():
        names, fn = _compiled(k)
        y = fn(x[rows])
        frames.append(pd.DataFrame(y, columns=list(names), index=table.index[rows]))
    return pd.concat(frames).reindex(table.index)
