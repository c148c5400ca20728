"""Builders of multi-head latent attention (DeepSeek-V2/V3): the compressed query and joint
key/value projections, their rotary parts, the cached latent, DeepSeek Sparse Attention's
lightning indexer, and decode attention absorbed into the latent space. A part of the layer
builder (:class:`stage_dse.graph.transformer._Builder`), which supplies the weights, norms,
layouts and the graph being recorded."""

from __future__ import annotations

from stage_dse.graph.dims import DIMS
from stage_dse.graph.ir import ROPE, SOFTMAX, Region, Role, Tensor
from stage_dse.graph.symbols import S
from stage_dse.spec import MeshAxis

TP = MeshAxis.TP


class LatentAttention:
    """The latent-attention methods of the layer builder."""

    def latent_attention(self, ln1g: Tensor) -> Tensor:
        """Multi-head latent attention (DeepSeek-V2 sec. 2.1), by its projection shapes:
        queries through a rank-``q_lora`` bottleneck, keys and values from a shared
        rank-``kv_lora`` latent, a rotary key part shared by the heads; heads split over TP,
        the down-projections replicated. The rotary key is copied into every head's key (the
        fused kernels' layout), so its gradient, summed over each rank's heads, is all-reduced
        over the tensor-parallel group (b*s*rope_dim elements per layer). Returns the o_proj
        output, partial over TP."""
        g = self.g
        Bt, Sq, Tk, H = DIMS.batch, DIMS.seq, DIMS.kseq, DIMS.hidden
        A, QL, KL = DIMS.heads, DIMS.q_lora, DIMS.kv_lora
        Dq, Dn, Dv = DIMS.qk_dim, DIMS.nope_dim, DIMS.v_dim
        cq = g.einsum("q_a_proj", ln1g, self.w("q_a_proj.weight", [H, QL], [(), ()]), [Bt, Sq, QL])
        cq = self.norm("q_a_norm", cq)
        sparse = bool(self.serving) and self.k.sparse_attention
        if sparse:
            self.indexer(ln1g, cq)
        if self.serving == "decode":
            return self.latent_attention_decode(ln1g, cq)
        q = g.einsum(
            "q_b_proj", cq, self.w("q_b_proj.weight", [QL, A, Dq], [(), (TP,), ()]), [Bt, Sq, A, Dq]
        )
        q = g.pointwise(ROPE, "q_rope", q)
        ckv, kr = self.latent_kv(g.view(ln1g, [Bt, Tk, H]))
        if self.serving:  # prefill: attention runs decompressed, the cache keeps the latent
            self.latent_cache(ckv, kr)
        kn = g.einsum(
            "k_b_proj",
            ckv,
            self.w("k_b_proj.weight", [KL, A, Dn], [(), (TP,), ()]),
            [Bt, Tk, A, Dn],
        )
        v = g.einsum(
            "v_b_proj",
            ckv,
            self.w("v_b_proj.weight", [KL, A, Dv], [(), (TP,), ()]),
            [Bt, Tk, A, Dv],
        )
        k = g.permute("k_concat", kn, [Bt, Tk, A, Dq], [*kn.layout[:3], ()], weights=kr)
        window = S.topk_tokens if sparse else None
        ctx = self.attention_core(q, k, v, Tk, [A], Dv, causal=True, window=window)
        wo = self.w("o_proj.weight", [A, Dv, H], [(TP,), (), ()])
        return g.einsum("o_proj", ctx, wo, [Bt, Sq, H])

    def indexer(self, ln1g: Tensor, cq: Tensor) -> Tensor:
        """DeepSeek Sparse Attention's lightning indexer (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp:
        Boosting Long-Context Efficiency with DeepSeek Sparse Attention", sec. 2.1): index
        scores ``I(t, s) = sum_j w_tj ReLU(q_tj . k_s)`` of every query against every cached
        key, over ``index_heads`` heads of ``index_dim``; queries from the query latent, head
        weights from the hidden state, one key per token cached in FP8 (1 byte a value; its
        per-token scale left out). Replicated on every tensor-parallel rank (vLLM's
        ``ReplicatedLinear``). The scores are one fused attention-class kernel (DeepGEMM's
        MQA-logits kernels) over the causal pairs in prefill and the whole cache in decode,
        timed like attention (its FP8 rate, twice the 16-bit one, is not taken); the ReLU,
        the head weighting and the top-k selection after it are not costed."""
        g = self.g
        Bt, Sq, H, QL = DIMS.batch, DIMS.seq, DIMS.hidden, DIMS.q_lora
        IH, ID, T = DIMS.index_heads, DIMS.index_dim, DIMS.context
        keys_of = ln1g if self.serving == "decode" else g.view(ln1g, [Bt, DIMS.kseq, H])
        q = g.einsum(
            "indexer.wq_b", cq, self.w("indexer.wq_b.weight", [QL, IH, ID], [(), (), ()]),
            [Bt, Sq, IH, ID],
        )  # fmt: skip
        k = g.einsum(
            "indexer.wk", keys_of, self.w("indexer.wk.weight", [H, ID], [(), ()]),
            [Bt, keys_of.axes[1], ID],
        )  # fmt: skip
        k = self.norm("indexer.k_norm", k)
        g.einsum(
            "indexer.weights_proj", ln1g,
            self.w("indexer.weights_proj.weight", [H, IH], [(), ()]), [Bt, Sq, IH],
        )  # fmt: skip
        cache = g.tensor("index_key_cache", Role.KV_CACHE, [Bt, T, ID], [k.layout[0], (), ()], 1)
        g.permute("index_key_cache_write", k, k.axes, k.layout)
        with g.region(Region.ATTENTION_CORE):
            return g.index_scores(
                "indexer.scores", q, cache, [Bt, Sq, T], causal=self.serving != "decode"
            )

    def latent_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """MLA's shared key/value side of ``x`` ([batch, positions, hidden], whole on every
        tensor-parallel rank): the normalized kv latent and the rotary key."""
        g = self.g
        Bt, T, H = x.axes
        KL, R = DIMS.kv_lora, DIMS.rope
        ckv = g.einsum("kv_a_proj", x, self.w("kv_a_proj.weight", [H, KL], [(), ()]), [Bt, T, KL])
        kr = g.einsum("k_rope_proj", x, self.w("k_rope_proj.weight", [H, R], [(), ()]), [Bt, T, R])
        kr = g.pointwise(ROPE, "k_rope", kr)
        return self.norm("kv_a_norm", ckv), kr

    def latent_cache(self, ckv: Tensor, kr: Tensor) -> Tensor:
        """Serving MLA: write the new positions' kv latent and rotary key into the cache, one
        ``kv_lora + rope_dim`` vector per position shared by every head, so each
        tensor-parallel rank holds the whole cache of its sequences (DeepSeek-V2 sec. 2.1.2:
        ``(d_c + d_h^R) x layers`` elements per token)."""
        g = self.g
        layout = [ckv.layout[0], (), ()]
        cache = g.tensor(
            "latent_cache",
            Role.KV_CACHE,
            [DIMS.batch, DIMS.context, DIMS.latent_cache],
            layout,
            self.kv_bytes,
        )
        g.permute("latent_cache_write", ckv, ckv.axes, ckv.layout, weights=kr)
        return cache

    def latent_attention_decode(self, ln1g: Tensor, cq: Tensor) -> Tensor:
        """MLA decode with absorbed up-projections (DeepSeek-V2 sec. 2.1.2; the kernels of
        FlashMLA, vLLM and SGLang): the key up-projection folds into the query
        (``q_absorb``), attention runs over the cached latents themselves, the value
        up-projection applies to its output (``v_absorb``); the latent is read once, as keys
        and, its first ``kv_lora`` entries, as values."""
        g = self.g
        Bt, Sq, H = DIMS.batch, DIMS.seq, DIMS.hidden
        A, QL, KL, R = DIMS.heads, DIMS.q_lora, DIMS.kv_lora, DIMS.rope
        Dn, Dv, KC, T = DIMS.nope_dim, DIMS.v_dim, DIMS.latent_cache, DIMS.context
        heads = [(), (TP,), ()]
        # q_b_proj's nope and rotary columns (the same weights as one [q_lora, heads, dq])
        q_nope = g.einsum(
            "q_b_proj", cq, self.w("q_b_proj.weight", [QL, A, Dn], heads), [Bt, Sq, A, Dn]
        )
        q_rope = g.einsum(
            "q_b_proj.rope", cq, self.w("q_b_proj.rope_weight", [QL, A, R], heads), [Bt, Sq, A, R]
        )
        q_rope = g.pointwise(ROPE, "q_rope", q_rope)
        cache = self.latent_cache(*self.latent_kv(ln1g))
        if self.k.sparse_attention:  # the top-k positions the indexer chose, read in place
            T = DIMS.selected
            cache = g.select("latent_selected", cache, [Bt, T, KC], Role.ACTIVATION)
        wk = self.w("k_b_proj.weight", [KL, A, Dn], heads)
        q_lat = g.einsum("q_absorb", q_nope, wk, [Bt, Sq, A, KL])
        q = g.permute("q_concat", q_lat, [Bt, Sq, A, KC], q_lat.layout, weights=q_rope)
        with g.region(Region.ATTENTION_CORE):
            if self.k.attention.fused:
                # values are the latent part of the cached vectors, read once with the keys
                values = g.tensor("latent_values", Role.ACTIVATION, [Bt, T, KL], cache.layout, 0)
                ctx = g.attention(
                    "core_attention", q, cache, values, Sq, T, [Bt, Sq, A, KL], [Bt, A, Sq]
                )
            else:  # unfused: the probabilities meet the cache a second time
                values = g.tensor(
                    "latent_values", Role.ACTIVATION, [Bt, T, KL], cache.layout, self.kv_bytes
                )
                scores = g.einsum("scores", q, cache, [Bt, A, Sq, T])
                probs = g.pointwise(SOFTMAX, "softmax", scores)
                ctx = g.einsum("context", probs, values, [Bt, Sq, A, KL])
        wv = self.w("v_b_proj.weight", [KL, A, Dv], heads)
        out = g.einsum("v_absorb", ctx, wv, [Bt, Sq, A, Dv])
        wo = self.w("o_proj.weight", [A, Dv, H], [(TP,), (), ()])
        return g.einsum("o_proj", out, wo, [Bt, Sq, H])
