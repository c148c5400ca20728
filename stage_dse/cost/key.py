"""The structural key of a plan family (:class:`CostKey`, :func:`cost_key`) and the names
of communicator groups. Plain data (no sympy): a process that evaluates families compiled
earlier builds their keys and labels their columns without deriving anything."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stage_dse.graph.key import GraphKey, graph_key
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.spec.plan import MeshAxis, PipelineSchedule, Recompute

__all__ = ["EMBEDDING_GROUP", "MESH_ORDER", "CostKey", "cost_key", "group_label"]

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
