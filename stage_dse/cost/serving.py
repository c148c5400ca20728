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
* Sliding-window layers (``ModelSpec.sliding_window``) attend over the band in prefill (the
  kernel skips the tiles outside it) and over at most ``window`` cached positions in decode,
  and cache at most ``window`` positions per sequence: per GPU the cache of a sequence is
  that of its stage's full-attention layers at the sequence's length plus its windowed ones
  at ``min(length, window)``; ``serve_kv_bytes_per_token`` is the whole model's cache of a
  ``prompt + output_tokens`` sequence per token of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import sympy as sp

from stage_dse.cost.compile import SYMBOL_NAMES, _lambdify_symengine, _to_symengine, _wrap
from stage_dse.cost.expr import _sum, lazy_xreplace
from stage_dse.cost.kernel_time import MOE_FUSED
from stage_dse.cost.network import node_dedup_share
from stage_dse.cost.serving_kernels import Measure, PassKernels
from stage_dse.cost.time import Kernel, _compute_time, collective_time
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, OpKind, Phase, Region, Role
from stage_dse.graph.layers import dense_layers_among, windowed_layers_among
from stage_dse.graph.symbols import DEGREE, S
from stage_dse.graph.transformer import GraphKey, build_serving_graphs, graph_key
from stage_dse.spec import MeshAxis, ModelSpec, ParallelPlan
from stage_dse.spec.serving import ROUTING_SKEW, ServingSpec, validate_serving

__all__ = [
    "ServingKey",
    "ServingTiming",
    "evaluate_serving_table",
    "measured_serving_program",
    "serving_key",
    "serving_program",
]


@dataclass(frozen=True)
class ServingKey:
    graph: GraphKey
    kv_bytes: int
    rank_order: tuple[MeshAxis, ...]
    moe_routing: str = "balanced"
    """How tokens spread over experts (:data:`~stage_dse.spec.serving.MOE_ROUTINGS`): the
    measured MoE kernels' tables, the roofline's busiest expert-parallel rank
    (:data:`~stage_dse.spec.serving.ROUTING_SKEW`)."""
    moe_dispatch: str = "allgather"
    """How expert-parallel ranks exchange tokens (:data:`~stage_dse.spec.serving.MOE_DISPATCHES`,
    :func:`_exchange`)."""


def serving_key(model: ModelSpec, serving: ServingSpec, plan: ParallelPlan) -> ServingKey:
    validate_serving(model, serving, plan)
    like = serving.step_like()
    graph = dataclasses.replace(graph_key(model, plan, like), mtp=False)  # training modules
    if serving.experts_dtype is not serving.weights_dtype:  # experts in their own format
        graph = dataclasses.replace(graph, expert_param_bytes=serving.experts_dtype.bytes)
    # a dense model's program does not depend on how experts are loaded or reached: one key
    routing, dispatch = (
        (serving.moe_routing, serving.moe_dispatch) if model.is_moe else ("balanced", "allgather")
    )
    return ServingKey(graph, serving.kv_dtype.bytes, plan.rank_order, routing, dispatch)


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
    terms = tuple(dict.fromkeys(lazy_xreplace(t, subs) for t in terms))
    return sp.Max(*terms, evaluate=False) if len(terms) > 1 else _sum(terms)


def _exchange(op, dispatch: str) -> tuple[CollKind, sp.Expr]:
    """The collective a serving pass runs for ``op`` and its bytes per GPU. The graph's
    expert-parallel all-to-alls carry ``top_k`` token-expert rows per token; engines move
    tokens instead (:data:`~stage_dse.spec.serving.MOE_DISPATCHES`): ``allgather`` gathers
    every token on every rank (the dispatch) and reduce-scatters the experts' outputs (the
    combine), ``ep / top_k`` of the graph's bytes each; ``alltoall`` sends a token once to each
    rank holding any of its experts (the rank-deduplicated share, :func:`node_dedup_share`
    over the group's ranks). With ``quantized_dispatch`` the dispatch carries
    ``expert_gemm_bytes`` per element in place of the hidden states' own (the combine stays
    16-bit)."""
    if op.coll is not CollKind.ALL_TO_ALL or MeshAxis.EP not in op.group:
        return op.coll, op.comm_bytes
    ranks = sp.Mul(*[DEGREE[axis] for axis in op.group])
    sent = [t for t in op.inputs if t.name == "moe_dispatch"]
    size = op.comm_bytes
    if sent:
        own = sent[0].dtype_bytes
        size = size * (1 + S.quantized_dispatch * (S.expert_gemm_bytes / own - 1))
    if dispatch == "allgather":
        kind = CollKind.ALL_GATHER if sent else CollKind.REDUCE_SCATTER
        return kind, size * ranks / S.top_k
    return op.coll, size * node_dedup_share(S.top_k, ranks)


