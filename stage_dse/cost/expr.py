"""Expression helpers shared by the cost derivations: sums, unevaluated min/max, and a
branch-free selection of the largest of several expressions. Pure sympy, no numbers."""

from __future__ import annotations

from collections.abc import Iterable

import sympy as sp

__all__ = ["_max", "_min", "_sum", "first_max_weights"]


def _sum(items: Iterable[sp.Expr]) -> sp.Expr:
    items = list(items)
    return sp.Add(*items) if items else sp.Integer(0)


def _max(*args: sp.Expr) -> sp.Expr:
    # unevaluated: sympy would otherwise try to order large expressions symbolically
    return sp.Max(*args, evaluate=False)


def _min(*args: sp.Expr) -> sp.Expr:
    return sp.Min(*args, evaluate=False)


def first_max_weights(values: list[sp.Expr]) -> list[sp.Expr]:
    """0/1 weights that select the first of ``values`` equal to their maximum, in min/max
    arithmetic: ``a >= b`` is ``max(0, min(1, (a - b) * 1e30 + 1))`` (1 when a >= b, 0 when a
    is smaller by more than 1e-30 of its unit). For selections between very large expressions
    (per-stage step times): the compiled code shares their common subexpressions across
    min/max, but evaluates a Piecewise condition's compared expressions again (measured:
    ~180 ns per plan for the five step-time breakdown columns)."""

    def at_least(a: sp.Expr, b: sp.Expr) -> sp.Expr:
        return _max(0, _min(1, (a - b) * sp.Float(1e30) + 1))

    weights: list[sp.Expr] = []
    rest: sp.Expr = sp.Integer(1)
    for i, v in enumerate(values[:-1]):
        w = rest * at_least(v, _max(*values[i + 1 :]) if i + 2 < len(values) else values[-1])
        weights.append(w)
        rest = rest - w
    return [*weights, rest]
