"""Node emission: a stage's ops turned into Chakra nodes with dependencies, as a template.

What lives here: the numeric value of every op of a configuration (:func:`op_numbers`: flops,
bytes, collective size, duration from the time model), :class:`Program`, which turns a stream
of ops into COMP / COMM_COLL / SEND / RECV nodes with their dependencies, and
:class:`StageTemplate`, the pre-encoded result: fixed nodes as bytes, group ids and pipeline
peers as per-rank slots. Which ops run in which order is decided by
:mod:`stage_dse.trace.schedule`; files are written by :mod:`stage_dse.trace.write`.

Field semantics follow ASTRA-sim, the reference consumer (``astra-sim/workload/Workload.cc`` and
``system/astraccl/native_collectives/collective_algorithm/Ring.cc``): a collective's
``comm_size`` is bytes per rank, the full buffer for all-reduce, reduce-scatter and all-to-all
and each rank's *input* for all-gather (the ring sends it at every step and ends with
``comm_size x group size``); in roofline mode a COMP node takes
``num_ops / min(peak, bandwidth x num_ops / tensor_size)``, so every COMP node has a positive
``tensor_size`` and ``num_ops`` (:data:`MEMORY_ONLY_OPS` for a kernel without flops, which the
roofline then times by its bytes). ``duration_micros`` is the cost model's time (replay mode).

Dependencies: compute nodes depend on the previous compute node (one stream) and on the
collectives whose results they consume; collectives depend on the compute that produced their
input. Compute between two collectives is one COMP node (``granularity="segment"``) or one node
per kernel (``"op"``). With ``plan.tp_dgrad_overlap`` a linear layer's backward collectives are
issued before the GEMM they run under, which does not wait for them (the cost model's
:func:`stage_dse.graph.backward.async_partners`).
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import sympy as sp

from stage_dse.cost.bind import bind, bind_hardware
from stage_dse.cost.compile import compile_expressions
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, Frequency, Op, OpKind
from stage_dse.graph.symbols import Symbols
from stage_dse.trace import encode as enc
from stage_dse.trace.numbers import OpNumbers, op_expressions, op_table, symbol_row

__all__ = [
    "COLL_TYPE",
    "MEMORY_ONLY_OPS",
    "OpNumbers",
    "Piece",
    "Program",
    "StageTemplate",
    "config_values",
    "consumed_ops",
    "emit_ops",
    "group_size",
    "op_numbers",
    "symbol_subs",
]

MEMORY_ONLY_OPS = 1
"""``num_ops`` of a COMP node whose kernels do no arithmetic; not counted as flops."""

COLL_TYPE = {
    CollKind.ALL_REDUCE: enc.CollType.ALL_REDUCE,
    CollKind.ALL_GATHER: enc.CollType.ALL_GATHER,
    CollKind.REDUCE_SCATTER: enc.CollType.REDUCE_SCATTER,
    CollKind.ALL_TO_ALL: enc.CollType.ALL_TO_ALL,
}


def config_values(cfg) -> dict[str, float]:
    """Every symbol's value for one trace configuration (model, step, plan, hardware)."""
    return {**bind(cfg.model, cfg.training, cfg.plan), **bind_hardware(cfg.hardware, cfg.cluster)}


def symbol_subs(values: dict[str, float]) -> dict[sp.Symbol, float]:
    return {Symbols.all()[k]: v for k, v in values.items()}


_NUMBER_FNS: dict[tuple, tuple[list[Op], object]] = {}
"""Compiled numbers of an op list, by its ops' identities and rank order: graphs are cached per
plan structure (:func:`stage_dse.graph.transformer.build_graphs`), so the sets of a farm or a
selection that share one reuse its function; the ops are kept with it so an identity is never
reused by another list. (Training sets take theirs from :mod:`stage_dse.trace.numbers`.)"""


def _number_fn(ops: list[Op], order) -> object:
    key = (tuple(id(op) for op in ops), tuple(order))
    hit = _NUMBER_FNS.get(key)
    if hit is not None and len(hit[0]) == len(ops) and all(a is b for a, b in zip(hit[0], ops)):
        return hit[1]
    fn = compile_expressions(op_expressions(ops, order))
    if len(_NUMBER_FNS) >= 64:
        _NUMBER_FNS.pop(next(iter(_NUMBER_FNS)))
    _NUMBER_FNS[key] = (list(ops), fn)
    return fn