def _forward(
    graph: Graph,
    order,
    measure: Measure | None = None,
    skew: float = 0.0,
    dispatch: str = "allgather",
) -> dict[str, sp.Expr]:
    ops = [op for op in graph.ops if op.phase is Phase.FORWARD]
    if measure is not None:
        measure.start(ops)
    compute, comm, mem, flops, attention, experts = [], [], [], [], [], []
    for op in ops:
        if op.is_comm:
            kind, size = _exchange(op, dispatch)
            t = collective_time(kind, op.group, size, order)
            comm.append(measure.collective(op, order, t, kind, size) if measure else t)
        elif op.kind not in (OpKind.VIEW, OpKind.COLLECTIVE):
            t = _compute_time(op, skew=skew) if measure is None else measure.compute(op)
            (attention if op.region is Region.ATTENTION_CORE else compute).append(t)
            if op.name in MOE_FUSED:
                experts.append(t)
            mem.append(op.bytes / (S.hbm_bandwidth * S.memory_efficiency))
            eff = (
                S.gemm_efficiency if op.kind is OpKind.EINSUM else S.attention_efficiency * op.speed
            )
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
        "expert_time": _sum(experts),
        "memory_time": _sum(mem),
        "compute_time": _sum(flops),
        "weights": weights,
        "kv_global": kv_global,
        "kv_local": kv_local,
        "working": working,
    }


PASSES: dict[str, dict[sp.Symbol, sp.Expr]] = {
    "prefill": {S.seq: S.prompt, S.context: S.prompt},
    "decode": {S.seq: sp.Integer(1), S.context: S.prompt + S.output_tokens / 2},
}
"""The two passes and the lengths they run at: the prompt through every layer; one token per
sequence against the cache at its mean length."""


def serving_program(key: ServingKey) -> dict[str, sp.Expr]:
    """Named serving outputs over the symbols (``serve_*``)."""
    return _program(key, False)[0]


def measured_serving_program(
    key: ServingKey,
) -> tuple[dict[str, sp.Expr], tuple[tuple[str, Kernel, sp.Symbol], ...]]:
    """:func:`serving_program` with the kernels measured tables time (linear GEMMs, prefill
    and decode attention, one-domain collectives: :class:`Measure`) as input symbols, one per
    distinct kernel of each pass, and those kernels: ``(pass, kernel, symbol)``, the kernel's
    shape and roofline over the symbols before the pass's lengths (:data:`PASSES`) are
    substituted."""
    return _program(key, True)


