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

import hashlib
import os
import pickle
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import sympy as sp

from stage_dse.cost.derive import CostKey, derive
from stage_dse.cost.time import derive_time
from stage_dse.graph.symbols import Symbols
from stage_dse.graph.transformer import _build

__all__ = [
    "SYMBOL_NAMES",
    "CompiledFamily",
    "cache_dir",
    "compile_family",
    "family_digest",
    "family_program",
]

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
        metric = name in ("mfu", "mfu_causal", "hfu", "tokens_per_s", "achieved_flops_per_gpu")
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


def cache_dir() -> Path:
    """Where compiled families are cached: ``$STAGE_DSE_CACHE`` or ``~/.cache/stage_dse``."""
    return Path(os.environ.get("STAGE_DSE_CACHE") or Path.home() / ".cache" / "stage_dse")


def model_digest() -> str:
    """Short content hash of the cost model (graph and cost code): results record it, so rows
    evaluated by another version are recognised."""
    return _source_digest()[:16]


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """Content hash of the code that derives and compiles costs (changes invalidate caches)."""
    import stage_dse.cost as cost_pkg
    import stage_dse.graph as graph_pkg

    h = hashlib.sha256()
    for pkg in (graph_pkg, cost_pkg):
        for path in sorted(Path(pkg.__file__).parent.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def family_digest(key: CostKey, backend: str) -> str:
    """Content hash of (family, code, package and compiler versions, machine)."""
    from stage_dse import __version__

    se_version = getattr(_se, "__version__", "none")
    text = "|".join(
        [repr(key), backend, __version__, _source_digest(), se_version, platform.machine()]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


MEMORY_PREFIXES = ("mem_", "params_")


@lru_cache(maxsize=512)
def compile_family(key: CostKey, backend: str | None = None, subset: str = "all") -> CompiledFamily:
    """The compiled cost function of one family: from memory, from the disk cache, or built
    (symbolic synthesis, then code generation) and stored in the disk cache.

    ``subset="memory"`` compiles only parameter and memory outputs: the cheap feasibility check
    run before a full evaluation.
    """
    backend = backend or _backend()
    tag = f"{backend}-{subset}"
    path = cache_dir() / f"family-{family_digest(key, tag)}.pkl"
    if backend == "symengine" and path.is_file():
        try:
            names, fn = pickle.loads(path.read_bytes())
            return CompiledFamily(key, names, _wrap(fn, len(names)), backend)
        except Exception:  # a stale or truncated cache entry is rebuilt, never trusted
            path.unlink(missing_ok=True)
    defs, outputs = family_program(key)
    if subset == "memory":
        outputs = {n: e for n, e in outputs.items() if n.startswith(MEMORY_PREFIXES)}
        defs = []
    names = tuple(outputs)
    exprs = [outputs[n] for n in names]
    if backend == "symengine":
        fn = _lambdify_symengine(defs, exprs)
        _store(path, (names, fn))
        return CompiledFamily(key, names, _wrap(fn, len(names)), backend)
    return CompiledFamily(key, names, _compile_numpy(defs, exprs), backend)


def _store(path: Path, obj: object) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(obj, fh)
        os.replace(tmp, path)
    except OSError:  # a read-only home still evaluates, just without the cache
        pass


def _wrap(f, n_out: int):
    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        if len(x) == 0:
            return np.empty((0, n_out))
        return np.asarray(f(x)).reshape(len(x), n_out)

    return run


def _lambdify_symengine(defs: Sequence[tuple[sp.Symbol, sp.Expr]], exprs: Sequence[sp.Expr]):
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
        return se.Lambdify(args, outs, backend="llvm", cse=True, real=True)
    except (RuntimeError, ValueError, TypeError):  # symengine built without LLVM
        return se.Lambdify(args, outs, backend="lambda", cse=True, real=True)


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
