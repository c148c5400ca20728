"""Critical-path replay of a trace set: the project's own check that a trace encodes the
schedule the cost model assumes.

What lives here: :func:`replay_trace_dir`, which walks every simulated rank's dependency graph
with the durations already in the trace (``duration_micros``, written from the cost model's
per-op times) and returns the time the last node finishes.

Rules, deliberately those of the closed form and nothing more (a network simulator such as
ASTRA-sim adds congestion, link sharing and its own collective algorithms on top):

* a COMP node starts when its dependencies have finished and takes its duration (the trace
  chains a rank's kernels, so they never overlap one another);
* a collective starts when every member has reached it *and* the previous collective on the
  same communicator has finished (one NCCL stream per communicator: collectives of one group
  run in issue order, collectives of different groups run side by side), then takes its
  duration; every member finishes it together;
* a send and its matching receive (same source, destination and tag, matched in order) finish
  together, their duration after the later of the two is ready.

Symmetry: every rank of a pipeline stage runs the same template and differs only in its
group ids and peers (:mod:`stage_dse.trace.write`), so by default only one rank per stage is
simulated (coordinate 0 on every other mesh axis); a group's other members reach each
collective when the simulated member does. ``all_ranks=True`` simulates every rank.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from stage_dse.errors import ConfigError
from stage_dse.trace.encode import read_trace
from stage_dse.trace.et_def_pb2 import NodeType

__all__ = ["ReplayResult", "replay_trace_dir"]

_COMP, _COLL = NodeType.COMP_NODE, NodeType.COMM_COLL_NODE
_SEND, _RECV = NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE


@dataclass(frozen=True)
class ReplayResult:
    step_s: float
    """When the last node of any simulated rank finishes."""
    rank_finish_s: dict[int, float]
    simulated_ranks: int
    nodes: int
    cost_step_s: float | None
    """The cost model's step time, as the trace writer recorded it."""


@dataclass
class _Rank:
    ids: list[int]
    kind: list[int]
    dur: list[float]
    deps: list[list[int]]
    """Dependencies as indices into this rank's node list."""
    key: list[object]
    """Collective: (group id, occurrence); send/recv: (src, dst, tag, occurrence)."""


def _parse(path: Path, rank: int) -> _Rank:
    _, nodes = read_trace(path)
    r = _Rank([], [], [], [], [])
    index: dict[int, int] = {}
    coll_seen: dict[int, int] = defaultdict(int)
    p2p_seen: dict[tuple, int] = defaultdict(int)
    raw_deps = []
    for n in nodes:
        index[n.id] = len(r.ids)
        r.ids.append(n.id)
        r.kind.append(n.type)
        r.dur.append(n.duration_micros * 1e-6)
        raw_deps.append(list(n.data_deps) + list(n.ctrl_deps))
        key = None
        if n.type in (_COLL, _SEND, _RECV):
            a = {x.name: x for x in n.attr}
            if n.type == _COLL:
                gid = int(a["pg_name"].string_val)
                key = (gid, coll_seen[gid])
                coll_seen[gid] += 1
            else:
                if n.type == _SEND:
                    pair = (rank, a["comm_dst"].int32_val, a["comm_tag"].int32_val)
                else:
                    pair = (a["comm_src"].int32_val, rank, a["comm_tag"].int32_val)
                key = (*pair, p2p_seen[pair])
                p2p_seen[pair] += 1
        r.key.append(key)
    for deps in raw_deps:
        try:
            r.deps.append([index[d] for d in deps])
        except KeyError as exc:
            raise ConfigError(f"{path}: a node depends on missing node {exc.args[0]}") from None
    return r


def _rank_files(path: Path, prefix: str, manifest: dict) -> dict[int, Path]:
    """Every rank's file, checked against the manifest: ranks 0..N-1 all present and, when
    the manifest records it, the bytes it says were written (a truncated or rewritten file
    changes them)."""
    files: dict[int, Path] = {}
    for p in path.glob(f"{prefix}.*.et"):
        rank = p.name[len(prefix) + 1 : -3]
        if not rank.isdigit():
            raise ConfigError(f"{p}: not a rank file name ({prefix}.<rank>.et)")
        files[int(rank)] = p
    if not files:
        raise ConfigError(f"{path} holds no {prefix}.<rank>.et files")
    world = int(manifest.get("ranks", max(files) + 1))
    missing = [r for r in range(world) if r not in files]
    extra = sorted(r for r in files if r >= world)
    if missing or extra:
        what = (
            f"{len(missing)} of {world} rank files missing (first: {prefix}.{missing[0]}.et)"
            if missing
            else f"rank files beyond the {world} ranks of its manifest ({prefix}.{extra[0]}.et)"
        )
        raise ConfigError(f"{path}: {what}; write the set again")
    want = manifest.get("total_bytes")
    if want is not None:
        got = sum(p.stat().st_size for p in files.values())
        if got != int(want):
            raise ConfigError(
                f"{path}: rank files hold {got} bytes, the manifest says {want}: a file is "
                "truncated or was changed; write the set again (stage-dse-trace check DIR "
                "names the file)"
            )
    return files


