"""Costs derived from the symbolic graph: expressions (``derive``), and their numeric binding."""

from stage_dse.cost.derive import (
    CostKey,
    TrainingCosts,
    cost_key,
    derive,
    group_label,
    kept_activations,
    training_costs,
)

__all__ = [
    "CostKey",
    "TrainingCosts",
    "cost_key",
    "derive",
    "group_label",
    "kept_activations",
    "training_costs",
]
