"""Per-rank Chakra execution traces instantiated from the symbolic graph of one configuration.

What lives here: binding a configuration's symbols, laying out its pipeline stages (uneven
splits give the first and last stage fewer layers; embeddings always on the first stage, the
output layer and loss always on the last), the 1F1B micro-batch schedule of each stage, and the
node stream of each stage as *templates*: every rank of a stage runs the same program and
differs only in its communicator-group ids and pipeline peers. A template is pre-encoded once
(fixed nodes as bytes, group/peer fields as slots), then each rank's file is stamped by filling
its slots, so the cost per rank is a few hundred small byte joins and memory does not grow with
the number of ranks.

Modelling choices, visible in ``manifest.json``:

* compute between two collectives is one COMP node (``granularity="segment"``, the default) or
  one node per kernel (``"op"``); flops and bytes are summed, durations from the time model;
* data-parallel gradients accumulate over micro-batches and are synchronized once per step,
  layer by layer right after that layer's backward of the last micro-batch (bucketed overlap as
  in Megatron-LM and PyTorch DDP); ZeRO-2/3 reduce-scatter every micro-batch;
* with tied embeddings and pp > 1, the first and last stage all-reduce the word-embedding
  gradient over their embedding group after the last backward, before the optimizer step;
* micro-batches follow 1F1B, or the interleaved schedule with ``virtual_stages`` model chunks
  per stage (chunk ``c`` of stage ``s`` is virtual stage ``c * pp + s``; activations wrap from
  the last stage to the first between chunks);
* send/recv tags are ``2 * (micro_batch * chunks + sender's chunk) + direction``:
  deterministic, unique per peer pair;
* compute nodes depend on the previous compute node (one stream) and on the collectives whose
  results they consume; collectives depend on the compute that produced their input.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sympy as sp

from stage_dse import __version__
from stage_dse.cost.bind import bind, bind_hardware
from stage_dse.cost.derive import _recomputed_ops, cost_key, embedding_sync_bytes
from stage_dse.cost.time import _compute_time, collective_time, embedding_sync_time
from stage_dse.errors import ConfigError
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, Frequency, Op, OpKind, Phase
from stage_dse.graph.symbols import Symbols
from stage_dse.graph.transformer import build_graphs
from stage_dse.spec import (
    ClusterSpec,
    HardwareSpec,
    MeshAxis,
    ModelSpec,
    ParallelPlan,
    PipelineSchedule,
    TrainingSpec,
    check_gemm_dtype,
    validate_plan,
)
from stage_dse.trace import encode as enc
from stage_dse.trace.mesh import ASTRA_SIM_MAX_GROUP_ID, EMBEDDING, Mesh

__all__ = ["TraceConfig", "TraceSet", "build_trace_set", "stage_layers", "write_trace_set"]

COLL_TYPE = {
    CollKind.ALL_REDUCE: enc.CollType.ALL_REDUCE,
    CollKind.ALL_GATHER: enc.CollType.ALL_GATHER,
    CollKind.REDUCE_SCATTER: enc.CollType.REDUCE_SCATTER,
    CollKind.ALL_TO_ALL: enc.CollType.ALL_TO_ALL,
}
PP = frozenset({MeshAxis.PP})


@dataclass(frozen=True)
class TraceConfig:
    model: ModelSpec
    training: TrainingSpec
    plan: ParallelPlan
    hardware: HardwareSpec
    cluster: ClusterSpec
    granularity: str = "segment"

    def __post_init__(self) -> None:
        validate_plan(self.model, self.training, self.plan)
        check_gemm_dtype(self.training, self.hardware)
        if self.plan.num_gpus > self.cluster.num_gpus:
            raise ConfigError(
                f"plan needs {self.plan.num_gpus} GPUs > cluster.num_gpus({self.cluster.num_gpus})"
            )
        if self.granularity not in ("segment", "op"):
            raise ConfigError(f"granularity={self.granularity!r} is not one of: segment, op")
        if self.plan.schedule is PipelineSchedule.INTERLEAVED:
            chunks = self.plan.pp * self.plan.virtual_stages
            if self.model.num_layers % chunks:
                raise ConfigError(
                    f"interleaved traces need layers({self.model.num_layers}) divisible by "
                    f"pp({self.plan.pp})*virtual_stages({self.plan.virtual_stages})={chunks}"
                )


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: ceil(layers/pp) each, the shortfall taken from the first and
    last stages alternately (as large runs balance the embedding and output layers)."""
    per = -(-layers // pp)
    counts = [per] * pp
    deficit = per * pp - layers
    order = [0, pp - 1, *range(1, pp - 1)]
    i = 0
    while deficit > 0:
        s = order[i % len(order)]
        if counts[s] > 1:
            counts[s] -= 1
            deficit -= 1
        i += 1
    return counts


# --------------------------------------------------------------------------- op numbers
@dataclass
class OpNumbers:
    flops: int
    bytes: int
    comm_bytes: int
    micros: int


def _values(cfg: TraceConfig) -> dict[str, float]:
    """Every symbol's value for one trace configuration (model, step, plan, hardware)."""
    return {**bind(cfg.model, cfg.training, cfg.plan), **bind_hardware(cfg.hardware, cfg.cluster)}


def _subs(values: dict[str, float]) -> dict[sp.Symbol, float]:
    return {Symbols.all()[k]: v for k, v in values.items()}


def _numbers(cfg, ops: list[Op], values: dict | None = None) -> dict[int, OpNumbers]:
    subs = _subs(_values(cfg) if values is None else values)
    order = cfg.plan.rank_order
    exprs = []
    for op in ops:
        t = (
            collective_time(op.coll, op.group, op.comm_bytes, order)
            if op.is_comm
            else _compute_time(op)
        )
        exprs.extend([op.flops, op.bytes, op.comm_bytes, t])
    args = list(subs)
    fn = sp.lambdify(args, exprs, modules="numpy")
    vals = np.asarray(fn(*[subs[a] for a in args]), dtype=np.float64).reshape(len(ops), 4)
    out = {}
    for op, (f, b, c, t) in zip(ops, vals):
        out[id(op)] = OpNumbers(round(f), round(b), round(c), max(1, round(t * 1e6)))
    return out


# --------------------------------------------------------------------------- templates
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


class _Program:
    """Builds one stage's node list with dependencies (ids local to the file)."""

    def __init__(self, cfg: TraceConfig, numbers: dict[int, OpNumbers]) -> None:
        self.cfg = cfg
        self.numbers = numbers
        self.pieces: list[Piece] = []
        self.next_id = 0
        self.last_compute: int | None = None
        self.pending_comm: list[int] = []
        """Collectives since the last compute whose results the next compute consumes."""
        self.step_comm: list[int] = []
        """Per-step collectives the optimizer waits for."""
        self.segment: list[Op] = []
        self.counts: Counter = Counter()
        self.flops = 0
        self.kinds: set = set()
        degree = {
            MeshAxis.TP: cfg.plan.tp,
            MeshAxis.CP: cfg.plan.cp,
            MeshAxis.EP: cfg.plan.ep,
            MeshAxis.DP: cfg.plan.dp // cfg.plan.ep,
            MeshAxis.PP: cfg.plan.pp,
        }
        self.group_size = lambda group: int(np.prod([degree[a] for a in group]))

    def _new_id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def compute(self, op: Op) -> None:
        self.segment.append(op)
        if self.cfg.granularity == "op":
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
        attrs = (
            enc.attr_bool("is_cpu_op", False)
            + enc.attr_int64("num_ops", flops)
            + enc.attr_uint64("tensor_size", size)
        )
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
        self.pending_comm = []
        self.segment = []

    def collective(self, op: Op, blocking: bool, per_step: bool = False) -> None:
        if self.group_size(op.group) == 1:
            return  # a one-rank group moves nothing
        n = self.numbers[id(op)]
        self.collective_node(op.name, op.coll, op.group, n.comm_bytes, n.micros, blocking, per_step)

    def collective_node(
        self,
        name: str,
        coll: CollKind,
        kind: object,
        comm_bytes: int,
        micros: int,
        blocking: bool,
        per_step: bool = False,
    ) -> None:
        """A collective over the group of ``kind`` holding the rank (its id stamped per rank)."""
        self.flush()
        deps = [self.last_compute] if self.last_compute is not None else []
        if self.pending_comm:
            deps.append(self.pending_comm[-1])
        nid = self._new_id()
        attrs = (
            enc.attr_bool("is_cpu_op", False)
            + enc.attr_int64("comm_type", int(COLL_TYPE[coll]))
            + enc.attr_int64("comm_size", comm_bytes)
        )
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

    def p2p(self, send: bool, delta: int, size: int, tag: int, name: str) -> None:
        self.flush()
        deps = [self.last_compute] if self.last_compute is not None else []
        nid = self._new_id()
        kind = enc.NodeType.COMM_SEND_NODE if send else enc.NodeType.COMM_RECV_NODE
        attrs = (
            enc.attr_bool("is_cpu_op", False)
            + enc.attr_int64("comm_size", size)
            + enc.attr_int32("comm_tag", tag)
        )
        self.pieces.append(
            Piece(enc.node(nid, name, kind, data_deps=deps, attrs=attrs), ("peer", delta, send))
        )
        self.counts["COMM_SEND_NODE" if send else "COMM_RECV_NODE"] += 1
        if not send:
            self.pending_comm.append(nid)


def _consumed(graph: Graph) -> set[int]:
    """Ops whose outputs are read by a later op of the same section (blocking collectives)."""
    readers: set = set()
    for op in graph.ops:
        for t in op.inputs:
            readers.add(t)
    return {id(op) for op in graph.ops if any(t in readers for t in op.outputs)}


def _emit_ops(prog: _Program, ops: list[Op], consumed: set[int], skip_step: bool = True) -> None:
    for op in ops:
        if op.kind in (OpKind.VIEW,) or op.coll is CollKind.SLICE:
            continue
        if op.is_comm:
            if op.frequency is Frequency.PER_STEP and skip_step:
                continue
            prog.collective(op, blocking=id(op) in consumed)
        elif op.kind is not OpKind.OPTIMIZER:
            prog.compute(op)


def layer_runs(graphs, model: ModelSpec, start: int, count: int) -> list[tuple[Graph, int]]:
    """Layers [start, start + count) as runs of leading dense layers and block layers."""
    dense_layers = model.first_dense_layers if graphs.dense is not None else 0
    n_dense = max(0, min(dense_layers, start + count) - start)
    runs = []
    if n_dense:
        runs.append((graphs.dense, n_dense))
    if count - n_dense:
        runs.append((graphs.block, count - n_dense))
    return runs


def schedule_order(stage: int, pp: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """(phase, micro-batch, model chunk) in execution order on one pipeline stage.

    ``v == 1``: 1F1B (PipeDream-Flush): ``pp - stage - 1`` warm-up forwards, then one forward
    and one backward alternately, then the remaining backwards. ``v > 1``: the interleaved
    schedule of Narayanan et al. SC21 sec. 2.2 (Megatron-LM's order): virtual micro-batch ``k``
    runs chunk ``(k mod pp*v) div pp`` (backwards in reverse chunk order) of micro-batch
    ``(k div pp*v) * pp + k mod pp``, with ``2 (pp - stage - 1) + (v - 1) pp`` warm-up forwards.
    """
    if v == 1:
        warmup = min(pp - stage - 1, m)
        fwd = [(i, 0) for i in range(m)]
        bwd = [(i, 0) for i in range(m)]
    else:
        total = m * v
        warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)

        def virtual(k: int, forward: bool) -> tuple[int, int]:
            in_group = k % (pp * v)
            chunk = in_group // pp
            if not forward:
                chunk = v - 1 - chunk
            return (k // (pp * v)) * pp + k % pp, chunk

        fwd = [virtual(k, True) for k in range(total)]
        bwd = [virtual(k, False) for k in range(total)]
    n = len(fwd)
    order = [("F", *fwd[k]) for k in range(warmup)]
    for k in range(n - warmup):
        order += [("F", *fwd[warmup + k]), ("B", *bwd[k])]
    order += [("B", *bwd[k]) for k in range(n - warmup, n)]
    return order


def build_trace_set(cfg: TraceConfig) -> tuple[Mesh, list[StageTemplate], dict]:
    """Stage templates, the mesh with its groups, and the manifest facts of one config."""
    model, training, plan = cfg.model, cfg.training, cfg.plan
    graphs = build_graphs(model, plan, training)
    key = cost_key(model, plan, training)
    all_ops = [op for g in graphs.sections for op in g.ops]
    numbers = _numbers(cfg, all_ops)
    consumed = {g: _consumed(g) for g in graphs.sections}
    m = plan.num_microbatches(training)
    pp, v = plan.pp, plan.virtual_stages
    if v == 1:
        layers = stage_layers(model.num_layers, pp)
        chunk_layers = [[n] for n in layers]
    else:
        per_chunk = model.num_layers // (pp * v)
        chunk_layers = [[per_chunk] * v for _ in range(pp)]
        layers = [per_chunk * v] * pp
    boundary_bytes = numbers_boundary(cfg, graphs)
    fwd = {g: [op for op in g.ops if op.phase is Phase.FORWARD] for g in graphs.sections}
    bwd = {g: [op for op in g.ops if op.phase is Phase.BACKWARD] for g in graphs.sections}
    rerun = {g: _recomputed_ops(g, key.recompute) for g in graphs.sections}
    step_sync = {
        g: [
            op
            for op in g.ops
            if op.is_comm and op.frequency is Frequency.PER_STEP and op.phase is Phase.BACKWARD
        ]
        for g in graphs.sections
    }
    embedding_sync = _embedding_sync(cfg, graphs) if pp > 1 else None
    mesh = Mesh(plan)
    templates = []
    for s in range(pp):
        prog = _Program(cfg, numbers)
        chunks: list[list[tuple[Graph, int]]] = []
        for c in range(v):
            sections: list[tuple[Graph, int]] = []
            if s == 0 and c == 0:
                sections.append((graphs.embed, 1))
            # first global layer of this chunk (virtual stage c * pp + s when interleaved)
            start = sum(layers[:s]) if v == 1 else (c * pp + s) * chunk_layers[s][c]
            sections.extend(layer_runs(graphs, model, start, chunk_layers[s][c]))
            if s == pp - 1 and c == v - 1:
                sections.append((graphs.head, 1))
            chunks.append(sections)
        backwards_done = [0] * v
        for phase, mb, c in schedule_order(s, pp, m, v):
            sections = chunks[c]
            first_virtual = s == 0 and c == 0
            last_virtual = s == pp - 1 and c == v - 1
            # neighbours in the virtual pipeline: stage +-1, wrapping between chunks
            prev_delta = -1 if s > 0 else pp - 1
            next_delta = +1 if s < pp - 1 else -(pp - 1)
            # a message's tag names the sender's chunk: 2 * (mb * v + chunk) + direction
            own = 2 * (mb * v + c)
            from_prev = 2 * (mb * v + (c if s > 0 else c - 1))
            from_next = 2 * (mb * v + (c if s < pp - 1 else c + 1)) + 1
            if phase == "F":
                if not first_virtual:
                    name = f"recv_activation:mb{mb}:c{c}"
                    prog.p2p(False, prev_delta, boundary_bytes, from_prev, name)
                for g, count in sections:
                    for _ in range(count):
                        _emit_ops(prog, fwd[g], consumed[g])
                prog.flush()
                if not last_virtual:
                    prog.p2p(True, next_delta, boundary_bytes, own, f"send_activation:mb{mb}:c{c}")
            else:
                backwards_done[c] += 1
                last_mb = backwards_done[c] == m
                if not last_virtual:
                    name = f"recv_gradient:mb{mb}:c{c}"
                    prog.p2p(False, next_delta, boundary_bytes, from_next, name)
                for g, count in reversed(sections):
                    for _ in range(count):
                        _emit_ops(prog, rerun[g], consumed[g])
                        _emit_ops(prog, bwd[g], consumed[g])
                        if last_mb:  # bucketed gradient sync of this layer, once per step
                            prog.flush()
                            for op in step_sync[g]:
                                prog.collective(op, blocking=False, per_step=True)
                prog.flush()
                if not first_virtual:
                    name = f"send_gradient:mb{mb}:c{c}"
                    prog.p2p(True, prev_delta, boundary_bytes, own + 1, name)
        if embedding_sync is not None and s in (0, pp - 1):
            # tied embeddings: both copies' gradients summed over the embedding group
            prog.collective_node(
                "all_reduce:word_embeddings.grad",
                CollKind.ALL_REDUCE,
                EMBEDDING,
                *embedding_sync,
                blocking=False,
                per_step=True,
            )
        # optimizer step waits for every gradient synchronization, then ZeRO-1/2 gathers
        prog.pending_comm = list(prog.step_comm)
        all_sections = [sc for sections in chunks for sc in sections]
        for g, count in all_sections:
            for _ in range(count):
                for op in g.ops:
                    if op.kind is OpKind.OPTIMIZER:
                        prog.compute(op)
        prog.flush("optimizer_step")
        for g, count in all_sections:
            for _ in range(count):
                for op in g.ops:
                    if op.is_comm and op.phase is Phase.OPTIMIZER:
                        prog.collective(op, blocking=False)
        t = StageTemplate(
            stage=s, pieces=prog.pieces, nodes=prog.counts, flops=prog.flops, kinds=prog.kinds
        )
        templates.append(t)
    kinds = set().union(*(t.kinds for t in templates))
    mesh.register(kinds)
    manifest = {
        "microbatches": m,
        "stage_layers": layers,
        "model_chunks": v,
        "boundary_bytes": boundary_bytes,
        "granularity": cfg.granularity,
        "schedule": "1f1b" if v == 1 else f"interleaved 1f1b, {v} chunks per stage",
        "gradient_sync": "once per step, per layer after its last backward (bucketed); "
        "ZeRO-2/3 reduce-scatter per micro-batch",
        "embedding_sync": (
            "tied word-embedding gradients all-reduced between the first and last stage "
            "before the optimizer step"
            if embedding_sync is not None
            else "none"
        ),
        "send_recv_tags": "2 * (micro_batch * chunks + sender chunk) + (0 activation, 1 gradient)",
    }
    return mesh, templates, manifest


def _embedding_sync(cfg: TraceConfig, graphs) -> tuple[int, int] | None:
    """(bytes, microseconds) of the tied-embedding gradient all-reduce; None when untied."""
    if graphs.tied_head_weight is None:
        return None
    size = embedding_sync_bytes(graphs, cfg.training.grads_dtype.bytes)
    seconds = embedding_sync_time(size, cfg.plan.rank_order)
    subs = _subs(_values(cfg))
    size_bytes = float(sp.sympify(size).xreplace(subs))
    micros = float(sp.sympify(seconds).xreplace(subs)) * 1e6
    return round(size_bytes), max(1, round(micros))


def numbers_boundary(cfg: TraceConfig, graphs) -> int:
    return int(graphs.boundary.local_bytes.xreplace(_subs(_values(cfg))))


# --------------------------------------------------------------------------- stamping
def _rank_bytes(template: StageTemplate, mesh: Mesh, rank: int, header: bytes) -> tuple[bytes, int]:
    slots: dict = {}
    parts = [header]
    for piece in template.pieces:
        if piece.slot is None:
            body = piece.prefix
        else:
            b = slots.get(piece.slot)
            if b is None:
                if isinstance(piece.slot, tuple):
                    _, delta, send = piece.slot
                    peer = mesh.pp_peer(rank, delta)
                    b = enc.attr_int32("comm_dst" if send else "comm_src", peer)
                else:
                    b = enc.attr_string("pg_name", str(mesh.group_id(piece.slot, rank)))
                slots[piece.slot] = b
            body = piece.prefix + b
        parts.append(enc.varint(len(body)))
        parts.append(body)
    data = b"".join(parts)
    return data, len(template.pieces)


def write_ranks(
    out: str, prefix: str, mesh: Mesh, templates: list[StageTemplate], lo: int, hi: int
) -> tuple[int, int, float, float]:
    """Write ``<prefix>.<rank>.et`` for ranks [lo, hi); returns (bytes, files, CPU seconds,
    peak RSS in MiB of the process that wrote them)."""
    import resource
    import time

    cpu0 = time.process_time()
    header = enc.frame(enc.metadata())
    total = 0
    pp_stride = mesh.stride[MeshAxis.PP]
    for rank in range(lo, hi):
        stage = (rank // pp_stride) % mesh.degree[MeshAxis.PP]
        data, _ = _rank_bytes(templates[stage], mesh, rank, header)
        path = os.path.join(out, f"{prefix}.{rank}.et")
        with open(path, "wb") as fh:
            fh.write(data)
        total += len(data)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return total, hi - lo, time.process_time() - cpu0, rss_mib


def write_all_ranks(
    out: Path, prefix: str, mesh: Mesh, templates, executor=None, ranks_per_task: int = 2048
) -> tuple[int, int, float, float]:
    """Every rank file, in this process or as executor tasks over rank ranges; returns
    (bytes, files, CPU seconds of the tasks, their peak RSS in MiB)."""
    ranges = [
        (lo, min(lo + ranks_per_task, mesh.world)) for lo in range(0, mesh.world, ranks_per_task)
    ]
    total_bytes = files = 0
    worker_cpu = worker_rss = 0.0
    if executor is None:
        for lo, hi in ranges:
            b, f, _, _ = write_ranks(str(out), prefix, mesh, templates, lo, hi)
            total_bytes += b
            files += f
        return total_bytes, files, worker_cpu, worker_rss
    mesh_ref, templates_ref = executor.share(mesh), executor.share(templates)
    tasks = [
        (i, (str(out), prefix, mesh_ref, templates_ref, lo, hi))
        for i, (lo, hi) in enumerate(ranges)
    ]
    for _, result in executor.map(write_ranks, tasks):
        if isinstance(result, BaseException):
            raise result
        total_bytes += result[0]
        files += result[1]
        worker_cpu += result[2]
        worker_rss = max(worker_rss, result[3])
    return total_bytes, files, worker_cpu, worker_rss


@dataclass
class TraceSet:
    path: Path
    ranks: int
    bytes: int
    files: int
    nodes_per_stage: list[dict]
    group_ids: int
    warnings: list[str]
    worker_cpu_s: float = 0.0
    """CPU seconds spent in executor tasks (0 when written in this process)."""
    worker_peak_rss_mib: float = 0.0


def group_id_warnings(mesh: Mesh) -> list[str]:
    if mesh.num_group_ids <= ASTRA_SIM_MAX_GROUP_ID:
        return []
    return [
        f"{mesh.num_group_ids} communicator groups: ids above {ASTRA_SIM_MAX_GROUP_ID} "
        "overflow a known simulator (group id x 10^6 in a 32-bit int)"
    ]


def set_counts(
    mesh: Mesh, templates: list[StageTemplate], prefix: str, files: int, total_bytes: int
) -> dict[str, object]:
    """The manifest's sizes of a written trace set (every rank of a stage runs its template)."""
    ranks_per_stage = mesh.world // len(templates)
    return {
        "ranks": mesh.world,
        "file_prefix": prefix,
        "files": files,
        "total_bytes": total_bytes,
        "comm_groups": mesh.num_group_ids,
        "nodes_per_stage": [dict(t.nodes) for t in templates],
        "total_nodes": sum(sum(t.nodes.values()) * ranks_per_stage for t in templates),
        "comp_flops_total": sum(t.flops * ranks_per_stage for t in templates),
    }


def write_trace_set(
    cfg: TraceConfig,
    out: str | os.PathLike,
    prefix: str = "trace",
    executor=None,
    ranks_per_task: int = 2048,
    config_hash: str = "",
) -> TraceSet:
    """Write a full trace set (one file per rank, ``comm_groups.json``, ``manifest.json``)."""
    from stage_dse.trace.check import check_templates

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mesh, templates, facts = build_trace_set(cfg)
    problems = check_templates(templates, mesh)
    if problems:
        raise ConfigError("trace templates failed their checks: " + "; ".join(problems[:5]))
    warnings = group_id_warnings(mesh)
    groups = mesh.groups_json()
    (out / "comm_groups.json").write_text(json.dumps(groups))
    total_bytes, files, worker_cpu, worker_rss = write_all_ranks(
        out, prefix, mesh, templates, executor, ranks_per_task
    )
    pp_stride = mesh.stride[MeshAxis.PP]
    manifest = {
        "stage_dse_version": __version__,
        "config_hash": config_hash,
        "model": cfg.model.name,
        "plan": {
            k: (v.value if hasattr(v, "value") else v)
            for k, v in cfg.plan.__dict__.items()
            if k != "rank_order"
        }
        | {"rank_order": "-".join(a.value for a in cfg.plan.rank_order)},
        "training": {
            "seq_len": cfg.training.seq_len,
            "global_batch_size": cfg.training.global_batch_size,
        },
        "hardware": cfg.hardware.name,
        "cluster": cfg.cluster.name,
        **set_counts(mesh, templates, prefix, files, total_bytes),
        "analytic_flops_total": analytic_flops(cfg),
        "pp_stride": pp_stride,
        "warnings": warnings,
        **facts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return TraceSet(
        out,
        mesh.world,
        total_bytes,
        files,
        manifest["nodes_per_stage"],
        mesh.num_group_ids,
        warnings,
        worker_cpu,
        worker_rss,
    )


def analytic_flops(cfg: TraceConfig) -> int:
    """Sum over all GPUs of their per-step flops, from the cost layer's per-section totals."""
    from stage_dse.cost.derive import section_costs

    graphs = build_graphs(cfg.model, cfg.plan, cfg.training)
    mode = cfg.plan.recompute
    subs = _subs(_values(cfg))

    def num(e) -> float:
        return float(sp.sympify(e).xreplace(subs))

    def per_layer(graph) -> float:
        sc = section_costs(graph)
        return num(sc.compute_flops[mode]) * m + num(sc.optimizer_flops)

    m = cfg.plan.num_microbatches(cfg.training)
    emb = per_layer(graphs.embed)
    head_sc = section_costs(graphs.head, graphs.tied_head_weight)
    head = num(head_sc.compute_flops[mode]) * m + num(head_sc.optimizer_flops)
    block = per_layer(graphs.block)
    dense = per_layer(graphs.dense) if graphs.dense is not None else 0.0
    n_dense = cfg.model.first_dense_layers if graphs.dense is not None else 0
    n_block = cfg.model.num_layers - n_dense
    ranks_per_stage = cfg.plan.num_gpus // cfg.plan.pp
    # every stage's ranks run their layers; summed over stages that is every layer once
    total = emb + head + n_dense * dense + n_block * block
    return round(total * ranks_per_stage)
