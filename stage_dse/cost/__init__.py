"""Costs derived from the symbolic graph: expressions (``derive``), and their numeric binding."""

from stage_dse.cost.derive import (
    CostKey,
    TrainingCosts,
    cost_key,
    derive,
    group_label,
    training_costs,
)
from stage_dse.cost.recompute import kept_activations

__all__ = [
    "CostKey",
    "TrainingCosts",
    "cost_key",
    "derive",
    "group_label",
    "kept_activations",
    "training_costs",
]