@lru_cache(maxsize=128)
def _program(key: ServingKey, measured: bool):
    L, pp = S.layers, S.pp
    kernels = PassKernels() if measured else None
    # layers on the fullest stage under the plan's split (stage_dse.spec.stages)
    per_stage = sp.Max(S.first_layers, S.last_layers, S.mid_layers)
    single = sp.Max(0, 2 - pp)
    out: dict[str, sp.Expr] = {}
    passes = {}
    skew, dispatch = ROUTING_SKEW[key.moe_routing], key.moe_dispatch
    for mode, subs in PASSES.items():
        graphs = build_serving_graphs(key.graph, mode, key.kv_bytes)
        measure = Measure(kernels, mode, key) if kernels is not None else None
        emb = _forward(graphs.embed, key.rank_order, measure, skew, dispatch)
        blk = _forward(graphs.block, key.rank_order, measure, skew, dispatch)
        head = _forward(graphs.head, key.rank_order, measure, skew, dispatch)
        dns = None
        if graphs.dense is not None:
            dns = _forward(graphs.dense, key.rank_order, measure, skew, dispatch)
        n_dense = dense_layers_among(L, "whole") if dns is not None else 0
        win = None
        if graphs.windowed is not None:
            win = _forward(graphs.windowed, key.rank_order, measure, skew, dispatch)
        n_win = windowed_layers_among(L, "whole") if win is not None else 0
        boundary = graphs.boundary.local_bytes
        hop = collective_time(CollKind.SEND_RECV, {MeshAxis.PP}, boundary, key.rank_order)

        def total(
            field: str, emb=emb, blk=blk, head=head, dns=dns, n_dense=n_dense, win=win, n_win=n_win
        ) -> sp.Expr:
            t = emb[field] + (L - n_dense) * blk[field] + head[field]
            if win is not None:  # what the window changes in each windowed layer
                t += n_win * (win[field] - blk[field])
            return t + (n_dense * dns[field] if dns is not None else 0)

        attention = total("attention_time")
        time = total("time")
        # an engine's FP8 prefill attention (EngineSpec); measured tables of an FP8 cache's
        # prefill attention time that kernel already
        if mode == "prefill" and not (measured and key.kv_bytes == 1):
            time = time - attention + attention / S.context_attention_speed
            attention = attention / S.context_attention_speed
        passes[mode] = {
            "time": lazy_xreplace((time + (pp - 1) * hop), subs),
            "attention_time": lazy_xreplace(attention, subs),
            "expert_time": lazy_xreplace(total("expert_time"), subs),
            "memory_time": lazy_xreplace((total("memory_time") / pp), subs),
            "compute_time": lazy_xreplace((total("compute_time") / pp), subs),
            "working": _peak(blk["working"], subs),
            "kv_global": blk["kv_global"],
            "kv_local": blk["kv_local"],
        }
        if mode == "decode":

            def layer_weights(layers: sp.Expr, where: str, blk=blk, dns=dns) -> sp.Expr:
                """Weights of a stage's dense-MLP and MoE layers (dense_layers_among)."""
                if dns is None:
                    return layers * blk["weights"]
                dense = dense_layers_among(layers, where)
                return (layers - dense) * blk["weights"] + dense * dns["weights"]

            weights_first = (
                emb["weights"] + layer_weights(S.first_layers, "first") + single * head["weights"]
            )
            weights_last = layer_weights(S.last_layers, "last") + head["weights"]
            weights_mid = layer_weights(S.mid_layers, "mid")
            out["serve_weights_bytes"] = sp.Max(weights_first, weights_last, weights_mid)
    dec, pre = passes["decode"], passes["prefill"]
    batch = S.micro_batch * S.dp
    # per token per layer, from the cache tensors: [batch, context, kv heads, head dim]
    per_token_layer = dec["kv_global"] / (batch * S.context)
    per_token_layer_gpu = dec["kv_local"] / (S.micro_batch * S.context)
    seq_len = S.prompt + S.output_tokens
    kv_per_seq_gpu = seq_len * per_token_layer_gpu * per_stage
    kv_layers = L  # layers' worth of full-length caches per sequence, the whole model
    if key.graph.sliding_window:
        # a windowed layer caches at most ``window`` positions: each stage's full-attention
        # layers hold the sequence, its windowed ones min(sequence, window)
        cached = sp.Min(seq_len, S.window) / seq_len

        def stage_kv(layers: sp.Expr, where: str) -> sp.Expr:
            n_win = windowed_layers_among(layers, where)
            return layers - n_win + n_win * cached

        per_stage = sp.Max(
            stage_kv(S.first_layers, "first"),
            stage_kv(S.last_layers, "last"),
            stage_kv(S.mid_layers, "mid"),
        )
        kv_per_seq_gpu = seq_len * per_token_layer_gpu * per_stage
        kv_layers = stage_kv(L, "whole")
    gpus = S.tp * S.pp * S.dp  # dp > 1 only as expert parallelism's attention ranks
    out["serve_ttft_s"] = pre["time"]
    out["serve_tpot_s"] = dec["time"]
    out["serve_tokens_per_s_per_gpu"] = pp * batch / dec["time"] / gpus
    out["serve_kv_bytes_per_token"] = kv_layers * per_token_layer
    out["serve_kv_cache_bytes"] = pp * S.micro_batch * kv_per_seq_gpu
    out["serve_working_bytes"] = pre["working"]
    out["serve_mem_total_bytes"] = (
        out["serve_weights_bytes"] + out["serve_kv_cache_bytes"] + out["serve_working_bytes"]
    )
    out["serve_mem_headroom_bytes"] = S.usable_memory - out["serve_mem_total_bytes"]
    free = S.usable_memory - out["serve_weights_bytes"] - out["serve_working_bytes"]
    out["serve_kv_capacity_seqs"] = sp.floor(sp.Max(0, free, evaluate=False) / kv_per_seq_gpu)
    # a decode-only replica (a disaggregated decode pool) never runs a prompt: its working set
    # is the decode pass's, not the prefill of its whole batch
    out["serve_decode_working_bytes"] = dec["working"]
    free_decode = S.usable_memory - out["serve_weights_bytes"] - dec["working"]
    out["serve_decode_kv_capacity_seqs"] = sp.floor(
        sp.Max(0, free_decode, evaluate=False) / kv_per_seq_gpu
    )
    out["serve_decode_headroom_bytes"] = free_decode - out["serve_kv_cache_bytes"]
    # the attention-core kernels of each pass (what attends over the context), the rest being
    # linear layers, norms, collectives and pipeline hops: the parts of a continuous-batching
    # step (stage_dse.cost.batching)
    out["serve_prefill_attention_s"] = pre["attention_time"]
    out["serve_decode_attention_s"] = dec["attention_time"]
    # the routed-expert block of each pass (MOE_FUSED): the work an expert-parallel step
    # shares over its attention ranks, each rank's experts serving every rank's tokens
    out["serve_prefill_expert_s"] = pre["expert_time"]
    out["serve_decode_expert_s"] = dec["expert_time"]
    out["serve_decode_memory_s"] = dec["memory_time"]
    out["serve_decode_compute_s"] = dec["compute_time"]
    out["serve_weight_read_s"] = out["serve_weights_bytes"] / S.hbm_bandwidth
    found = tuple((m, k, sym) for (m, k), sym in kernels.symbols.items()) if kernels else ()
    return out, found


