"""Frozen, validated descriptions of what is evaluated: model, hardware, training step, parallel
plan, and what a sweep or search covers.

Nothing here does I/O or computes a cost; presets are loaded by :mod:`stage_dse.config`.
"""

from stage_dse.spec.hardware import ClusterSpec, HardwareSpec
from stage_dse.spec.model import MlpKind, ModelSpec, NormKind, PositionKind
from stage_dse.spec.plan import (
    RECOMPUTE_MODULES,
    AttentionKernel,
    MeshAxis,
    ParallelPlan,
    PipelineSchedule,
    Recompute,
    mesh_order,
    parse_recompute,
    validate_plan,
)
from stage_dse.spec.sweep import OptunaSpec, SearchSpace, ServingJob, ServingSweepSpec, SweepSpec
from stage_dse.spec.training import DType, Fp8Recipe, Optimizer, TrainingSpec, check_gemm_dtype

__all__ = [
    "RECOMPUTE_MODULES",
    "AttentionKernel",
    "ClusterSpec",
    "DType",
    "Fp8Recipe",
    "HardwareSpec",
    "MeshAxis",
    "MlpKind",
    "ModelSpec",
    "NormKind",
    "Optimizer",
    "OptunaSpec",
    "ParallelPlan",
    "PipelineSchedule",
    "PositionKind",
    "Recompute",
    "SearchSpace",
    "ServingJob",
    "ServingSweepSpec",
    "SweepSpec",
    "TrainingSpec",
    "check_gemm_dtype",
    "mesh_order",
    "parse_recompute",
    "validate_plan",
]
