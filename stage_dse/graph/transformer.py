"""Builders of dense transformer training graphs: embedding, one block, and the output head.

What lives here: the Megatron-LM layouts of each tensor (column/row-parallel linears, head-split
attention, vocab-parallel embedding and loss, sequence-parallel norm regions, context-parallel
sequence split, ZeRO-3 parameter sharding). Collectives are not written here: they follow from
these layouts through :class:`stage_dse.graph.core.Graph`.

A model is three graphs, each built once with symbolic sizes: ``embed`` (first pipeline stage),
``block`` (one layer, repeated ``layers / pp`` times per stage) and ``head`` (last stage: final
norm, output projection, cross-entropy). Their structure depends only on the structural choices
in :class:`GraphKey`; every size is a symbol.
"""

from __future__ import annotations

from functools import lru_cache

import sympy as sp

from stage_dse.graph.core import Graph
from stage_dse.graph.dims import DIMS, GraphKey, graph_key
from stage_dse.graph.eager import run_eagerly
from stage_dse.graph.ir import (
    ADD,
    DROPOUT,
    FLASH_TRITON_SPEED,
    GELU,
    LAYERNORM,
    RMSNORM,
    ROPE,
    SOFTMAX,
    SWIGLU,
    Axis,
    Module,
    OpKind,
    Region,
    Role,
    Scope,
    Tensor,
)
from stage_dse.graph.latent import LatentAttention
from stage_dse.graph.sections import ModelGraphs
from stage_dse.graph.symbols import S
from stage_dse.spec import (
    AttentionKernel,
    MeshAxis,
    MlpKind,
    ModelSpec,
    NormKind,
    ParallelPlan,
    PositionKind,
    TrainingSpec,
)

__all__ = ["DIMS", "GraphKey", "ModelGraphs", "build_graphs", "graph_key"]

DP, TP, CP, EP = MeshAxis.DP, MeshAxis.TP, MeshAxis.CP, MeshAxis.EP
DS, DR = MeshAxis.DS, MeshAxis.DR
DATA_AXES = (DP, EP, CP)
"""Axes over which dense gradients are reduced and ZeRO shards states (Megatron: dp x cp)."""
EXPERT_DATA_AXES = (DP, CP)
"""Expert weights are split over EP already: their replicas live on the DP (and CP) axes."""
BATCH = (DP, EP)
"""The batch is split over every data-parallel rank (EP is a factor of the data-parallel size).
Under hybrid sharding DS takes DP's place in these and the batch is split over DR too, where
the states' replicas live (:meth:`_Builder.hybrid`)."""