@lru_cache(maxsize=64)
def _compiled(key: ServingKey):
    outputs = serving_program(key)
    names = tuple(outputs)
    fn = _lambdify_symengine(_to_symengine([], [outputs[n] for n in names]))
    return names, _wrap(fn, len(names))


TIMINGS = ("roofline", "measured")
SHARES = ("serve_ttft_measured_share", "serve_tpot_measured_share", "serve_measured_share")
"""Extra outputs of a measured evaluation: the share of TTFT, of TPOT and of a request's
end-to-end time ``TTFT + (output_tokens - 1) x TPOT`` that came from tables."""


@dataclass(frozen=True)
class ServingTiming:
    """Where a serving evaluation's kernel times come from (:func:`evaluate_serving_table`'s
    ``timing``; the strings ``"roofline"`` and ``"measured"`` stand for the defaults)."""

    source: str = "roofline"
    """``roofline``, or ``measured`` (the kernels of :class:`Measure` from measured tables
    where a table reaches, :mod:`stage_dse.kernels`)."""
    measured_gpu: Mapping[str, str | None] | None = None
    """Hardware name -> its table set (None: no tables, the roofline); a name not listed
    takes its preset's (:data:`stage_dse.kernels.tables.GPU_TABLES`)."""
    bump: float = 0.0
    """Every measured kernel's time is taken ``1 + bump`` times as long: what a measured share
    of a quantity composed outside this module (a continuous-batching step) is the relative
    derivative along."""

    def __post_init__(self) -> None:
        if self.source not in TIMINGS:
            raise ValueError(f"timing={self.source!r} is not one of: {', '.join(TIMINGS)}")

    @classmethod
    def of(cls, timing: str | ServingTiming) -> ServingTiming:
        return timing if isinstance(timing, ServingTiming) else cls(str(timing))