def _check_counts(ranks: dict[int, _Rank], manifest: dict, files: dict[int, Path]) -> None:
    """Each simulated rank holds the nodes of its stage's template, by type, as written."""
    per_stage = manifest.get("nodes_per_stage")
    stride, pp = manifest.get("pp_stride"), manifest.get("plan", {}).get("pp")
    if not per_stage or not stride or not pp or len(per_stage) != pp:
        return
    names = {int(_COMP): "COMP_NODE", int(_COLL): "COMM_COLL_NODE"}
    names |= {int(_SEND): "COMM_SEND_NODE", int(_RECV): "COMM_RECV_NODE"}
    for r, x in ranks.items():
        got: dict[str, int] = defaultdict(int)
        for k in x.kind:
            got[names.get(int(k), str(k))] += 1
        want = {k: v for k, v in per_stage[(r // stride) % pp].items() if v}
        if dict(got) != want:
            raise ConfigError(
                f"{files[r]}: {sum(got.values())} nodes, its stage was written with "
                f"{sum(want.values())} (by type {dict(got)} vs {want}): the file is corrupted; "
                "write the set again"
            )


def replay_trace_dir(path: str | Path, all_ranks: bool = False) -> ReplayResult:
    """Replay a trace set folder (see the module doc for the rules)."""
    path = Path(path)
    if not (path / "comm_groups.json").is_file():
        raise ConfigError(f"{path} is not a trace set folder (no comm_groups.json)")
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    prefix = manifest.get("file_prefix", "trace")
    groups = {int(k): v for k, v in json.loads((path / "comm_groups.json").read_text()).items()}
    files = _rank_files(path, prefix, manifest)
    world = len(files)
    stride = manifest.get("pp_stride")
    pp = manifest.get("plan", {}).get("pp")
    if all_ranks or not stride or not pp:
        simulated = sorted(files)
    else:
        simulated = [s * stride for s in range(pp) if s * stride < world]
    sim = set(simulated)
    ranks = {r: _parse(files[r], r) for r in simulated}
    _check_counts(ranks, manifest, files)

    finish: dict[int, list[float | None]] = {r: [None] * len(x.ids) for r, x in ranks.items()}
    waiting: dict[int, list[int]] = {r: [len(d) for d in x.deps] for r, x in ranks.items()}
    users: dict[int, list[list[int]]] = {}
    for r, x in ranks.items():
        u: list[list[int]] = [[] for _ in x.ids]
        for i, deps in enumerate(x.deps):
            for d in deps:
                u[d].append(i)
        users[r] = u
    members = {gid: [m for m in ms if m in sim] for gid, ms in groups.items()}
    arrivals: dict[tuple, list[tuple[int, int, float]]] = defaultdict(list)
    group_free: dict[int, float] = defaultdict(float)
    group_next: dict[int, int] = defaultdict(int)
    p2p: dict[tuple, list[tuple[int, int, float]]] = defaultdict(list)
    queue: list[tuple[int, int]] = [
        (r, i) for r, x in ranks.items() for i, d in enumerate(x.deps) if not d
    ]

    def done(r: int, i: int, t: float) -> None:
        finish[r][i] = t
        for j in users[r][i]:
            waiting[r][j] -= 1
            if waiting[r][j] == 0:
                queue.append((r, j))

    def start_ready_collectives(gid: int) -> None:
        # issue order per communicator: instance k runs after k-1, once all members arrived
        while True:
            key = (gid, group_next[gid])
            got = arrivals.get(key)
            if got is None or len(got) < len(members[gid]):
                return
            begin = max(max(t for _, _, t in got), group_free[gid])
            end = begin + max(ranks[r].dur[i] for r, i, _ in got)
            for r, i, _ in got:
                done(r, i, end)
            del arrivals[key]
            group_free[gid] = end
            group_next[gid] += 1

    count = 0
    while queue:
        r, i = queue.pop()
        count += 1
        x = ranks[r]
        ready = max((finish[r][d] for d in x.deps[i]), default=0.0)
        kind = x.kind[i]
        if kind == _COLL:
            gid = x.key[i][0]
            if gid not in members or r not in groups[gid]:
                raise ConfigError(f"rank {r} node {x.ids[i]}: not a member of group {gid}")
            arrivals[x.key[i]].append((r, i, ready))
            start_ready_collectives(gid)
        elif kind in (_SEND, _RECV):
            src, dst, tag, k = x.key[i]
            if src not in sim or dst not in sim:
                # the peer is a symmetric copy of a simulated rank's stage: not simulated
                done(r, i, ready + x.dur[i])
                continue
            pair = p2p[(src, dst, tag, k)]
            pair.append((r, i, ready))
            if len(pair) == 2:
                end = max(t for _, _, t in pair) + max(ranks[q].dur[j] for q, j, _ in pair)
                for q, j, _ in pair:
                    done(q, j, end)
                del p2p[(src, dst, tag, k)]
        else:
            done(r, i, ready + x.dur[i])
    stuck = [(r, x.ids[i]) for r, x in ranks.items() for i, t in enumerate(finish[r]) if t is None]
    if stuck:
        r, nid = stuck[0]
        raise ConfigError(
            f"replay of {path} stalls: {len(stuck)} nodes never run (first: rank {r} node "
            f"{nid}); a collective or send/recv has no match, or the order deadlocks"
        )
    rank_finish = {r: max(f, default=0.0) for r, f in finish.items()}
    return ReplayResult(
        step_s=max(rank_finish.values()),
        rank_finish_s=rank_finish,
        simulated_ranks=len(simulated),
        nodes=count,
        cost_step_s=manifest.get("cost_step_s"),
    )
