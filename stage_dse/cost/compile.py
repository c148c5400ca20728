"""Compile a plan family's cost program once; evaluate it over whole tables of configurations.

What lives here: turning the symbolic costs of one :class:`CostKey` (memory, flops, comm from
:mod:`stage_dse.cost.derive`, time from :mod:`stage_dse.cost.time`) into one native function
``f(X) -> Y`` over a float64 matrix with a row per configuration and a column per symbol, and
the table evaluator that groups rows by key. Nothing is evaluated per configuration in Python.

Backends: symengine's LLVM ``Lambdify`` (the intermediate definitions are substituted into the
outputs inside symengine, then common subexpressions are shared by the code generator), or,
without symengine, ``sympy.lambdify`` to numpy with the definitions evaluated in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy as sp

from stage_dse.cost.derive import CostKey, derive
from stage_dse.cost.time import derive_time
from stage_dse.graph.symbols import HARDWARE_SYMBOLS, Symbols
from stage_dse.graph.transformer import _build

__all__ = ["SYMBOL_NAMES", "CompiledFamily", "compile_family", "family_program"]

SYMBOL_NAMES: tuple[str, ...] = tuple(Symbols.all())
"""Input columns of every compiled family, in order."""
_SYMBOLS = tuple(Symbols.all().values())

try:  # optional fast path
    import symengine as _se
except ImportError:  # pragma: no cover - exercised when the extra is not installed
    _se = None


def family_program(key: CostKey) -> tuple[list[tuple[sp.Symbol, sp.Expr]], dict[str, sp.Expr]]:
    """Definitions and named outputs of every cost of one family, time included."""
    _build(key.graph)
    costs = derive(key).all()
    defs, time_out = derive_time(key)
    outputs: dict[str, sp.Expr] = dict(costs)
    for name, expr in time_out:
        metric = name in ("mfu", "hfu", "tokens_per_s", "achieved_flops_per_gpu")
        outputs[name if metric else f"time_{name}"] = expr
    outputs["mem_headroom_bytes"] = Symbols.usable_memory - costs["mem_total"]
    return list(defs), outputs


@dataclass(frozen=True)
class CompiledFamily:
    key: CostKey
    names: tuple[str, ...]
    fn: Callable[[np.ndarray], np.ndarray]
    backend: str

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x``: (rows, len(SYMBOL_NAMES)) float64 -> (rows, len(names)) float64."""
        return self.fn(x)


def _backend() -> str:
    want = os.environ.get("STAGE_DSE_BACKEND", "auto")
    if want == "numpy" or _se is None:
        return "numpy"
    return "symengine"


@lru_cache(maxsize=256)
def compile_family(key: CostKey, backend: str | None = None) -> CompiledFamily:
    backend = backend or _backend()
    defs, outputs = family_program(key)
    names = tuple(outputs)
    exprs = [outputs[n] for n in names]
    if backend == "symengine":
        return CompiledFamily(key, names, _compile_symengine(defs, exprs), backend)
    return CompiledFamily(key, names, _compile_numpy(defs, exprs), backend)


def _compile_symengine(defs: Sequence[tuple[sp.Symbol, sp.Expr]], exprs: Sequence[sp.Expr]):
    se = _se
    assert se is not None
    resolved: dict = {}
    for sym, expr in defs:
        e = se.sympify(expr)
        if resolved:
            e = e.xreplace(resolved)
        resolved[se.Symbol(sym.name)] = e
    outs = []
    for expr in exprs:
        e = se.sympify(expr)
        outs.append(e.xreplace(resolved) if resolved else e)
    args = [se.Symbol(s.name) for s in _SYMBOLS]
    try:
        f = se.Lambdify(args, outs, backend="llvm", cse=True, real=True)
    except (RuntimeError, ValueError, TypeError):  # symengine built without LLVM
        f = se.Lambdify(args, outs, backend="lambda", cse=True, real=True)
    n_out = len(outs)

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        if len(x) == 0:
            return np.empty((0, n_out))
        return np.asarray(f(x)).reshape(len(x), n_out)

    return run


def _compile_numpy(defs: Sequence[tuple[sp.Symbol, sp.Expr]], exprs: Sequence[sp.Expr]):
    steps = []
    known = list(_SYMBOLS)
    for sym, expr in defs:
        steps.append(sp.lambdify(known, expr, modules="numpy"))
        known.append(sym)
    final = sp.lambdify(known, list(exprs), modules="numpy", cse=True)
    n_out = len(exprs)

    def run(x: np.ndarray) -> np.ndarray:
        cols = [np.asarray(x[:, i], dtype=np.float64) for i in range(x.shape[1])]
        for step in steps:
            cols.append(np.broadcast_to(step(*cols), (len(x),)))
        out = np.empty((len(x), n_out))
        for i, v in enumerate(final(*cols)):
            out[:, i] = v
        return out

    return run


_ = HARDWARE_SYMBOLS
