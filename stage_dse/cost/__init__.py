"""Costs derived from the symbolic graph: expressions (``derive``), and their numeric binding.

The names below load their module on first use, so a process that evaluates families compiled
earlier (``cost.table``, ``cost.bind``) imports neither sympy nor the graph builders.
"""

from importlib import import_module

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


def __getattr__(name: str) -> object:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