def op_numbers(cfg, ops: list[Op], values: dict | None = None) -> dict[int, OpNumbers]:
    """Flops, bytes, collective bytes and microseconds of each op (by identity) at one
    configuration's symbol values."""
    row = symbol_row(config_values(cfg) if values is None else values)
    return op_table(ops, _number_fn(ops, cfg.plan.mesh_order)(row)[0])


@dataclass
class Piece:
    """A node of a stage program: fixed bytes, or a prefix awaiting a per-rank slot."""

    prefix: bytes
    slot: object = None
    """None (fixed node), a group kind (pg_name), or ("peer", delta) for send/recv."""


@dataclass
class StageTemplate:
    stage: int
    pieces: list[Piece] = field(default_factory=list)
    nodes: Counter = field(default_factory=Counter)
    flops: int = 0
    kinds: set = field(default_factory=set)
    gathered_bytes: int = 0
    """Bytes all-gathers produce on one rank, from the graph (the checker compares the trace's
    per-rank sizes times group sizes with it)."""
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Identifies the template across processes (the writer's tasks keep prepared stamps)."""


@lru_cache(maxsize=1 << 16)
def _comp_attrs(flops: int, size: int) -> bytes:
    return (
        enc.attr_bool("is_cpu_op", False)
        # a kernel without flops (a lookup, a copy) carries one operation so that a
        # roofline simulator times it by its bytes instead of dividing 0 by 0
        + enc.attr_int64("num_ops", max(flops, MEMORY_ONLY_OPS))
        + enc.attr_uint64("tensor_size", max(size, 1))
    )


@lru_cache(maxsize=1 << 16)
def _coll_attrs(coll: CollKind, comm_bytes: int) -> bytes:
    return (
        enc.attr_bool("is_cpu_op", False)
        + enc.attr_int64("comm_type", int(COLL_TYPE[coll]))
        + enc.attr_int64("comm_size", comm_bytes)
    )


class Program:
    """Builds one stage's node list with dependencies (ids local to the file)."""

    def __init__(self, cfg, numbers: dict[int, OpNumbers]) -> None:
        self.cfg = cfg
        self.numbers = numbers
        self.pieces: list[Piece] = []
        self.next_id = 0
        self.last_compute: int | None = None
        self.pending_comm: list[int] = []
        """Collectives since the last compute whose results the next compute consumes."""
        self.deferred_comm: list[int] = []
        """Collectives issued before a GEMM that runs beside them: the compute after it waits."""
        self.step_comm: list[int] = []
        """Per-step collectives the optimizer waits for."""
        self.segment: list[Op] = []
        self.counts: Counter = Counter()
        self.flops = 0
        self.gathered = 0
        self.kinds: set = set()
        sizes: dict = {}

        def size_of(group) -> int:
            n = sizes.get(group)
            if n is None:
                n = sizes[group] = group_size(cfg.plan, group)
            return n

        self.group_size = size_of

    def template(self, stage: int) -> StageTemplate:
        """The finished program of pipeline stage ``stage``."""
        return StageTemplate(
            stage=stage,
            pieces=self.pieces,
            nodes=self.counts,
            flops=self.flops,
            kinds=self.kinds,
            gathered_bytes=self.gathered,
        )

    def _new_id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def compute(self, op: Op) -> None:
        self.segment.append(op)
        if self.cfg.granularity == "op" or self.deferred_comm:
            self.flush()

    def flush(self, name: str | None = None) -> None:
        if not self.segment:
            return
        nums = [self.numbers[id(o)] for o in self.segment]
        flops = sum(n.flops for n in nums)
        size = sum(n.bytes for n in nums)
        micros = sum(n.micros for n in nums)
        deps = ([self.last_compute] if self.last_compute is not None else []) + self.pending_comm
        nid = self._new_id()
        label = name or (
            self.segment[0].name
            if len(self.segment) == 1
            else f"{self.segment[0].name}..{self.segment[-1].name}"
        )
        attrs = _comp_attrs(flops, size)
        self.pieces.append(
            Piece(
                enc.node(
                    nid,
                    label,
                    enc.NodeType.COMP_NODE,
                    data_deps=deps,
                    duration_micros=micros,
                    attrs=attrs,
                )
            )
        )
        self.counts["COMP_NODE"] += 1
        self.flops += flops
        self.last_compute = nid
        self.pending_comm, self.deferred_comm = self.deferred_comm, []
        self.segment = []

    def collective(
        self, op: Op, blocking: bool, per_step: bool = False, deferred: bool = False
    ) -> None:
        """``deferred``: the next compute node runs beside the collective; the one after it
        waits for it."""
        if self.group_size(op.group) == 1:
            return  # a one-rank group moves nothing
        n = self.numbers[id(op)]
        size = n.comm_bytes
        if op.coll is CollKind.ALL_GATHER:  # the simulator's size is each rank's input
            size = n.comm_bytes // self.group_size(op.group)
            self.gathered += n.comm_bytes
        self.collective_node(op.name, op.coll, op.group, size, n.micros, blocking, per_step)
        if deferred and blocking and not per_step:
            self.deferred_comm.append(self.pending_comm.pop())

    def collective_node(
        self,
        name: str,
        coll: CollKind,
        kind: object,
        comm_bytes: int,
        micros: int,
        blocking: bool,
        per_step: bool = False,
        after: list[int] = (),  # type: ignore[assignment]
    ) -> int:
        """A collective over the group of ``kind`` holding the rank (its id stamped per rank);
        ``after``: further nodes it waits for. Returns its node id."""
        self.flush()
        deps = [self.last_compute] if self.last_compute is not None else []
        if self.pending_comm:
            deps.append(self.pending_comm[-1])
        deps.extend(d for d in after if d not in deps)
        nid = self._new_id()
        attrs = _coll_attrs(coll, comm_bytes)
        prefix = enc.node(
            nid,
            name,
            enc.NodeType.COMM_COLL_NODE,
            data_deps=deps,
            duration_micros=micros,
            attrs=attrs,
        )
        self.pieces.append(Piece(prefix, kind))
        self.kinds.add(kind)
        self.counts["COMM_COLL_NODE"] += 1
        if per_step:
            self.step_comm.append(nid)
        elif blocking:
            self.pending_comm.append(nid)
        return nid

    def p2p(self, send: bool, delta: int, size: int, tag: int, name: str, micros: int = 0) -> None:
        """A send or receive to the stage ``delta`` away; ``micros``: the cost model's time for
        the boundary crossing (:func:`stage_dse.cost.time.pipeline_hop_time`)."""
        self.flush()
        deps = [self.last_compute] if self.last_compute is not None else []
        nid = self._new_id()
        kind = enc.NodeType.COMM_SEND_NODE if send else enc.NodeType.COMM_RECV_NODE
        attrs = (
            enc.attr_bool("is_cpu_op", False)
            + enc.attr_int64("comm_size", size)
            + enc.attr_int32("comm_tag", tag)
        )
        node = enc.node(nid, name, kind, data_deps=deps, duration_micros=micros, attrs=attrs)
        self.pieces.append(Piece(node, ("peer", delta, send)))
        self.counts["COMM_SEND_NODE" if send else "COMM_RECV_NODE"] += 1
        if not send:
            self.pending_comm.append(nid)


def group_size(plan, group) -> int:
    """Ranks in a communicator group of a plan's mesh (DP counts the ranks outside EP)."""
    degree = plan.mesh_degrees
    return int(np.prod([degree[a] for a in group]))


def consumed_ops(graph: Graph) -> set[int]:
    """Ops whose outputs are read by a later op of the same section (blocking collectives)."""
    readers: set = set()
    for op in graph.ops:
        for t in op.inputs:
            readers.add(t)
    return {id(op) for op in graph.ops if any(t in readers for t in op.outputs)}


def issue_order(ops: list[Op], partners: dict[Op, Op]) -> list[Op]:
    """``ops`` with each collective of ``partners`` moved to just before the GEMM it runs under
    (:func:`stage_dse.graph.backward.async_partners`)."""
    if not partners:
        return ops
    moved = {under: comm for comm, under in partners.items()}
    out: list[Op] = []
    for op in ops:
        if op in partners:
            continue
        if op in moved:
            out.append(moved[op])
        out.append(op)
    return out


def emit_ops(
    prog: Program,
    ops: list[Op],
    consumed: set[int],
    skip_step: bool = True,
    partners: dict[Op, Op] | None = None,
) -> None:
    """Nodes of ``ops`` in order; the collectives of ``partners`` run beside their GEMM."""
    present = set(ops)
    partners = {c: u for c, u in (partners or {}).items() if c in present and u in present}
    for op in issue_order(ops, partners):
        if op.kind in (OpKind.VIEW,) or op.coll is CollKind.SLICE:
            continue
        if op.is_comm:
            if op.frequency is Frequency.PER_STEP and skip_step:
                continue
            prog.collective(op, blocking=id(op) in consumed, deferred=op in partners)
        elif op.kind is not OpKind.OPTIMIZER:
            prog.compute(op)
