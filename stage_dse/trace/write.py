"""Writing a trace set: per-rank files stamped from stage templates, groups and manifest.

What lives here: :func:`write_trace_set` (templates -> ``<prefix>.<rank>.et`` files,
``comm_groups.json``, ``manifest.json``), the per-rank stamping (every rank of a stage runs the
same template and differs only in its communicator-group ids and pipeline peers, so the cost per
rank is a few hundred small byte joins and memory does not grow with the number of ranks), and
its parallel form over rank ranges as executor tasks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

from stage_dse import __version__
from stage_dse.cost.bind import evaluate_plan
from stage_dse.cost.compile import LLVM_MIN_ROWS, family_for
from stage_dse.cost.key import cost_key
from stage_dse.errors import ConfigError
from stage_dse.spec import MeshAxis
from stage_dse.trace import encode as enc
from stage_dse.trace.build import TraceConfig, analytic_flops, build_trace_set
from stage_dse.trace.mesh import ASTRA_SIM_MAX_GROUP_ID, Mesh
from stage_dse.trace.program import StageTemplate

__all__ = [
    "TraceSet",
    "group_id_warnings",
    "set_counts",
    "write_all_ranks",
    "write_ranks",
    "write_trace_set",
]


class _Stamp:
    """A stage template prepared for stamping: its distinct per-rank slots, the slot of each
    slotted node in order, and per combination of slot-value lengths the constant bytes between
    slotted values (fixed nodes framed and joined; a slotted node's length prefix depends only
    on the length of its value), kept as one bytes format per combination."""

    def __init__(self, template: StageTemplate) -> None:
        self.slots: list = []
        index: dict = {}
        self.seq: list[int] = []
        self.pieces: list = []  # per slotted node: (framed fixed nodes before it, its prefix)
        fixed: list[bytes] = []
        for piece in template.pieces:
            if piece.slot is None:
                fixed.append(enc.varint(len(piece.prefix)) + piece.prefix)
                continue
            if piece.slot not in index:
                index[piece.slot] = len(self.slots)
                self.slots.append(piece.slot)
            self.seq.append(index[piece.slot])
            self.pieces.append((b"".join(fixed), piece.prefix))
            fixed = []
        self.tail = b"".join(fixed)
        self.formats: dict[tuple, bytes] = {}
        # the slotted values of a rank in node order, picked in one C call
        self.pick = (lambda v: ()) if not self.seq else _picker(self.seq)

    def format(self, header: bytes, lengths: tuple[int, ...]) -> bytes:
        """The file as a bytes format: constants with ``%b`` where each slotted value goes
        (filled in one C call per rank)."""
        got = self.formats.get((header, lengths))
        if got is None:
            consts = [
                before + enc.varint(len(prefix) + lengths[k]) + prefix
                for (before, prefix), k in zip(self.pieces, self.seq)
            ]
            consts.append(self.tail)
            consts[0] = header + consts[0]
            got = b"%b".join(c.replace(b"%", b"%%") for c in consts)
            self.formats[(header, lengths)] = got
        return got


def _picker(seq: list[int]):
    pick = itemgetter(*seq)
    if len(seq) == 1:
        return lambda values: (pick(values),)
    return pick


_STAMPS: dict[str, _Stamp] = {}
"""Prepared stamps by template id: a Ray worker keeps them across the tasks of a set (each
task receives its own copy of the templates)."""


def _stamp(template: StageTemplate) -> _Stamp:
    st = _STAMPS.get(template.uid)
    if st is not None:
        return st
    if len(_STAMPS) > 64:  # templates of earlier sets
        _STAMPS.clear()
    st = _STAMPS[template.uid] = _Stamp(template)
    return st


def _rank_bytes(template: StageTemplate, mesh: Mesh, rank: int, header: bytes) -> tuple[bytes, int]:
    st = _stamp(template)
    values = []
    for slot in st.slots:
        if isinstance(slot, tuple):
            _, delta, send = slot
            peer = mesh.pp_peer(rank, delta)
            values.append(enc.attr_int32("comm_dst" if send else "comm_src", peer))
        else:
            values.append(enc.attr_string("pg_name", str(mesh.group_id(slot, rank))))
    return st.format(header, tuple(len(b) for b in values)) % st.pick(values), len(template.pieces)


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
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    for rank in range(lo, hi):
        stage = (rank // pp_stride) % mesh.degree[MeshAxis.PP]
        data, _ = _rank_bytes(templates[stage], mesh, rank, header)
        fd = os.open(os.path.join(out, f"{prefix}.{rank}.et"), flags, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
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
    setup_cpu_s: float = 0.0
    """CPU seconds of this process outside the rank files: templates, checks, groups, manifest
    (the writer's fixed cost per set)."""


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
        "allgather_output_bytes_per_stage": [t.gathered_bytes for t in templates],
    }


def _cost_step_s(cfg: TraceConfig) -> float:
    """The cost model's step time of the set's configuration, from the family's compiled code:
    every set of a family, in every process and Ray worker that writes one, needs it, so the
    family is asked for as for :data:`LLVM_MIN_ROWS` rows (compiled once, kept in the disk
    cache, loaded in milliseconds afterwards) rather than derived again per process."""
    family_for(cost_key(cfg.model, cfg.plan, cfg.training), rows=LLVM_MIN_ROWS)
    step = evaluate_plan(
        cfg.model, cfg.training, cfg.plan, hardware=cfg.hardware, cluster=cfg.cluster
    )["step_s"]
    return float(step)


def write_trace_set(
    cfg: TraceConfig,
    out: str | os.PathLike,
    prefix: str = "trace",
    executor=None,
    ranks_per_task: int = 2048,
    config_hash: str = "",
) -> TraceSet:
    """Write a full trace set (one file per rank, ``comm_groups.json``, ``manifest.json``)."""
    import time

    from stage_dse.trace.check import check_templates

    cpu0 = time.process_time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mesh, templates, facts = build_trace_set(cfg)
    problems = check_templates(templates, mesh)
    if problems:
        raise ConfigError("trace templates failed their checks: " + "; ".join(problems[:5]))
    warnings = group_id_warnings(mesh)
    groups = mesh.groups_json()
    (out / "comm_groups.json").write_text(json.dumps(groups))
    files0 = time.process_time()
    total_bytes, files, worker_cpu, worker_rss = write_all_ranks(
        out, prefix, mesh, templates, executor, ranks_per_task
    )
    files_cpu = time.process_time() - files0
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
        "cost_step_s": _cost_step_s(cfg),
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
        time.process_time() - cpu0 - files_cpu,
    )
