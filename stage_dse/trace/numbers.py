"""Every number of a training trace set, from one function compiled per plan family.

What lives here: :func:`trace_family`, built once per plan family (:class:`CostKey`) in a
process: the family's graphs, their ops, and one compiled function
(:func:`stage_dse.cost.compile.compile_expressions`) of every op's flops, bytes, collective
size and time, the stage-boundary bytes and crossing time, the tied-embedding gradient sync,
and the per-layer flops of the analytic total; :func:`bucket_seconds`, the cost model's time of
one flat data-parallel bucket whose size is an input (one function per collective kind, group
and rank order); and :class:`SetNumbers`, a family evaluated once at one configuration's symbol
values. A trace set therefore costs no sympy work once its family has been met: binding its
numbers is one call of the compiled function (tens of microseconds), where substituting into
the expressions and printing them to numpy (``sympy.lambdify``) cost 0.1-1.5 CPU-s per set.
The expressions are kept in the compile cache (keyed by the family, this module's source and the
cost model's), so another process or Ray worker meeting the family loads them in milliseconds.

The values are those of the expressions the trace writer used before, evaluated in float64
rather than by exact substitution: integer-valued sizes and flops are exact below 2**53 and
rounded times agree to the microsecond (``tests/test_trace_numbers.py`` compares them with
substitution).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import sympy as sp

from stage_dse.cost.compile import SYMBOL_NAMES, compile_expressions
from stage_dse.cost.derive import CostKey, cost_key, embedding_sync_bytes, section_costs
from stage_dse.cost.expr import _sum
from stage_dse.cost.recompute import recomputed_ops
from stage_dse.cost.time import (
    _compute_time,
    collective_time,
    embedding_sync_time,
    pipeline_hop_time,
)
from stage_dse.graph.ir import CollKind, Op
from stage_dse.graph.transformer import ModelGraphs, _build
from stage_dse.spec import Recompute

__all__ = [
    "BUCKET_BYTES",
    "SECTION_NAMES",
    "OpNumbers",
    "SetNumbers",
    "TraceFamily",
    "bucket_seconds",
    "op_expressions",
    "set_numbers",
    "symbol_row",
    "trace_family",
]

BUCKET_BYTES = sp.Symbol("bucket_bytes", positive=True)
"""The size input of :func:`bucket_seconds`."""


@dataclass
class OpNumbers:
    flops: int
    bytes: int
    comm_bytes: int
    micros: int


def op_expressions(ops: list[Op], rank_order) -> list[sp.Expr]:
    """Flops, bytes, collective bytes and seconds of each op, four per op in order."""
    exprs: list[sp.Expr] = []
    for op in ops:
        t = (
            collective_time(op.coll, op.group, op.comm_bytes, rank_order)
            if op.is_comm
            else _compute_time(op)
        )
        exprs.extend([op.flops, op.bytes, op.comm_bytes, t])
    return exprs


def op_table(ops: list[Op], vals: np.ndarray) -> dict[int, OpNumbers]:
    """Rounded numbers of each op (by identity) from its four evaluated values."""
    out = {}
    for op, (f, b, c, t) in zip(ops, vals.reshape(len(ops), 4).tolist()):
        out[id(op)] = OpNumbers(round(f), round(b), round(c), max(1, round(t * 1e6)))
    return out


def symbol_row(values: dict[str, float]) -> np.ndarray:
    """One row of the compiled functions' input: every symbol's value in order."""
    return np.array([[values[n] for n in SYMBOL_NAMES]], dtype=np.float64)


SECTION_NAMES = ("embed", "head", "block", "dense")
"""The sections whose flops a trace family names (``<section>_compute_flops``, ...)."""


@dataclass(frozen=True)
class TraceFamily:
    key: CostKey
    graphs: ModelGraphs
    ops: tuple[Op, ...]
    """Every op of the graphs' sections, in section order."""
    fn: object
    """Symbol row -> op values (4 per op), then the named values of :data:`names`."""
    names: tuple[str, ...]


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """This module's code chooses the expressions: part of their disk-cache key."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@lru_cache(maxsize=128)
def trace_family(key: CostKey, grad_bytes: int) -> TraceFamily:
    """The compiled numbers of one plan family (see the module docstring); its expressions are
    derived only when the disk cache does not hold them."""
    graphs = _build(key.graph)
    ops = tuple(op for g in graphs.sections for op in g.ops)
    sections = [s for s in SECTION_NAMES if getattr(graphs, s) is not None]
    names = ["boundary_bytes", "hop_s"]
    if graphs.tied_head_weight is not None:
        names += ["embedding_sync_bytes", "embedding_sync_s"]
    for section in sections:
        names += [f"{section}_compute_flops", f"{section}_optimizer_flops"]
        # block recompute reruns whole layers of some sections only: their two parts apart
        names += [f"{section}_base_flops", f"{section}_rerun_flops"]

    def expressions() -> list[sp.Expr]:
        named = [graphs.boundary.local_bytes, pipeline_hop_time(graphs.boundary.local_bytes, key)]
        if graphs.tied_head_weight is not None:
            size = embedding_sync_bytes(graphs, grad_bytes)
            named += [size, embedding_sync_time(size, key.rank_order)]
        for section in sections:
            tied = graphs.tied_head_weight if section == "head" else None
            sc = section_costs(getattr(graphs, section), tied, key.recompute_modules)
            named += [sc.compute_flops[key.recompute], sc.optimizer_flops]
            rerun = recomputed_ops(getattr(graphs, section), key.recompute, key.recompute_modules)
            named += [sc.compute_flops[Recompute.NONE], _sum([op.flops for op in rerun])]
        return op_expressions(list(ops), key.rank_order) + [sp.sympify(e) for e in named]

    want = 4 * len(ops) + len(names)
    tag = f"trace-numbers|{_source_digest()}|{key!r}|{grad_bytes}"
    fn = compile_expressions(expressions, cache_tag=tag)
    if fn(np.full((1, len(SYMBOL_NAMES)), np.nan)).shape[1] != want:  # never trust a stale entry
        fn = compile_expressions(expressions)
    return TraceFamily(key, graphs, ops, fn, tuple(names))


@lru_cache(maxsize=512)
def _bucket_fn(coll: CollKind, group: frozenset, rank_order: tuple):
    axes = "-".join(sorted(a.value for a in group))
    order = "-".join(a.value for a in rank_order)
    return compile_expressions(
        lambda: [collective_time(coll, group, BUCKET_BYTES, rank_order)],
        extra=[BUCKET_BYTES],
        cache_tag=f"trace-bucket|{_source_digest()}|{coll.value}|{axes}|{order}",
    )


def bucket_seconds(coll: CollKind, group, rank_order, size_bytes: float, row: np.ndarray) -> float:
    """Seconds of one collective of ``size_bytes`` per rank at a configuration's ``row``."""
    x = np.append(row[0], size_bytes)[None, :]
    return float(_bucket_fn(coll, frozenset(group), tuple(rank_order))(x)[0, 0])