def evaluate_serving_table(
    table: pd.DataFrame, keys: list[ServingKey], timing: str | ServingTiming = "roofline"
) -> pd.DataFrame:
    """Serving outputs of every row; ``keys[i]`` is row i's serving key.

    ``timing="measured"`` (or a :class:`ServingTiming`) times prefill and decode GEMMs,
    prefill and decode attention and one-domain collectives from tables of measured kernels
    (:class:`Measure`), per the rows' ``hardware`` labels, the rest by the roofline; the
    outputs then include :data:`SHARES`. Every output that composes a step (TTFT, TPOT and
    their attention parts) uses the same kernel times."""
    timing = ServingTiming.of(timing)
    if len(table) == 0:
        return pd.DataFrame(index=table.index)
    x = table[list(SYMBOL_NAMES)].to_numpy(dtype=np.float64)
    gpu_of: dict[str, str | None] = {}
    hardware: list = [None] * len(table)
    if timing.source == "measured":
        from stage_dse.kernels.tables import table_set

        if "hardware" not in table:
            raise KeyError("timing=measured needs the serving table's hardware column")
        chosen = timing.measured_gpu or {}
        hardware = table["hardware"].astype(str).tolist()
        for hw in set(hardware):
            # a name the caller maps to None has no tables; an unmapped one its preset's
            gpu_of[hw] = table_set(hw, (chosen[hw] or "none") if hw in chosen else "")
    # rows by key object first (rows of one key usually share the object; hashing a key
    # hashes every field), then equal keys merged
    by_object: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        by_object.setdefault((id(k), hardware[i]), []).append(i)
    codes: dict[tuple, list[int]] = {}
    for rows in by_object.values():
        i = rows[0]
        codes.setdefault((keys[i], gpu_of.get(hardware[i])), []).extend(rows)
    parts = []
    for (k, gpu), rows in codes.items():
        if timing.source == "measured":
            names, y = _evaluate_measured(k, x[rows], gpu, timing.bump)
        else:
            names, fn = _compiled(k)
            y = fn(x[rows])
        parts.append((names, rows, y))
    names = parts[0][0]
    if all(n == names for n, _, _ in parts):  # one output layout (the common case): one array
        out = np.empty((len(table), len(names)))
        for _, rows, y in parts:
            out[rows] = y
        return pd.DataFrame(out, columns=list(names), index=table.index)
    frames = [pd.DataFrame(y, columns=list(n), index=table.index[r]) for n, r, y in parts]
    return pd.concat(frames).reindex(table.index)


@lru_cache(maxsize=64)
def _compiled_measured(key: ServingKey):
    """The measured program of one key: output names, the program over the symbols and the
    kernels' seconds, the kernels' shapes and roofline seconds over the symbols, the kernels."""
    import symengine as se

    outputs, found = measured_serving_program(key)
    names = tuple(outputs)
    kernels = tuple(k for _, k, _ in found)
    args = [se.Symbol(n) for n in SYMBOL_NAMES] + [se.Symbol(s.name) for _, _, s in found]
    fn = _lambdify_symengine(_to_symengine([], [outputs[n] for n in names]), args)
    # each pass's lengths substituted in symengine (sympy would re-evaluate the collectives'
    # piecewise conditions on the way)
    shape_exprs = []
    for mode, kernel, _ in found:
        exprs = [sp.sympify(e) for e in (*kernel.shape, kernel.roofline)]
        shape_exprs += _to_symengine(list(PASSES[mode].items()), exprs)
    shapes = _lambdify_symengine(shape_exprs)
    return names, _wrap(fn, len(names)), _wrap(shapes, len(shape_exprs)), kernels


EPS = 1e-6


def _evaluate_measured(key: ServingKey, x: np.ndarray, gpu: str | None, bump: float):
    """Rows of one key on table set ``gpu`` (None: the roofline's kernel times): outputs and
    the measured shares (:data:`SHARES`), the derivatives of TTFT, TPOT and a request's time
    along the measured kernels' times."""
    from stage_dse.kernels.tables import load_tables
    from stage_dse.kernels.timing import kernel_seconds

    names, fn, shapes, kernels = _compiled_measured(key)
    tables = load_tables(gpu) if gpu else None
    seconds, measured = kernel_seconds(kernels, shapes(x), tables)
    if bump:
        seconds = seconds * (1 + bump * measured)
    y = fn(np.hstack([x, seconds]))
    share = np.zeros((len(x), len(SHARES)))
    if measured.any():
        bumped = fn(np.hstack([x, seconds * (1 + EPS * measured)]))
        i, j = names.index("serve_ttft_s"), names.index("serve_tpot_s")
        after = x[:, SYMBOL_NAMES.index("output_tokens")] - 1
        for col, (a, b) in enumerate(
            (
                (y[:, i], bumped[:, i]),
                (y[:, j], bumped[:, j]),
                (y[:, i] + after * y[:, j], bumped[:, i] + after * bumped[:, j]),
            )
        ):
            share[:, col] = np.clip((b - a) / (EPS * a), 0.0, 1.0)
    return (*names, *SHARES), np.hstack([y, share])
