"""Expression helpers shared by the cost derivations: sums, unevaluated min/max, and a
branch-free selection of the largest of several expressions. Pure sympy, no numbers."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import sympy as sp

__all__ = ["_max", "_min", "_sum", "first_max_weights", "lazy_xreplace"]


def _sum(items: Iterable[sp.Expr]) -> sp.Expr:
    items = list(items)
    return sp.Add(*items) if items else sp.Integer(0)


@lru_cache(maxsize=1 << 16)
def _max(*args: sp.Expr) -> sp.Expr:
    # unevaluated: sympy would otherwise try to order large expressions symbolically. Even
    # so, building one sorts its arguments canonically (sympy's ``ordered``: node counts of
    # whole expressions), ~0.3 ms each; families share most of their maxima and minima (the
    # same kernels' rooflines, collectives, stage times), so each is built once per process
    return sp.Max(*args, evaluate=False)


@lru_cache(maxsize=1 << 16)
def _min(*args: sp.Expr) -> sp.Expr:
    return sp.Min(*args, evaluate=False)


def lazy_xreplace(expr: sp.Expr, subs: dict) -> sp.Expr:
    """``expr.xreplace(subs)`` that rebuilds ``Max``/``Min`` unevaluated. sympy's own
    rebuild re-derives which arguments of every min/max dominate the others (pairwise
    symbolic comparisons: seconds per program for MoE layouts, most of a serving program's
    construction); the values are the same, only the tree keeps arguments sympy would have
    dropped. Everything else is rebuilt (and evaluated) as by ``xreplace``."""
    memo: dict = {}

    def walk(e):
        if e in subs:
            return subs[e]
        if not e.args:
            return e
        got = memo.get(e)
        if got is not None:
            return got
        args = tuple(walk(a) for a in e.args)
        if args == e.args:
            out = e
        elif isinstance(e, sp.Max | sp.Min):
            out = e.func(*args, evaluate=False)
        else:
            out = e.func(*args)
        memo[e] = out
        return out

    return walk(sp.sympify(expr))


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
