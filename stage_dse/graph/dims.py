"""The symbolic dimensions of the transformer graphs (:class:`DIMS`); every size is a symbol.
The structural key that selects a graph (:class:`GraphKey`, :func:`graph_key`) lives in
:mod:`stage_dse.graph.key`, which needs no sympy."""

from __future__ import annotations

import sympy as sp

from stage_dse.graph.ir import Axis
from stage_dse.graph.key import GraphKey, graph_key
from stage_dse.graph.symbols import S

__all__ = ["DIMS", "GraphKey", "chunked_decode_keys", "chunked_keys", "graph_key"]


def chunked_keys(positions: sp.Expr, chunk: sp.Expr) -> sp.Expr:
    """Keys the queries at positions ``0 .. x - 1`` of a chunked-attention layer read
    together, each its aligned chunk up to itself (``p mod chunk + 1``): ``n chunk (chunk +
    1) / 2 + r (r + 1) / 2`` with ``n = floor(x / chunk)`` whole chunks and ``r`` positions
    into the last (``x (x + 1) / 2``, causal, while ``x <= chunk``)."""
    n = sp.floor(positions / chunk)
    r = positions - n * chunk
    return n * chunk * (chunk + 1) / 2 + r * (r + 1) / 2


def chunked_decode_keys(prompt: sp.Expr, output: sp.Expr, chunk: sp.Expr) -> sp.Expr:
    """Keys a decode step of a chunked-attention layer reads, the mean over the request's
    output positions ``prompt .. prompt + output - 1``: the chunk's positions so far, so a
    decode that stays in one chunk reads its offset into it and one that runs through many
    chunks half a chunk on average."""
    return (chunked_keys(prompt + output, chunk) - chunked_keys(prompt, chunk)) / output


class DIMS:
    """Tensor axes with their global extents."""

    batch = Axis("b", S.micro_batch * S.dp)
    seq = Axis("s", S.seq)
    kseq = Axis("t", S.seq)
    hidden = Axis("h", S.hidden)
    ffn = Axis("f", S.ffn)
    groups = Axis("g", S.kv_heads)
    rep = Axis("r", S.heads / S.kv_heads)
    head_dim = Axis("d", S.head_dim)
    vocab = Axis("v", S.vocab)
    positions = Axis("p", S.positions)
    context = Axis("t", S.context)
    """Serving: the key side of attention spans the context (cache) length."""
    selected = Axis("t", sp.Min(S.context, S.topk_tokens))
    """Serving under DeepSeek Sparse Attention, decode: the cached positions a query reads."""
    index_heads = Axis("ih", S.index_heads)
    index_dim = Axis("id", S.index_dim)
    window_context = Axis("t", sp.Min(S.context, S.window))
    """Serving, a sliding-window layer in decode: the positions it caches and attends to."""
    chunk_context = Axis(
        "t", sp.Min(S.context, chunked_decode_keys(S.prompt, S.output_tokens, S.window))
    )
    """Serving, a chunked-attention layer in decode (``window``: the chunk): the cached
    positions it reads, those of its current chunk (:func:`chunked_decode_keys`)."""
    last = Axis("one", sp.Integer(1))
    """Serving: the one position whose logits are computed."""
    experts = Axis("e", S.experts)
    capacity = Axis("c", S.capacity_factor * S.top_k * S.micro_batch * S.dp * S.seq / S.experts)
    """Token slots per expert per micro-batch over the whole mesh: capacity x balanced share."""
    moe_ffn = Axis("fe", S.moe_ffn)
    heads = Axis("a", S.heads)
    q_lora = Axis("ql", S.q_lora)
    kv_lora = Axis("kl", S.kv_lora)
    rope = Axis("rd", S.rope_dim)
    qk_dim = Axis("dq", S.head_dim + S.rope_dim)
    nope_dim = Axis("dn", S.head_dim)
    v_dim = Axis("dv", S.v_head_dim)
    latent_cache = Axis("kc", S.kv_lora + S.rope_dim)
    """Serving MLA: a cached position, the kv latent and the rotary key side by side."""
    shared_ffn = Axis("fs", S.shared_experts * S.moe_ffn)
