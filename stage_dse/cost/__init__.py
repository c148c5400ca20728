"""Costs derived from the symbolic graph: expressions (``derive``), and their numeric binding.

The names below load their module on first use, so a process that evaluates families compiled
earlier (``cost.table``, ``cost.bind``) imports neither sympy nor the graph builders.
"""

from stage_dse.lazy import lazy_names

_HOME = {
    "CostKey": "key",
    "cost_key": "key",
    "group_label": "key",
    "TrainingCosts": "derive",
    "derive": "derive",
    "training_costs": "derive",
    "kept_activations": "recompute",
}

__all__ = sorted(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
