"""The structural key of a plan family (:class:`CostKey`, :func:`cost_key`) and the names
of communicator groups. Plain data (no sympy): a process that evaluates families compiled
earlier builds their keys and labels their columns without deriving anything."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from stage_dse.graph.key import GraphKey, graph_key
from stage_dse.spec import (
    AttentionKernel,
    MlpKind,
    ModelSpec,
    NormKind,
    ParallelPlan,
    PositionKind,
    TrainingSpec,
    mesh_order,
    parse_recompute,
)
from stage_dse.spec.plan import MeshAxis, PipelineSchedule, Recompute

__all__ = [
    "EMBEDDING_GROUP",
    "KEY_COLUMNS",
    "MESH_ORDER",
    "CostKey",
    "cost_key",
    "group_label",
    "key_from_values",
]

MESH_ORDER = (
    MeshAxis.TP,
    MeshAxis.CP,
    MeshAxis.EP,
    MeshAxis.DP,
    MeshAxis.DS,
    MeshAxis.DR,
    MeshAxis.PP,
)
"""The mesh axes in the default rank order (hybrid sharding's DS and DR in DP's place)."""


EMBEDDING_GROUP = "embedding"
"""Label of the embedding group (Megatron-LM): the first and the last pipeline stage of each
pipeline, which hold the two copies of tied word embeddings."""


def group_label(group: Iterable[MeshAxis]) -> str:
    """Canonical name of a communicator group kind, e.g. ``tp`` or ``cp-ep-dp``."""
    members = set(group)
    return "-".join(m.value for m in MESH_ORDER if m in members)


@dataclass(frozen=True)
class CostKey:
    """The structural choices of a plan family: one set of expressions per key."""

    graph: GraphKey
    recompute: Recompute
    schedule: PipelineSchedule
    recompute_modules: tuple[str, ...] = ()
    rank_order: tuple[MeshAxis, ...] = (
        MeshAxis.TP,
        MeshAxis.CP,
        MeshAxis.EP,
        MeshAxis.DP,
        MeshAxis.PP,
    )
    """The mesh axes, fastest-varying first (:attr:`ParallelPlan.mesh_order`)."""
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    tp_dgrad_overlap: bool = True
    ep_comm_overlap: bool = False
    zero_sync_per_tensor: bool = False
    ep_dispatch_dedup: bool = False


def cost_key(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> CostKey:
    return CostKey(
        graph=graph_key(model, plan, training),
        recompute=plan.recompute,
        schedule=plan.schedule,
        recompute_modules=plan.recompute_modules,
        rank_order=plan.mesh_order,
        overlap_grad_reduce=plan.overlap_grad_reduce,
        overlap_param_gather=plan.overlap_param_gather,
        tp_comm_overlap=plan.tp_comm_overlap,
        tp_dgrad_overlap=plan.tp_dgrad_overlap,
        ep_comm_overlap=plan.ep_comm_overlap,
        zero_sync_per_tensor=plan.zero_sync_per_tensor,
        ep_dispatch_dedup=plan.ep_dispatch_dedup,
    )


MODEL_KEY_COLUMNS = (
    "norm",
    "mlp",
    "position",
    "tied_embeddings",
    "bias",
    "dropout",
    "moe",
    "has_shared_experts",
    "has_dense_layers",
    "mla",
    "sliding_window",
    "sparse_attention",
    "chunked_attention",
    "mtp",
    "parallel_block",
)
TRAINING_KEY_COLUMNS = ("param_bytes", "grad_bytes", "optimizer_bytes_per_param")
PLAN_KEY_COLUMNS = (
    "expert_tensor_parallel",
    "ep_over_tp",
    "ep_over_cp",
    "sequence_parallel",
    "attention",
    "zero_stage",
    "recompute",
    "schedule",
    "rank_order",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "tp_dgrad_overlap",
    "ep_comm_overlap",
    "zero_sync_per_tensor",
    "grad_sync_per_step",
    "ep_dispatch_dedup",
    "fused_elementwise",
    "fused_activation",
    "fused_projections",
    "moe_weighted_activation",
    "dp_replicate",
)
KEY_COLUMNS = MODEL_KEY_COLUMNS + TRAINING_KEY_COLUMNS + PLAN_KEY_COLUMNS
"""Columns whose values change the structure of the cost program."""


def key_from_values(v: dict) -> CostKey:
    """The family key of a row's structural columns (:data:`KEY_COLUMNS`, by name)."""
    try:
        return _key_of(tuple(map(v.__getitem__, KEY_COLUMNS)))
    except KeyError:  # tables written before these were columns
        pass
    late = (
        "zero_sync_per_tensor",
        "ep_over_tp",
        "ep_over_cp",
        "grad_sync_per_step",
        "ep_dispatch_dedup",
    )
    optional = dict.fromkeys((*late, "moe_weighted_activation", "chunked_attention"), False)
    optional["fused_elementwise"] = True
    optional["fused_activation"] = True
    optional["fused_projections"] = True
    optional["dp_replicate"] = 1
    return _key_of(tuple(v[c] if c in v else optional[c] for c in KEY_COLUMNS))