class _Builder(LatentAttention):
    def __init__(self, key: GraphKey, serving: str | None = None, kv_bytes: int = 2) -> None:
        self.k = key
        self.g = Graph(grad_bytes=key.grad_bytes)
        self.pb = sp.Rational(key.param_bytes)  # 9/16 for NVFP4: exact, scales included
        self.epb = sp.Rational(key.expert_param_bytes) if key.expert_param_bytes else self.pb
        # activations between kernels: the weights' format down to 8 bits; under 4-bit weights
        # 16-bit (only the linear GEMMs' inputs are quantized, stage_dse.cost.time)
        self.ab = self.pb if self.pb >= 1 else sp.Integer(2)
        self.serving = serving
        """None (training), "prefill" or "decode": forward only, attention over a KV cache."""
        self.kv_bytes = kv_bytes

    def fused(self, width) -> sp.Expr:
        """``Op.fused_width`` of a projection that runs inside a GEMM ``width`` times its own
        output features when the framework fuses projections (``GraphKey.fused_projections``),
        else 1."""
        return sp.sympify(width) if self.k.fused_projections else sp.Integer(1)

    def hybrid(self, axes: tuple[MeshAxis, ...]) -> tuple[MeshAxis, ...]:
        """``axes`` under this plan's sharding: as they are, or with hybrid sharding's
        sharding group (DS) in DP's place."""
        return tuple(DS if m is DP else m for m in axes) if self.k.hybrid_shard else axes

    @property
    def batch(self) -> tuple[MeshAxis, ...]:
        """The mesh axes the batch is split over: every data-parallel rank."""
        return (*self.hybrid(BATCH), DR) if self.k.hybrid_shard else BATCH

    # layouts of [b, s, h] activations
    @property
    def act(self) -> tuple[tuple[MeshAxis, ...], ...]:
        seq = (CP, TP) if self.k.sequence_parallel else (CP,)
        return (self.batch, seq, ())

    @property
    def full(self) -> tuple[tuple[MeshAxis, ...], ...]:
        return (self.batch, (CP,), ())

    def w(self, name: str, axes, layout, states_over=DATA_AXES, dtype_bytes=None) -> Tensor:
        """A parameter whose ZeRO states (and FSDP shards) are split over ``states_over``."""
        return self.g.weight(
            name,
            axes,
            layout,
            self.pb if dtype_bytes is None else dtype_bytes,
            shard_states_over=self.hybrid(states_over),
            fsdp=self.k.zero_stage == 3,
        )

    def dense_mlp(self, ln2: Tensor, ffn: Axis, prefix: str = "", reduce: bool = True) -> Tensor:
        """Column- then row-parallel MLP; returns the output in the activation layout, or
        (``reduce=False``) the second linear's pending tensor-parallel partial sum."""
        g = self.g
        Bt, Sq, H = DIMS.batch, DIMS.seq, DIMS.hidden
        ln2g = g.redistribute(ln2, self.full)
        if self.k.mlp is MlpKind.GELU:
            h1 = g.einsum(
                f"{prefix}fc1",
                ln2g,
                self.w(f"{prefix}fc1.weight", [H, ffn], [(), (TP,)]),
                [Bt, Sq, ffn],
            )
            h1 = self.maybe_bias(f"{prefix}fc1", h1, [ffn], [(TP,)])
            act = g.pointwise(GELU, f"{prefix}gelu", h1)
        else:
            pair = self.fused(2)  # gate and up projections as one GEMM
            gate = g.einsum(
                f"{prefix}gate_proj",
                ln2g,
                self.w(f"{prefix}gate_proj.weight", [H, ffn], [(), (TP,)]),
                [Bt, Sq, ffn],
                fused_width=pair,
            )
            up = g.einsum(
                f"{prefix}up_proj",
                ln2g,
                self.w(f"{prefix}up_proj.weight", [H, ffn], [(), (TP,)]),
                [Bt, Sq, ffn],
                fused_width=pair,
            )
            act = g.pointwise(SWIGLU, f"{prefix}swiglu", gate, up)
        h2 = g.einsum(
            f"{prefix}fc2", act, self.w(f"{prefix}fc2.weight", [ffn, H], [(TP,), ()]), [Bt, Sq, H]
        )
        if not reduce:
            return h2
        h2 = g.redistribute(h2, self.act)
        return self.maybe_bias(f"{prefix}fc2", h2, [H], [()])

    def moe_mlp(self, ln2: Tensor) -> Tensor:
        """Router, top-k dispatch, all-to-all over EP, grouped SwiGLU experts, all-to-all back,
        weighted combine; plus shared experts. Routing is taken as balanced, each expert
        receiving ``capacity_factor`` x its even share of the ``top_k`` x tokens."""
        g = self.g
        Bt, Sq, H = DIMS.batch, DIMS.seq, DIMS.hidden
        E, C, Fe = DIMS.experts, DIMS.capacity, DIMS.moe_ffn
        logits = g.einsum("router", ln2, self.w("router.weight", [H, E], [(), ()]), [Bt, Sq, E])
        probs = g.pointwise(SOFTMAX, "router_softmax", logits)
        g.enter_module(Module.EXPERTS)
        origin = tuple(m for ms in ln2.layout for m in ms)  # the tokens' ranks
        # experts over EP, or over EP x TP when the expert group spans the tensor-parallel
        # ranks (each holds other experts; the tokens are split over TP by sequence parallelism),
        # and x CP when it spans the context-parallel ranks (their replicas then on DP only)
        expert_ranks = (EP, TP) if self.k.ep_over_tp else (EP,)
        if self.k.ep_over_cp:
            expert_ranks = (*expert_ranks, CP)
        slots = tuple(m for m in origin if m not in expert_ranks)
        x_d = g.permute("moe_dispatch", ln2, [E, C, H], [(), origin, ()])
        x_e = g.redistribute(x_d, [expert_ranks, slots, ()])  # all-to-all over EP (x TP)
        etp = self.k.expert_tensor_parallel
        if etp:  # experts split over TP: gather the TP group's tokens
            x_e = g.redistribute(x_e, [expert_ranks, tuple(m for m in slots if m is not TP), ()])
        f_split = (TP,) if etp else ()
        on = tuple(a for a in EXPERT_DATA_AXES if a not in expert_ranks)
        eb = self.epb
        w1 = self.w("experts.gate_proj.weight", [E, H, Fe], [expert_ranks, (), f_split], on, eb)
        w3 = self.w("experts.up_proj.weight", [E, H, Fe], [expert_ranks, (), f_split], on, eb)
        w2 = self.w("experts.down_proj.weight", [E, Fe, H], [expert_ranks, f_split, ()], on, eb)
        pair = self.fused(2)
        gate = g.einsum("experts.gate_proj", x_e, w1, [E, C, Fe], fused_width=pair)
        up = g.einsum("experts.up_proj", x_e, w3, [E, C, Fe], fused_width=pair)
        act = g.pointwise(SWIGLU, "experts.swiglu", gate, up)
        y_e = g.einsum("experts.down_proj", act, w2, [E, C, H])
        y_e = g.redistribute(y_e, [expert_ranks, slots, ()])  # reduce-scatter over TP (ETP)
        y_d = g.redistribute(y_e, [(), origin, ()])  # all-to-all back over EP (x TP)
        # weighted SwiGLU (moe_weighted_activation): the combine keeps no expert outputs
        kw = dict(weights=probs, flops_per_elem=2, keep_rows=not self.k.moe_weighted_activation)
        y = g.permute("moe_combine", y_d, [Bt, Sq, H], ln2.layout, **kw)
        if self.k.shared_experts:  # static shapes: captured with the router (Megatron-Core)
            g.enter_module(Module.ROUTER)
            shared = self.dense_mlp(ln2, DIMS.shared_ffn, prefix="shared_experts.")
            g.enter_module(Module.EXPERTS)
            y = g.pointwise(ADD, "moe_shared_sum", y, shared)
        return y

    def norm(self, name: str, x: Tensor) -> Tensor:
        H = x.axes[-1]  # the normalized (last) axis: hidden, or a latent rank under MLA
        gamma = self.w(f"{name}.weight", [H], [()])
        if self.k.norm is NormKind.LAYERNORM:
            beta = self.w(f"{name}.bias", [H], [()])
            return self.g.norm(LAYERNORM, name, x, gamma, beta)
        return self.g.norm(RMSNORM, name, x, gamma)

    def maybe_bias(self, name: str, x: Tensor, axes, layout) -> Tensor:
        if not self.k.bias:
            return x
        return self.g.bias(f"{name}+bias", x, self.w(f"{name}.bias", axes, layout))

    def dropout(self, name: str, x: Tensor) -> Tensor:
        return self.g.pointwise(DROPOUT, name, x) if self.k.dropout else x

    def attention_core(
        self, q, k, v, Tk: Axis, heads: list, dv: Axis, *, causal, window=None, chunk=None
    ) -> Tensor:
        """Scores, softmax and context over the key axis ``Tk``: one fused kernel, or as eager
        code runs it, the scores and probabilities materialized (``heads``: the query's head
        axes, ``dv``: the value width)."""
        g, Bt, Sq = self.g, DIMS.batch, DIMS.seq
        with g.region(Region.ATTENTION_CORE):
            if self.k.attention.fused:
                ctx_axes, stats = [Bt, Sq, *heads, dv], [Bt, *heads, Sq]
                return g.attention("core_attention", q, k, v, Sq, Tk, ctx_axes, stats,
                                   causal=causal, window=window, chunk=chunk)  # fmt: skip
            scores = g.einsum("scores", q, k, [Bt, *heads, Sq, Tk])
            probs = g.pointwise(SOFTMAX, "softmax", scores)
            probs = self.dropout("attention_dropout", probs)
            return g.einsum("context", probs, v, [Bt, Sq, *heads, dv])

    def activation(self, name: str, axes, layout) -> Tensor:
        return self.g.tensor(name, Role.ACTIVATION, axes, layout, self.ab)

    # ---------------------------------------------------------------- sections
    def block(self, dense: bool = False, windowed: bool = False) -> Graph:
        """One layer: dense MLP or MoE, full or sliding-window attention (``windowed``: the
        fused kernel skips the tiles outside the band, :func:`stage_dse.graph.forward.
        banded_fraction`; an unfused one computes every score and masks them, as eager
        implementations do; in decode the layer caches and reads at most ``window``
        positions; chunked attention: within each query's chunk of ``window``, the whole
        context cached, in decode the current chunk read in place). Attention sinks (gpt-oss:
        one learned logit per head in the softmax) are ``heads`` parameters: not modelled."""
        g = self.g
        Bt, Sq, Tk, H = DIMS.batch, DIMS.seq, DIMS.kseq, DIMS.hidden
        G, R, D = DIMS.groups, DIMS.rep, DIMS.head_dim
        with g.scope(Scope.BLOCK):
            x = self.activation("layer_input", [Bt, Sq, H], self.act)
            g.block_input = x
            g.enter_module(Module.ATTN)
            ln1 = self.norm("input_norm", x)
            ln1g = g.redistribute(ln1, self.full)
            if self.k.mla:
                out = self.latent_attention(ln1g)
            else:
                # one GEMM of R + 2 heads' width per key/value head: q's R, k's and v's one each
                qkv = R.extent + 2
                q = g.einsum(
                    "q_proj",
                    ln1g,
                    self.w("q_proj.weight", [H, G, R, D], [(), (TP,), (), ()]),
                    [Bt, Sq, G, R, D],
                    fused_width=self.fused(qkv / R.extent),
                )
                # keys/values are indexed by the key-side sequence axis t (same extent as s)
                wk = self.w("k_proj.weight", [H, G, D], [(), (TP,), ()])
                wv = self.w("v_proj.weight", [H, G, D], [(), (TP,), ()])
                kv_axis = Sq if self.serving == "decode" else Tk
                ln1t = g.view(ln1g, [Bt, kv_axis, H]) if kv_axis is not Sq else ln1g
                k = g.einsum("k_proj", ln1t, wk, [Bt, kv_axis, G, D], fused_width=self.fused(qkv))
                v = g.einsum("v_proj", ln1t, wv, [Bt, kv_axis, G, D], fused_width=self.fused(qkv))
                q = self.maybe_bias("q_proj", q, [G, R, D], [(TP,), (), ()])
                k = self.maybe_bias("k_proj", k, [G, D], [(TP,), ()])
                v = self.maybe_bias("v_proj", v, [G, D], [(TP,), ()])
                if self.k.position is PositionKind.ROPE:
                    q = g.pointwise(ROPE, "q_rope", q)
                    k = g.pointwise(ROPE, "k_rope", k)
                chunked = windowed and self.k.chunked_attention
                band = S.window if windowed and not chunked else None  # a sliding window
                chunk = S.window if chunked else None
                if self.serving:
                    Tk = DIMS.context
                    if windowed and self.serving == "decode" and not chunked:
                        Tk, band = DIMS.window_context, None
                    k, v = self.kv_cache(k, v, Tk)
                    if chunked and self.serving == "decode":  # the current chunk, in place
                        Tk, chunk = DIMS.chunk_context, None
                        k = g.select("k_chunk", k, [Bt, Tk, G, D], Role.ACTIVATION)
                        v = g.select("v_chunk", v, [Bt, Tk, G, D], Role.ACTIVATION)
                causal = self.serving != "decode"
                ctx = self.attention_core(q, k, v, Tk, [G, R], D, causal=causal, window=band,
                                          chunk=chunk)  # fmt: skip
                wo = self.w("o_proj.weight", [G, R, D, H], [(TP,), (), (), ()])
                out = g.einsum("o_proj", ctx, wo, [Bt, Sq, H])
            if self.k.parallel_block:
                y = self.parallel_mlp(x, ln1g, out)
            else:
                y = self.sequential_mlp(x, out, dense)
            g.enter_module(Module.OTHER)
            if not self.serving:
                g.derive_backward(seed=y)
                self._step()
        return g

    def sequential_mlp(self, x: Tensor, out: Tensor, dense: bool) -> Tensor:
        """The attention output (a pending partial sum) joins the residual, and the MLP or MoE
        reads a norm of that sum; returns the layer's output."""
        g, H = self.g, DIMS.hidden
        out = g.redistribute(out, self.act)
        out = self.maybe_bias("o_proj", out, [H], [()])
        out = self.dropout("o_dropout", out)
        x2 = g.pointwise(ADD, "attention_residual", x, out)
        moe = self.k.moe and not dense
        g.enter_module(Module.ROUTER if moe else Module.MLP)
        ln2 = self.norm("post_attention_norm", x2)
        h2 = self.moe_mlp(ln2) if moe else self.dense_mlp(ln2, DIMS.ffn)
        h2 = self.dropout("mlp_dropout", h2)
        return g.pointwise(ADD, "mlp_residual", x2, h2)

    def parallel_mlp(self, x: Tensor, ln1g: Tensor, out: Tensor) -> Tensor:
        """The parallel block: the MLP reads the attention's (gathered) norm; training adds
        the two branches' partial sums and reduces them once (GPT-NeoX ``gpt_j_residual``,
        MegaScale), serving reduces each branch first (vLLM, TensorRT-LLM); returns the
        layer's output."""
        g, H = self.g, DIMS.hidden
        fuse = not self.serving
        if not fuse:
            out = self.maybe_bias("o_proj", g.redistribute(out, self.act), [H], [()])
        g.enter_module(Module.MLP)
        h2 = self.dense_mlp(ln1g, DIMS.ffn, reduce=not fuse)
        both = g.pointwise(ADD, "branch_sum", out, h2)  # in training, two partial sums add
        if fuse:
            both = g.redistribute(both, self.act)
            both = self.maybe_bias("o_proj", both, [H], [()])
            both = self.maybe_bias("fc2", both, [H], [()])
        both = self.dropout("mlp_dropout", both)
        return g.pointwise(ADD, "residual", x, both)

    def kv_cache(self, k: Tensor, v: Tensor, T: Axis = DIMS.context) -> tuple[Tensor, Tensor]:
        """Serving: write the new keys/values into the cache; attention reads the whole cache
        (``T``: ``context`` positions, at most the window in a windowed layer's decode). In
        prefill the new keys are the context itself."""
        g = self.g
        Bt, G, D = DIMS.batch, DIMS.groups, DIMS.head_dim
        layout = [k.layout[0], (), k.layout[2], ()]
        caches = []
        for name, new in (("k_cache", k), ("v_cache", v)):
            cache = g.tensor(name, Role.KV_CACHE, [Bt, T, G, D], layout, self.kv_bytes)
            g.permute(f"{name}_write", new, new.axes, new.layout)
            caches.append(cache)
        return caches[0], caches[1]

    def embed(self) -> tuple[Graph, Tensor]:
        g = self.g
        Bt, Sq, H, V, P = DIMS.batch, DIMS.seq, DIMS.hidden, DIMS.vocab, DIMS.positions
        with g.scope(Scope.EMBED):
            ids = g.tensor("token_ids", Role.INPUT, [Bt, Sq], [self.batch, (CP,)], 8)
            table = self.w("word_embeddings", [V, H], [(TP,), ()])
            x = g.embedding("word_embedding", ids, table, V, [Bt, Sq, H], self.ab)
            x = g.redistribute(x, self.act)
            if self.k.position is PositionKind.LEARNED:
                pos_ids = g.tensor("position_ids", Role.INPUT, [Bt, Sq], [self.batch, (CP,)], 8)
                pos_table = self.w("position_embeddings", [P, H], [(), ()])
                pos = g.embedding("position_embedding", pos_ids, pos_table, P, [Bt, Sq, H], self.ab)
                pos = g.redistribute(pos, self.act)
                x = g.pointwise(ADD, "embedding_sum", x, pos)
            y = self.dropout("embedding_dropout", x)
            if not self.serving:
                g.derive_backward(seed=y)
                self._step()
        return g, y

    def head(self) -> tuple[Graph, Tensor | None]:
        g = self.g
        Bt, Sq, H, V = DIMS.batch, DIMS.seq, DIMS.hidden, DIMS.vocab
        with g.scope(Scope.HEAD):
            x = self.activation("final_input", [Bt, Sq, H], self.act)
            g.block_input = x
            ln = self.norm("final_norm", x)
            lng = g.redistribute(ln, self.full)
            tied = self.k.tied_embeddings
            w = self.w("word_embeddings" if tied else "output.weight", [V, H], [(TP,), ()])
            if self.serving:  # logits of the last position only, then sampling
                last = g.permute("last_position", lng, [Bt, DIMS.last, H], [lng.layout[0], (), ()])
                logits = g.einsum("logits", last, w, [Bt, DIMS.last, V])
                logits = g.redistribute(logits, [logits.layout[0], (), ()])
                g.pointwise(SOFTMAX, "sampling", logits)
                return g, None
            logits = g.einsum("logits", lng, w, [Bt, Sq, V])
            g.cross_entropy("loss", logits, V, [Bt, Sq])
            g.derive_backward()
            self._step()
        stored = g.weight_storage.get(w, w)
        return g, (stored if tied else None)

    def _step(self) -> None:
        self.g.sync_and_step(
            self.k.zero_stage,
            self.hybrid(DATA_AXES),
            param_bytes=self.k.param_bytes,
            grad_bytes=self.k.grad_bytes,
            optimizer_bytes_per_param=self.k.optimizer_bytes_per_param,
            grad_sync_per_step=self.k.grad_sync_per_step,
        )


