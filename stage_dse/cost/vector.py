"""A family's cost program as numpy source: evaluated over all of a table's rows at once.

The program is the common-subexpression form :mod:`stage_dse.cost.compile` keeps (definitions
in order, then the outputs over them, as symengine expressions). Printed here as one Python
function whose every line is an operation on whole columns, it runs on numpy columns for a
table (a GPT-3 family: ~1 ms for its 28 rows, ~5 us a row at a few thousand rows) and on
Python floats for one row (10-80 us; symengine's interpreter takes 50-150 us a row and ~30 ms
to build), needs neither sympy nor symengine to run, and is the same text on every machine:
what the package ships for the presets' common families (:mod:`stage_dse.cost.shipped`).
Printing a family takes ~4 ms, compiling the text ~5 ms.

Semantics follow the compiled code: ``Max``/``Min`` as ``maximum``/``minimum`` (a NaN wins), a
``Piecewise`` as the first branch whose condition holds (every branch is evaluated, as numpy
evaluates both sides of ``where``), comparisons exact. Nodes outside that vocabulary raise
:class:`Unprintable`; the caller keeps symengine's interpreter for such a program.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["Unprintable", "numpy_source", "source_function"]


class Unprintable(ValueError):
    """A node this printer does not translate."""


_NUMBERS = ("Integer", "NegativeOne", "One", "Zero", "Half", "Rational", "RealDouble", "Exp1")
_NESTED = {"Max": "maximum", "Min": "minimum", "And": "logical_and", "Or": "logical_or"}
_FUNCTIONS = {"floor": "floor", "ceiling": "ceil", "log": "log", "Abs": "absolute"}
_COMPARE = {
    "StrictLessThan": "<",
    "LessThan": "<=",
    "StrictGreaterThan": ">",
    "GreaterThan": ">=",
    "Equality": "==",
    "Unequality": "!=",
}


def numpy_source(steps: Sequence, finals: Sequence, arg_names: Sequence[str]) -> str:
    """Source of ``evaluate(X, out)``: ``X`` (rows, len(arg_names)) float64, ``out`` (rows,
    len(finals)) float64 written and returned. ``steps``: ``(symbol, expression)`` in order;
    ``finals``: the outputs over the arguments and the steps."""
    names: dict[str, str] = {}
    lines = ["def evaluate(X, out):", "    C = columns(X)"]
    for j, a in enumerate(arg_names):
        names[a] = f"a{j}"
    used_args = set()
    body = []
    for i, (sym, e) in enumerate(steps):
        text = _print(e, names, used_args)
        names[str(sym)] = f"s{i}"
        body.append(f"    s{i} = {text}")
    for i, e in enumerate(finals):
        body.append(f"    out[:, {i}] = {_print(e, names, used_args)}")
    lines += [f"    a{j} = C[{j}]" for j in sorted(used_args)]
    lines += body
    lines.append("    return out")
    return "\n".join(lines) + "\n"


def _print(expr, names: dict[str, str], used_args: set) -> str:
    kind = type(expr).__name__
    if kind == "Symbol":
        name = names.get(str(expr))
        if name is None:
            raise Unprintable(f"free symbol {expr}")
        if name[0] == "a":
            used_args.add(int(name[1:]))
        return name
    if kind in _NUMBERS:
        return repr(float(expr))
    if kind == "BooleanTrue":
        return "True"
    if kind == "BooleanFalse":
        return "False"
    args = [_print(a, names, used_args) for a in expr.args]
    if kind == "Add":
        return "(" + " + ".join(args) + ")"
    if kind == "Mul":
        return "(" + " * ".join(args) + ")"
    if kind == "Pow":
        return f"({args[0]} ** {args[1]})"
    if kind in _NESTED:  # n-ary, as nested binary calls
        text = args[-1]
        for a in reversed(args[:-1]):
            text = f"{_NESTED[kind]}({a}, {text})"
        return text
    if kind in _FUNCTIONS and len(args) == 1:
        return f"{_FUNCTIONS[kind]}({args[0]})"
    if kind in _COMPARE and len(args) == 2:
        return f"({args[0]} {_COMPARE[kind]} {args[1]})"
    if kind == "Not":
        return f"logical_not({args[0]})"
    if kind == "Piecewise":
        pairs = list(zip(args[::2], args[1::2]))
        text = "nan"
        for value, cond in reversed(pairs):
            text = value if cond == "True" else f"where({cond}, {value}, {text})"
        return text
    raise Unprintable(f"{kind} node")


SCALAR_MAX_ROWS = 4
"""Calls of at most this many rows run the program row by row on Python floats (~10-80 us a
row for the presets' families) rather than on numpy columns (~0.1-1 ms a call, a few us a row
from a few thousand rows)."""

_VECTOR = {
    "columns": lambda x: x.T.copy(),
    "maximum": np.maximum,
    "minimum": np.minimum,
    "floor": np.floor,
    "ceil": np.ceil,
    "log": np.log,
    "absolute": np.absolute,
    "where": np.where,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_not": np.logical_not,
    "nan": np.nan,
}


def _max(a, b):  # numpy's maximum on scalars: a NaN on either side wins
    return a if a >= b or a != a else b


def _min(a, b):
    return a if a <= b or a != a else b


_SCALAR = {
    **_VECTOR,
    "columns": lambda x: x[0].tolist(),
    "maximum": _max,
    "minimum": _min,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "absolute": abs,
    "where": lambda c, a, b: a if c else b,
    "logical_and": lambda a, b: bool(a and b),
    "logical_or": lambda a, b: bool(a or b),
    "logical_not": lambda a: not a,
}
# a row whose Python floats raise or turn complex (a division by zero, a log of zero, a
# fractional power of a negative number in a branch the Piecewise does not take) runs again
# on numpy scalars, which return inf or nan as the columns do
_SCALAR_NUMPY = {
    **_SCALAR,
    "columns": lambda x: list(x[0]),
    "floor": np.floor,
    "ceil": np.ceil,
    "log": np.log,
}


def source_function(source, n_out: int, label: str = "family") -> Callable:
    """The evaluator of :func:`numpy_source`'s text (or of its compiled code object): ``x``
    (rows, columns) float64 -> a new (rows, n_out) float64 matrix."""
    code = compile(source, f"<{label}>", "exec") if isinstance(source, str) else source
    evaluate = {}
    for name, space in (("vector", _VECTOR), ("scalar", _SCALAR), ("numpy", _SCALAR_NUMPY)):
        scope = dict(space)
        exec(code, scope)
        evaluate[name] = scope["evaluate"]
    vector, scalar, numpy_scalar = evaluate["vector"], evaluate["scalar"], evaluate["numpy"]

    def run(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        out = np.empty((len(x), n_out))
        if len(x) == 0:
            return out
        with np.errstate(all="ignore"):
            if len(x) > SCALAR_MAX_ROWS:
                return vector(x, out)
            for i in range(len(x)):
                row = x[i : i + 1]
                try:
                    scalar(row, out[i : i + 1])
                except (ArithmeticError, ValueError, TypeError):
                    numpy_scalar(row, out[i : i + 1])
        return out

    return run
