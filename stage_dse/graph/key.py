"""The structural key of a transformer graph (:class:`GraphKey`, :func:`graph_key`): every
choice that changes the graph's structure is a field of the key, every size is a symbol of
the graph. Plain data (no sympy): evaluating families compiled earlier needs only their keys."""

from __future__ import annotations

from dataclasses import dataclass

from stage_dse.spec import (
    AttentionKernel,
    MlpKind,
    ModelSpec,
    NormKind,
    ParallelPlan,
    PositionKind,
    TrainingSpec,
)

__all__ = ["GraphKey", "graph_key"]


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
    ep_over_cp: bool = False
    """The expert-parallel group spans the context-parallel ranks (experts split over EP x CP,
    their replicas on DP only; ``ParallelPlan.ep_over_cp``)."""
    grad_sync_per_step: bool = False
    """ZeRO-2 gradients are reduce-scattered once per step (accumulated unsharded); other
    stages keep their schedule, so the key holds it for ZeRO-2 only."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek-V2/V3)."""
    sliding_window: bool = False
    """Some layers attend over a sliding window (a windowed block section;
    :func:`stage_dse.graph.layers.windowed_layers_among` counts them)."""
    chunked_attention: bool = False
    """Some layers attend within aligned chunks (``ModelSpec.attention_chunk_size``; the
    windowed block section, with the whole cache kept)."""
    sparse_attention: bool = False
    """DeepSeek Sparse Attention: a lightning indexer, and latent attention over the top-k
    tokens it selects (serving graphs; training graphs keep dense attention)."""
    expert_param_bytes: float = 0
    """Serving: bytes per routed-expert weight value when the experts have their own format
    (gpt-oss: MXFP4 experts, the rest bf16); 0: ``param_bytes``."""
    fused_elementwise: bool = True
    """Element-wise ops run as fused kernels; off, as eager PyTorch runs its reference code
    (:mod:`stage_dse.graph.eager`)."""
    fused_activation: bool = True
    """With ``fused_elementwise``, the gated activation fused too; off, it alone eager (True
    wherever it changes nothing: everything eager, or no gated MLP)."""
    fused_projections: bool = True
    """Query, key and value projections as one GEMM, gate and up projections as one
    (``ParallelPlan.fused_projections``): each op's ``fused_width``."""
    moe_weighted_activation: bool = False
    """The routing probabilities scale the experts' activation; the combine is an unweighted
    sum that keeps nothing for backward."""
    mtp: bool = False
    """Multi-token prediction modules on the last pipeline stage (``ModelSpec.mtp_layers``;
    training only)."""
    parallel_block: bool = False
    """Attention and MLP in parallel on one norm of the input (``ModelSpec.parallel_block``)."""
    hybrid_shard: bool = False
    """ZeRO states are sharded inside groups of data-parallel ranks replicated over the DR
    mesh axis (``plan.dp_replicate > 1``): the batch is split over DR too."""

    def __post_init__(self) -> None:
        if self.grad_sync_per_step and self.zero_stage != 2:  # one family per structure
            object.__setattr__(self, "grad_sync_per_step", False)
        if self.moe_weighted_activation and not self.moe:
            object.__setattr__(self, "moe_weighted_activation", False)
        if not (self.fused_elementwise and self.mlp is MlpKind.SWIGLU):
            object.__setattr__(self, "fused_activation", True)


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
        ep_over_cp=model.is_moe and plan.ep_over_cp,
        grad_sync_per_step=plan.grad_sync_per_step,
        mla=model.is_mla,
        sliding_window=model.has_sliding_window,
        chunked_attention=model.has_chunked_attention,
        sparse_attention=model.has_sparse_attention,
        fused_elementwise=plan.fused_elementwise,
        fused_activation=plan.fused_activation,
        fused_projections=plan.fused_projections,
        moe_weighted_activation=plan.moe_weighted_activation,
        hybrid_shard=plan.hybrid_shard,
        mtp=model.mtp_layers > 0,
        parallel_block=model.parallel_block,
    )
