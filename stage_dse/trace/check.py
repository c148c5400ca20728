"""Checks that decide whether a simulator can finish a trace set.

``check_templates`` runs on the stage templates before any file is written (cheap: per stage,
not per rank). ``check_trace_dir`` decodes a written set and verifies: unique ids, no dangling
dependency, no cycle, only supported collective types, integer-typed attributes, every SEND
matched by a RECV with the same (src, dst, tag, size), every group's members issuing the same
sequence of (type, size) collectives, overlapping groups ordered alike on their shared ranks,
no cycle in the global order of collective instances (one collective in flight per rank),
COMP nodes a roofline simulator can time (``num_ops`` and ``tensor_size`` positive), no
collective of zero bytes, all-gather sizes that are each rank's input (their ``comm_size`` times
group size summed per rank equals the gathered bytes the writer recorded from the graph), and
the total COMP flops equal to the analytic total of the manifest.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from stage_dse.trace.encode import SUPPORTED_COLLECTIVES, CollType, NodeType, read_trace
from stage_dse.trace.program import MEMORY_ONLY_OPS

__all__ = ["check_templates", "check_trace_dir"]

INT_ATTRS = {
    "num_ops": "int64_val",
    "tensor_size": "uint64_val",
    "comm_type": "int64_val",
    "comm_size": "int64_val",
    "comm_src": "int32_val",
    "comm_dst": "int32_val",
    "comm_tag": "int32_val",
    "is_cpu_op": "bool_val",
    "pg_name": "string_val",
}


def check_templates(templates, mesh) -> list[str]:
    """Per-stage structural checks of the templates (ids, dependencies, acyclicity)."""
    from stage_dse.trace import et_def_pb2 as pb

    problems = []
    for t in templates:
        seen: set[int] = set()
        for piece in t.pieces:
            node = pb.Node()
            node.ParseFromString(piece.prefix)
            if node.id in seen:
                problems.append(f"stage {t.stage}: duplicate node id {node.id}")
            for d in list(node.data_deps) + list(node.ctrl_deps):
                if d not in seen:  # dependencies point backwards: no dangling id, no cycle
                    problems.append(f"stage {t.stage}: node {node.id} depends on {d} not before it")
            seen.add(node.id)
    return problems


def _attrs(node) -> dict:
    out = {}
    for a in node.attr:
        out[a.name] = (a.WhichOneof("value"), getattr(a, a.WhichOneof("value") or "name"))
    return out


def check_trace_dir(path: str | Path, prefix: str | None = None) -> list[str]:
    """Every problem found in a trace set folder (empty: the set is consistent)."""
    path = Path(path)
    problems: list[str] = []
    manifest = (
        json.loads((path / "manifest.json").read_text())
        if (path / "manifest.json").exists()
        else {}
    )
    prefix = prefix or manifest.get("file_prefix", "trace")
    groups = {int(k): v for k, v in json.loads((path / "comm_groups.json").read_text()).items()}
    files = sorted(path.glob(f"{prefix}.*.et"), key=lambda p: int(p.name.split(".")[-2]))
    ranks = [int(p.name.split(".")[-2]) for p in files]
    if ranks != list(range(len(ranks))):
        problems.append("rank files are not numbered 0..N-1")
    sends: Counter = Counter()
    recvs: Counter = Counter()
    coll_seq: dict[int, dict[int, list[tuple[int, int]]]] = defaultdict(dict)
    rank_events: dict[int, list[int]] = {}
    comp_flops = 0
    node_count = 0
    for rank, f in zip(ranks, files):
        meta, nodes = read_trace(f)
        if not meta.version:
            problems.append(f"rank {rank}: GlobalMetadata.version is empty")
        ids: dict[int, list[int]] = {}
        gathered = gathered_tol = 0
        per_group: dict[int, list[tuple[int, int]]] = defaultdict(list)
        events: list[int] = []
        for node in nodes:
            node_count += 1
            if node.id in ids:
                problems.append(f"rank {rank}: duplicate node id {node.id}")
            ids[node.id] = list(node.data_deps) + list(node.ctrl_deps)
            attrs = _attrs(node)
            for name, (kind, _) in attrs.items():
                want = INT_ATTRS.get(name)
                if want and kind != want:
                    problems.append(
                        f"rank {rank} node {node.id}: attr {name} is {kind}, needs {want}"
                    )
            if node.type == NodeType.COMP_NODE:
                num_ops = attrs.get("num_ops", (None, 0))[1]
                if num_ops <= 0 or attrs.get("tensor_size", (None, 0))[1] <= 0:
                    problems.append(
                        f"rank {rank} node {node.id}: COMP node needs num_ops > 0 and "
                        "tensor_size > 0 (a roofline simulator divides one by the other)"
                    )
                comp_flops += num_ops if num_ops > MEMORY_ONLY_OPS else 0
            elif node.type == NodeType.COMM_COLL_NODE:
                ctype = attrs.get("comm_type", (None, -1))[1]
                if ctype not in SUPPORTED_COLLECTIVES:
                    problems.append(
                        f"rank {rank} node {node.id}: unsupported collective type {ctype}"
                    )
                pg = attrs.get("pg_name", (None, ""))[1]
                if not str(pg).isdigit():
                    problems.append(
                        f"rank {rank} node {node.id}: pg_name {pg!r} is not an integer string"
                    )
                    continue
                gid = int(pg)
                if gid not in groups or rank not in groups[gid]:
                    problems.append(f"rank {rank} node {node.id}: not a member of group {gid}")
                size = int(attrs.get("comm_size", (None, 0))[1])
                if size <= 0:
                    problems.append(f"rank {rank} node {node.id}: collective of {size} bytes")
                per_group[gid].append((int(ctype), size))
                events.append(gid)
                if ctype == CollType.ALL_GATHER and gid in groups:
                    gathered += size * len(groups[gid])
                    gathered_tol += len(groups[gid])
            elif node.type == NodeType.COMM_SEND_NODE:
                a = attrs
                sends[(rank, a["comm_dst"][1], a["comm_tag"][1], a["comm_size"][1])] += 1
            elif node.type == NodeType.COMM_RECV_NODE:
                a = attrs
                recvs[(a["comm_src"][1], rank, a["comm_tag"][1], a["comm_size"][1])] += 1
        for nid, deps in ids.items():
            for d in deps:
                if d not in ids:
                    problems.append(f"rank {rank}: node {nid} depends on missing node {d}")
        if _has_cycle(ids):
            problems.append(f"rank {rank}: dependency cycle")
        for gid, seq in per_group.items():
            coll_seq[gid][rank] = seq
        want = _gathered_bytes(manifest, rank)
        if want is not None and abs(gathered - want) > gathered_tol:
            problems.append(
                f"rank {rank}: all-gathers leave {gathered} bytes (comm_size x group size), the "
                f"graph gathers {want}: an all-gather's comm_size must be each rank's input"
            )
        rank_events[rank] = events
    if sends != recvs:
        missing = (sends - recvs) + (recvs - sends)
        problems.append(
            f"{sum(missing.values())} send/recv without a match, e.g. {next(iter(missing))}"
        )
    for gid, by_rank in coll_seq.items():
        members = groups.get(gid, [])
        seqs = {tuple(by_rank.get(r, ())) for r in members if r in rank_events}
        if len(seqs) > 1:
            problems.append(f"group {gid}: members issue different collective sequences")
    # overlapping groups: the interleaving of two groups' collectives agrees on shared ranks
    pair_orders: dict[tuple[int, int], set] = defaultdict(set)
    for events in rank_events.values():
        mine = sorted(set(events))
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                pair_orders[(a, b)].add(tuple(e for e in events if e in (a, b)))
    for (a, b), orders in pair_orders.items():
        if len(orders) > 1:
            problems.append(f"groups {a} and {b} are ordered differently on their shared ranks")
    # one collective in flight per rank: the k-th collective of each group must be orderable
    # globally, i.e. the per-rank orders of collective instances form no cycle
    if _collective_wait_cycle(rank_events):
        problems.append("collective order forms a cycle across ranks (deadlock)")
    if "analytic_flops_total" in manifest:
        want = manifest["analytic_flops_total"]
        if abs(comp_flops - want) > 1e-9 * max(want, 1) + len(ranks):
            problems.append(f"COMP flops {comp_flops} != analytic {want}")
    if manifest.get("total_nodes") not in (None, node_count):
        problems.append(f"{node_count} nodes decoded, manifest says {manifest['total_nodes']}")
    return problems


def _gathered_bytes(manifest: dict, rank: int) -> int | None:
    """The all-gather output bytes the writer recorded for ``rank``'s stage, if it did."""
    per_stage = manifest.get("allgather_output_bytes_per_stage")
    stride, pp = manifest.get("pp_stride"), len(per_stage or ())
    if not per_stage or not stride:
        return None
    return int(per_stage[(rank // stride) % pp])


def _collective_wait_cycle(rank_events: dict[int, list[int]]) -> bool:
    edges: dict[tuple[int, int], set] = defaultdict(set)
    for events in rank_events.values():
        seen: Counter = Counter()
        prev = None
        for gid in events:
            inst = (gid, seen[gid])
            seen[gid] += 1
            edges.setdefault(inst, set())
            if prev is not None:
                edges[prev].add(inst)
            prev = inst
    indeg: Counter = Counter()
    for outs in edges.values():
        for b in outs:
            indeg[b] += 1
    ready = [n for n in edges if indeg[n] == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for b in edges[n]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return done != len(edges)


def _has_cycle(deps: dict[int, list[int]]) -> bool:
    state: dict[int, int] = {}
    for start in deps:
        if state.get(start):
            continue
        stack = [(start, iter(deps[start]))]
        state[start] = 1
        while stack:
            nid, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[nid] = 2
                stack.pop()
                continue
            s = state.get(nxt, 0)
            if s == 1:
                return True
            if s == 0 and nxt in deps:
                state[nxt] = 1
                stack.append((nxt, iter(deps[nxt])))
    return False
