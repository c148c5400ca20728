"""Compile a plan family's cost program once; evaluate it over whole tables of configurations.

What lives here: turning the symbolic costs of one :class:`CostKey` (memory, flops, comm from
:mod:`stage_dse.cost.derive`, time from :mod:`stage_dse.cost.time`) into one native function
``f(X) -> Y`` over a float64 matrix with a row per configuration and a column per symbol, and
the table evaluator that groups rows by key. Nothing is evaluated per configuration in Python.

Backends: symengine's LLVM ``Lambdify`` (the intermediate definitions are substituted into the
outputs inside symengine, then common subexpressions are shared by the code generator), or,
without symengine, ``sympy.lambdify`` to numpy with the definitions evaluated in order.

Compile strategy (:func:`family_for`): deriving a family's program (graph, costs, time,
common subexpressions) costs 0.1-0.5 CPU-s, LLVM code generation from it about 0.1, and its
numpy form (:mod:`stage_dse.cost.vector`) ~4 ms to print and ~5 ms to compile; that form
takes ~1 ms a call for tens of rows and ~5 us a row at a few thousand (10-80 us for one row on
Python floats), where compiled code takes ~0.4 us a row. The derived program goes to the disk
cache at once. A family is
compiled when its rows in this process reach ``LLVM_MIN_ROWS`` or when an earlier process
compiled it (its code is in the disk cache: from then on a process loads it in about a
millisecond); below that it runs interpreted, from the disk cache's program or, for the
families the package ships (:mod:`stage_dse.cost.shipped`), from the shipped numpy program
without deriving anything. Interpreted and compiled results agree to within a few ulp
(measured at most 1.6e-15 relative).
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stage_dse.cost.key import CostKey
from stage_dse.diskcache import cache_dir, load_pickle, store_pickle
from stage_dse.graph.symbols import Symbols

if TYPE_CHECKING:
    import sympy as sp

    from stage_dse.cost.time import Kernel

__all__ = [
    "SYMBOL_NAMES",
    "CompiledFamily",
    "cache_dir",
    "compile_family",
    "family_digest",
    "family_for",
    "family_program",
    "record_families",
]

SYMBOL_NAMES: tuple[str, ...] = Symbols.names()
"""Input columns of every compiled family, in order (known without sympy: evaluating a family
compiled by an earlier process derives nothing, and this module imports sympy and the
derivation only where a family is derived)."""

try:  # optional fast path
    import symengine as _se
except ImportError:  # pragma: no cover - exercised when the extra is not installed
    _se = None


def family_program(
    key: CostKey, measured: bool = False
) -> tuple[list[tuple[sp.Symbol, sp.Expr]], dict[str, sp.Expr]]:
    """Definitions and named outputs of every cost of one family, time included. ``measured``:
    the time of each measurable kernel is an input symbol (:func:`family_kernels`)."""
    from stage_dse.cost.derive import derive
    from stage_dse.cost.time import derive_measured_time, derive_time
    from stage_dse.graph.transformer import _build

    _build(key.graph)
    costs = derive(key).all()
    defs, time_out = derive_measured_time(key)[0] if measured else derive_time(key)
    outputs: dict[str, sp.Expr] = dict(costs)
    for name, expr in time_out:
        metric = name in ("mfu", "mfu_causal", "hfu", "tokens_per_s", "achieved_flops_per_gpu")
        outputs[name if metric else f"time_{name}"] = expr
    outputs["mem_headroom_bytes"] = Symbols.usable_memory - costs["mem_total"]
    return list(defs), outputs


def family_kernels(key: CostKey) -> tuple[Kernel, ...]:
    """The measurable kernels of one family, in the order of their time inputs."""
    from stage_dse.cost.time import derive_measured_time

    return tuple(k for k, _ in derive_measured_time(key)[1])


def _kernel_symbols(key: CostKey) -> tuple[sp.Symbol, ...]:
    from stage_dse.cost.time import derive_measured_time

    return tuple(sym for _, sym in derive_measured_time(key)[1])


@dataclass(frozen=True)
class CompiledFamily:
    key: CostKey
    names: tuple[str, ...]
    fn: Callable[[np.ndarray], np.ndarray]
    backend: str

    single: Callable[[np.ndarray], np.ndarray] | None = None
    """The evaluator itself where it takes one C-contiguous float64 row matrix as it is (the
    symengine programs): what a one-plan call uses, without the contiguity check and reshape
    (0.3 us of a 17 us call in an A/B of evaluate_plan loops)."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x``: (rows, len(SYMBOL_NAMES)) float64 -> (rows, len(names)) float64 (subset
        ``measured``: the kernels' seconds follow the symbol columns)."""
        return self.fn(x)

    def row(self, x: np.ndarray) -> np.ndarray:
        """The outputs of one row ``x`` (a C-contiguous float64 ``(1, len(SYMBOL_NAMES))``
        matrix)."""
        return (self.single or self.fn)(x)[0]

    def into(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The outputs of the rows ``x`` (C-contiguous float64), written into ``out``
        (C-contiguous, ``(len(x), len(names))``) where the evaluator can write in place, else
        a new matrix; what is returned holds them. A table's chunks reuse one buffer this way:
        a fresh matrix per chunk of 131,072 rows (57 MB) is fresh memory the kernel faults in
        and zeroes, which made a 10M-row table cost 1.85x per row what a 1M-row one does
        (1.48x with the buffer reused: the rest is the first touch of the 4.5 GB result)."""
        if self.single is None or len(x) == 0:
            return self(x)
        self.single(x, out=out)
        return out


_BACKEND_WANTED = os.environ.get("STAGE_DSE_BACKEND", "auto")
"""``STAGE_DSE_BACKEND=numpy`` (read at import) evaluates with ``sympy.lambdify`` to numpy
even where symengine is installed."""


def _backend() -> str:
    if _BACKEND_WANTED == "numpy" or _se is None:
        return "numpy"
    return "symengine"


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
LLVM_MIN_ROWS = int(os.environ.get("STAGE_DSE_LLVM_MIN_ROWS", "500"))
"""Rows of one family (over a process's life) from which it is compiled rather than
interpreted. Measured on GPT-3 175B families: LLVM costs ~0.13 CPU-s to build and ~0.4 us per
row, the interpreter ~0.01 CPU-s and 50-150 us per row, so compiling repays itself within one run
from ~3,300 rows. The threshold is lower because compiled code outlives the run: it is cached
on disk and serves every later run that meets the family (a family does not depend on sizes,
GPU counts or hardware), while interpreting a family's first 500 rows costs ~20 ms, a sixth of
its compilation. ``STAGE_DSE_LLVM_MIN_ROWS=0`` always compiles (``benchmarks/bench_cold.py``)."""
_rows_seen: dict[tuple[CostKey, str], int] = {}
_compiled: set[tuple[CostKey, str]] = set()
_interpreted: set[tuple[CostKey, str]] = set()
_ready: dict[tuple[CostKey, str], CompiledFamily] = {}
"""Compiled families by (key, subset), as :func:`family_for` last returned them: a table meets
each of its families once per call, and one lookup here replaces the four hashes of a nested
key that the row accounting above costs on every call."""
_READY_MAX = 512  # as compile_family's own memory
_met: set[tuple[CostKey, str]] | None = None  # see record_families


@contextmanager
def record_families() -> Iterator[set[tuple[CostKey, str]]]:
    """A set that collects every (family, subset) :func:`family_for` meets in the block."""
    global _met
    met: set[tuple[CostKey, str]] = set()
    _met = met
    try:
        yield met
    finally:
        _met = None


def family_for(key: CostKey, subset: str = "all", rows: int = 1) -> CompiledFamily:
    """The cheapest adequate evaluator of one family for ``rows`` more rows: its LLVM code when
    already built (memory or disk cache) or when the family's rows in this process reach
    :data:`LLVM_MIN_ROWS`, else the interpreted program (see the module docstring)."""
    tag = (key, subset)
    if _met is not None:
        _met.add(tag)
    family = _ready.get(tag)
    if family is not None:
        return family
    backend = _backend()
    if backend != "symengine":
        return compile_family(key, backend, subset)
    seen = _rows_seen[tag] = _rows_seen.get(tag, 0) + rows
    if tag in _compiled or seen >= LLVM_MIN_ROWS:
        if len(_ready) >= _READY_MAX:
            _ready.clear()
        family = _ready[tag] = compile_family(key, None, subset)
        return family
    if tag not in _interpreted:  # first met in this process: compiled by an earlier one?
        if _cache_path(key, backend, subset).is_file():
            return compile_family(key, None, subset)
        _interpreted.add(tag)
    return _interpreted_family(key, subset)


def _cache_path(key: CostKey, backend: str, subset: str) -> Path:
    return cache_dir() / f"family-{family_digest(key, f'{backend}-{subset}')}.pkl"


def _program_path(key: CostKey, subset: str) -> Path:
    return cache_dir() / f"program-{family_digest(key, f'program-{subset}')}.pkl"


@lru_cache(maxsize=512)
def _interpreted_family(key: CostKey, subset: str) -> CompiledFamily:
    """A family evaluated without compiled code: the numpy program of its common-subexpression
    form (:mod:`stage_dse.cost.vector`; numpy columns for tables, Python floats for a few
    rows), from the package's shipped programs (:mod:`stage_dse.cost.shipped`: nothing
    derived), as an earlier process printed it (disk cache), or printed from the disk
    cache's or a fresh derivation's program; symengine's interpreter where the printer does
    not translate a node."""
    from stage_dse.cost.shipped import shipped_source
    from stage_dse.cost.vector import Unprintable, numpy_source, source_function

    printed = shipped_source(key, subset)
    if printed is None:  # printed by an earlier process?
        path = cache_dir() / f"vector-{family_digest(key, f'vector-{subset}')}.pkl"
        printed = load_pickle(path)
        if not (isinstance(printed, tuple) and len(printed) == 2):
            printed = None
    if printed is None:
        names, steps, finals, arg_names = _cse_program(key, subset)
        try:
            printed = (names, numpy_source(steps, finals, arg_names))
        except Unprintable:
            _, outs, args = _symengine_program(key, subset)
            lam = _se.Lambdify(args, outs, backend="lambda", cse=True, real=True)
            return CompiledFamily(key, names, _wrap(lam, len(names)), "interpreted")
        store_pickle(path, printed)
    names, source = printed
    return CompiledFamily(
        key, names, source_function(_python_code(source), len(names)), "interpreted"
    )


def _python_code(source: str):
    """The code object of a family's numpy program, compiled once per Python version and kept
    in the disk cache (compiling a preset family's text is ~5 ms, loading it ~0.3)."""
    import marshal
    import sys

    text = "|".join([source, sys.version, "marshal"])
    path = cache_dir() / f"code-{hashlib.sha256(text.encode()).hexdigest()[:32]}.pkl"
    data = load_pickle(path)
    if isinstance(data, bytes):
        try:
            return marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            path.unlink(missing_ok=True)
    code = compile(source, "<family>", "exec")
    store_pickle(path, marshal.dumps(code))
    return code


@lru_cache(maxsize=64)
def _cse_program(key: CostKey, subset: str) -> tuple[tuple[str, ...], list, list, list[str]]:
    """Named outputs of one family in common-subexpression form (``symengine.cse``: steps,
    then outputs over them) and the input symbols' names in order. Deriving them (graph,
    costs, time, conversion) is most of what a family costs before its first row (0.2-0.5
    CPU-s), so they are kept in the disk cache beside the compiled code: a later process, or
    a Ray worker, that meets the family loads them in about a millisecond, whether it then
    interprets or compiles them."""
    path = _program_path(key, subset)
    cached = load_pickle(path)
    if cached is None:
        defs, outputs = _family_outputs(key, subset)
        names = tuple(outputs)
        steps, finals = _se.cse(_to_symengine(defs, [outputs[n] for n in names]))
        cached = (names, steps, finals, [str(a) for a in _se_args(key, subset)])
        store_pickle(path, cached)
    return cached


@lru_cache(maxsize=64)
def _symengine_program(key: CostKey, subset: str) -> tuple[tuple[str, ...], list, list]:
    """Named outputs of one family as symengine expressions, definitions substituted, and the
    input symbols in order (:func:`_cse_program`)."""
    names, steps, finals, arg_names = _cse_program(key, subset)
    return names, _unshare(steps, finals), [_se.Symbol(n) for n in arg_names]


def _unshare(steps: list, finals: list) -> list:
    """Outputs from their common-subexpression form (``symengine.cse``: definitions in order,
    then the outputs over them), each definition substituted once so the outputs share its
    node. The form is what the cache stores: pickled expressions lose their shared nodes
    (a family's outputs become a tree some 50x larger, whose interpreter takes 0.6 CPU-s to
    build instead of 0.01); rebuilt this way they load in ~10 ms. A fresh derivation goes
    through the same form, so a family evaluates alike in every process."""
    done: dict = {}

    def resolve(e):
        need = {s: done[s] for s in e.free_symbols if s in done}
        return e.xreplace(need) if need else e

    for sym, e in steps:
        done[sym] = resolve(e)
    return [resolve(e) for e in finals]


def _family_outputs(key: CostKey, subset: str):
    """Subsets: ``all``; ``memory`` (parameters and memory only); ``measured`` (all, kernel
    times as inputs); ``kernels`` (each measurable kernel's shape and roofline seconds)."""
    if subset == "kernels":
        outputs = {}
        for j, kernel in enumerate(family_kernels(key)):
            for i, e in enumerate(kernel.shape):
                outputs[f"k{j}_shape{i}"] = e
            outputs[f"k{j}_roofline_s"] = kernel.roofline
        return [], outputs
    defs, outputs = family_program(key, measured=subset == "measured")
    if subset == "memory":
        outputs = {n: e for n, e in outputs.items() if n.startswith(MEMORY_PREFIXES)}
        defs = []
    return defs, outputs


@lru_cache(maxsize=512)
def compile_family(key: CostKey, backend: str | None = None, subset: str = "all") -> CompiledFamily:
    """The compiled cost function of one family: from memory, from the disk cache, or built
    (symbolic synthesis, then code generation) and stored in the disk cache.

    ``subset="memory"`` compiles only parameter and memory outputs: the cheap feasibility check
    run before a full evaluation.
    """
    backend = backend or _backend()
    path = _cache_path(key, backend, subset)
    if backend == "symengine":
        _compiled.add((key, subset))
    cached = load_pickle(path) if backend == "symengine" else None
    if cached is not None:
        names, fn = cached
        return CompiledFamily(key, names, _wrap(fn, len(names)), backend, fn)
    if backend == "symengine":
        names, outs, args = _symengine_program(key, subset)
        fn = _lambdify_symengine(outs, args)
        store_pickle(path, (names, fn))
        return CompiledFamily(key, names, _wrap(fn, len(names)), backend, fn)
    defs, outputs = _family_outputs(key, subset)
    names = tuple(outputs)
    extra = list(_kernel_symbols(key)) if subset == "measured" else []
    fn = _compile_numpy(defs, [outputs[n] for n in names], extra)
    return CompiledFamily(key, names, fn, backend)


def _wrap(f, n_out: int):
    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        if len(x) == 0:
            return np.empty((0, n_out))
        return np.asarray(f(x)).reshape(len(x), n_out)

    return run


def _se_args(key: CostKey | None = None, subset: str = "all") -> list:
    names = list(SYMBOL_NAMES)
    if subset == "measured" and key is not None:
        names += [s.name for s in _kernel_symbols(key)]
    return [_se.Symbol(n) for n in names]


def _to_symengine(defs: Sequence[tuple[sp.Symbol, sp.Expr]], exprs: Sequence[sp.Expr]) -> list:
    se = _se
    assert se is not None
    resolved: dict = {}
    for sym, expr in defs:
        e = _se_convert(expr)
        if resolved:
            e = e.xreplace(resolved)
        resolved[se.Symbol(sym.name)] = e
    outs = []
    for expr in exprs:
        e = _se_convert(expr)
        outs.append(e.xreplace(resolved) if resolved else e)
    return outs


_SE_MEMO: dict = {}
"""sympy node -> symengine node, shared by every family of the process: families share most
of their subexpressions, and symengine's own conversion walks a tree (each shared subtree once
per use) where this walks the DAG once."""
_SE_MEMO_LIMIT = 2_000_000


def _se_convert(expr: sp.Basic):
    se = _se
    if len(_SE_MEMO) > _SE_MEMO_LIMIT:
        _SE_MEMO.clear()
    memo = _SE_MEMO
    kinds = _se_kinds()
    stack = [expr]
    while stack:
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        build = kinds.get(type(node))
        if build is None or not node.args or node.is_Number:
            memo[node] = se.Symbol(node.name) if node.is_Symbol else se.sympify(node)
            stack.pop()
            continue
        pending = [a for a in node.args if a not in memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        memo[node] = build(*[memo[a] for a in node.args])
    return memo[expr]


@lru_cache(maxsize=1)
def _se_kinds() -> dict:
    """sympy node type -> symengine constructor of the same node from converted arguments."""
    import sympy as sp

    se = _se
    return {
        sp.Add: se.Add,
        sp.Mul: se.Mul,
        sp.Pow: se.Pow,
        sp.Max: se.Max,
        sp.Min: se.Min,
        sp.log: se.log,
        sp.Piecewise: lambda *pairs: se.Piecewise(*pairs),
        sp.functions.elementary.piecewise.ExprCondPair: lambda e, c: (e, c),
        sp.StrictLessThan: se.Lt,
        sp.LessThan: se.Le,
        sp.StrictGreaterThan: se.Gt,
        sp.GreaterThan: se.Ge,
        sp.Equality: se.Eq,
    }


def _lambdify_symengine(outs: list, args: list | None = None):
    args = args if args is not None else _se_args()
    try:
        return _se.Lambdify(args, outs, backend="llvm", cse=True, real=True)
    except (RuntimeError, ValueError, TypeError):  # symengine built without LLVM
        return _se.Lambdify(args, outs, backend="lambda", cse=True, real=True)


def _compile_numpy(
    defs: Sequence[tuple[sp.Symbol, sp.Expr]], exprs: Sequence[sp.Expr], extra: Sequence = ()
):
    import sympy as sp

    steps = []
    known = [*Symbols.all().values(), *extra]
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


def compile_expressions(
    exprs: Sequence[sp.Expr] | Callable[[], Sequence[sp.Expr]],
    extra: Sequence[sp.Symbol] = (),
    cache_tag: str | None = None,
) -> Callable[[np.ndarray], np.ndarray]:
    """One function of expressions outside any family (a trace's per-op numbers): rows of
    :data:`SYMBOL_NAMES` columns, then one column per ``extra`` symbol -> (rows,
    len(exprs)) float64. Built for few rows: symengine's interpreter of their common-
    subexpression program (milliseconds to build, tens of microseconds a row), or without
    symengine ``sympy.lambdify`` to numpy. Callers cache the function per family.

    ``exprs`` may be a function that returns them; with ``cache_tag`` (a name unique to the
    expressions and to the code that chooses them) the symengine expressions are kept in the
    disk cache (:func:`cache_dir`, keyed with the cost model's source digest), so a later
    process, or another Ray worker, loads them in about a millisecond and never calls it."""
    se_path = None
    if _backend() == "symengine":
        if cache_tag is not None:
            text = "|".join([cache_tag, _source_digest(), getattr(_se, "__version__", "")])
            digest = hashlib.sha256(text.encode()).hexdigest()[:32]
            se_path = cache_dir() / f"exprs-{digest}.pkl"
        outs = load_pickle(se_path) if se_path is not None else None
        if outs is None:
            outs = _to_symengine([], list(exprs() if callable(exprs) else exprs))
            if se_path is not None:
                store_pickle(se_path, outs)
        args = _se_args() + [_se.Symbol(s.name) for s in extra]
        fn = _se.Lambdify(args, outs, backend="lambda", cse=True, real=True)
        return _wrap(fn, len(outs))
    import sympy as sp

    exprs = list(exprs() if callable(exprs) else exprs)
    final = sp.lambdify([*Symbols.all().values(), *extra], exprs, modules="numpy", cse=True)

    def run(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        out = np.empty((len(x), len(exprs)))
        for i, v in enumerate(final(*(x[:, j] for j in range(x.shape[1])))):
            out[:, i] = v
        return out

    return run