@lru_cache(maxsize=4096)
def _key_of(values: tuple) -> CostKey:
    v = dict(zip(KEY_COLUMNS, values, strict=True))
    hybrid = int(v["dp_replicate"]) > 1  # hybrid sharding: DS and DR in DP's place
    graph = GraphKey(
        norm=NormKind(v["norm"]),
        mlp=MlpKind(v["mlp"]),
        position=PositionKind(v["position"]),
        tied_embeddings=bool(v["tied_embeddings"]),
        bias=bool(v["bias"]),
        dropout=bool(v["dropout"]),
        sequence_parallel=bool(v["sequence_parallel"]),
        attention=AttentionKernel(v["attention"]),
        zero_stage=int(v["zero_stage"]),
        param_bytes=int(v["param_bytes"]),
        grad_bytes=int(v["grad_bytes"]),
        optimizer_bytes_per_param=int(v["optimizer_bytes_per_param"]),
        moe=bool(v["moe"]),
        shared_experts=bool(v["has_shared_experts"]),
        dense_layers=bool(v["has_dense_layers"]),
        expert_tensor_parallel=bool(v["expert_tensor_parallel"]),
        ep_over_tp=bool(v["ep_over_tp"]),
        ep_over_cp=bool(v["moe"]) and bool(v["ep_over_cp"]),
        grad_sync_per_step=bool(v["grad_sync_per_step"]),
        mla=bool(v["mla"]),
        sliding_window=bool(v["sliding_window"]),
        chunked_attention=bool(v["chunked_attention"]),
        sparse_attention=bool(v["sparse_attention"]),
        fused_elementwise=bool(v["fused_elementwise"]),
        fused_activation=bool(v["fused_activation"]),
        fused_projections=bool(v["fused_projections"]),
        moe_weighted_activation=bool(v["moe_weighted_activation"]),
        hybrid_shard=hybrid,
        mtp=bool(v.get("mtp", False)),
        parallel_block=bool(v.get("parallel_block", False)),
    )
    recompute = parse_recompute(v["recompute"])
    return CostKey(
        graph=graph,
        recompute=recompute.mode,
        recompute_modules=recompute.modules,
        schedule=PipelineSchedule(v["schedule"]),
        rank_order=mesh_order(tuple(MeshAxis(a) for a in str(v["rank_order"]).split("-")), hybrid),
        overlap_grad_reduce=bool(v["overlap_grad_reduce"]),
        overlap_param_gather=bool(v["overlap_param_gather"]),
        tp_comm_overlap=bool(v["tp_comm_overlap"]),
        tp_dgrad_overlap=bool(v["tp_dgrad_overlap"]),
        ep_comm_overlap=bool(v["ep_comm_overlap"]),
        zero_sync_per_tensor=bool(v.get("zero_sync_per_tensor", False)),
        ep_dispatch_dedup=bool(v["ep_dispatch_dedup"]),
    )