def _assemble(key: GraphKey, mode: str | None, kv_bytes: int = 2) -> ModelGraphs:
    embed, _ = _Builder(key, mode, kv_bytes).embed()
    block = _Builder(key, mode, kv_bytes).block()
    dense = None
    if key.moe and key.dense_layers:
        dense = _Builder(key, mode, kv_bytes).block(dense=True)
    windowed = None
    if key.sliding_window or key.chunked_attention:
        windowed = _Builder(key, mode, kv_bytes).block(windowed=True)
    head, tied = _Builder(key, mode, kv_bytes).head()
    assert block.block_input is not None
    for g in (embed, block, head, dense, windowed):
        if g is None:
            continue
        if not key.fused_elementwise:
            run_eagerly(g)
        elif not key.fused_activation:
            run_eagerly(g, kinds=("swiglu",))
        if key.attention is AttentionKernel.FLASH_TRITON:
            for op in g.ops:
                if op.kind is OpKind.ATTENTION:
                    op.speed = FLASH_TRITON_SPEED
    return ModelGraphs(
        key=key,
        embed=embed,
        block=block,
        head=head,
        boundary=block.block_input,
        tied_head_weight=tied,
        dense=dense,
        windowed=windowed,
    )


@lru_cache(maxsize=256)
def _build(key: GraphKey) -> ModelGraphs:
    return _assemble(key, None)


@lru_cache(maxsize=64)
def build_serving_graphs(key: GraphKey, mode: str, kv_bytes: int) -> ModelGraphs:
    """Forward-only graphs of one serving pass (``mode``: "prefill" or "decode")."""
    return _assemble(key, mode, kv_bytes)


def build_graphs(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> ModelGraphs:
    """The embed/block/head graphs for this model family and plan structure (cached)."""
    return _build(graph_key(model, plan, training))
