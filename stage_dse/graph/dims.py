"""The symbolic dimensions of the transformer graphs (:class:`DIMS`) and the structural key
that selects a graph (:class:`GraphKey`, :func:`graph_key`): every size is a symbol, every
choice that changes the graph's structure is a field of the key."""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from stage_dse.graph.ir import Axis
from stage_dse.graph.symbols import S
from stage_dse.spec import (
    AttentionKernel,
    MlpKind,
    ModelSpec,
    NormKind,
    ParallelPlan,
    PositionKind,
    TrainingSpec,
)

__all__ = ["DIMS", "GraphKey", "graph_key"]


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


@dataclass(frozen=True)
class GraphKey:
    """Everything that changes the structure of the graphs (sizes are symbols)."""

    norm: NormKind
    mlp: MlpKind
    position: PositionKind
    tied_embeddings: bool
    bias: bool
    dropout: bool
    sequence_parallel: bool
    attention: AttentionKernel
    zero_stage: int
    param_bytes: float
    """Bytes per weight value (0.5625 / 0.53125 for NVFP4 / MXFP4, block scales included)."""
    grad_bytes: int
    optimizer_bytes_per_param: int
    moe: bool = False
    shared_experts: bool = False
    dense_layers: bool = False
    """Some layers of the mixture-of-experts model use the dense MLP, leading or interleaved
    (a second block section; :func:`stage_dse.graph.layers.dense_layers_among` counts them)."""
    expert_tensor_parallel: bool = False
    ep_over_tp: bool = False
    """The expert-parallel group spans the tensor-parallel ranks (experts split over EP x TP)."""
    grad_sync_per_step: bool = False
    """ZeRO-2 gradients are reduce-scattered once per step (accumulated unsharded); other
    stages keep their schedule, so the key holds it for ZeRO-2 only."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek-V2/V3)."""
    sliding_window: bool = False
    """Some layers attend over a sliding window (a windowed block section;
    :func:`stage_dse.graph.layers.windowed_layers_among` counts them)."""
    sparse_attention: bool = False
    """DeepSeek Sparse Attention: a lightning indexer, and latent attention over the top-k
    tokens it selects (serving graphs; training graphs keep dense attention)."""
    expert_param_bytes: float = 0
    """Serving: bytes per routed-expert weight value when the experts have their own format
    (gpt-oss: MXFP4 experts, the rest bf16); 0: ``param_bytes``."""
    fused_elementwise: bool = True
    """Element-wise ops run as fused kernels; off, as eager PyTorch runs its reference code
    (:mod:`stage_dse.graph.eager`)."""
    moe_weighted_activation: bool = False
    """The routing probabilities scale the experts' activation; the combine is an unweighted
    sum that keeps nothing for backward."""
    hybrid_shard: bool = False
    """ZeRO states are sharded inside groups of data-parallel ranks replicated over the DR
    mesh axis (``plan.dp_replicate > 1``): the batch is split over DR too."""

    def __post_init__(self) -> None:
        if self.grad_sync_per_step and self.zero_stage != 2:  # one family per structure
            object.__setattr__(self, "grad_sync_per_step", False)
        if self.moe_weighted_activation and not self.moe:
            object.__setattr__(self, "moe_weighted_activation", False)


def graph_key(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> GraphKey:
    return GraphKey(
        norm=model.norm,
        mlp=model.mlp,
        position=model.position,
        tied_embeddings=model.tied_embeddings,
        bias=model.bias,
        dropout=model.dropout,
        sequence_parallel=plan.sequence_parallel,
        attention=plan.attention,
        zero_stage=plan.zero_stage,
        param_bytes=training.params_dtype.bytes,
        grad_bytes=training.grads_dtype.bytes,
        optimizer_bytes_per_param=training.optimizer_bytes_per_param,
        moe=model.is_moe,
        shared_experts=model.num_shared_experts > 0,
        dense_layers=model.has_dense_layers,
        expert_tensor_parallel=plan.expert_tensor_parallel,
        ep_over_tp=plan.ep_over_tp,
        grad_sync_per_step=plan.grad_sync_per_step,
        mla=model.is_mla,
        sliding_window=model.has_sliding_window,
        sparse_attention=model.has_sparse_attention,
        fused_elementwise=plan.fused_elementwise,
        moe_weighted_activation=plan.moe_weighted_activation,
        hybrid_shard=plan.hybrid_shard,
    )