class SetNumbers:
    """One configuration's numbers: its family evaluated once at its symbol values."""

    def __init__(self, family: TraceFamily, values: dict[str, float], plan) -> None:
        self.family = family
        self.plan = plan
        self.graphs = family.graphs
        self.row = symbol_row(values)
        y = family.fn(self.row)[0]
        n = 4 * len(family.ops)
        self.raw = y[:n].reshape(len(family.ops), 4)
        self.ops = op_table(list(family.ops), y[:n])
        self.named = dict(zip(family.names, y[n:].tolist()))
        self._comm = {id(op): c for op, c in zip(family.ops, self.raw[:, 2].tolist())}
        self.rank_order = family.key.rank_order

    def comm_bytes(self, op: Op) -> float:
        """An op's collective bytes as evaluated (unrounded: buckets sum them)."""
        return self._comm[id(op)]

    def bucket_seconds(self, coll: CollKind, group, size_bytes: float) -> float:
        return bucket_seconds(coll, group, self.rank_order, size_bytes, self.row)


def set_numbers(cfg) -> SetNumbers:
    """The numbers of a training trace configuration (``cfg``: a ``TraceConfig``)."""
    from stage_dse.cost.bind import bind, bind_hardware

    values = {**bind(cfg.model, cfg.training, cfg.plan), **bind_hardware(cfg.hardware, cfg.cluster)}
    key = cost_key(cfg.model, cfg.plan, cfg.training)
    return SetNumbers(trace_family(key, cfg.training.grads_dtype.bytes), values, cfg.plan)
