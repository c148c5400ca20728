"""The simulator farm: selected result rows through network simulators, results beside the rows.

What lives here: :func:`simulate` (the driver: select rows as ``stage-dse-trace select`` does,
write the trace sets that are missing, run every requested backend on every row as executor
tasks, store one ``_sim`` row per result row and backend as results come back) and
:func:`run_job` (one row's task: write its set if needed, then each backend). The stored
columns are :data:`stage_dse.results.sim.SIM_SCHEMA`; the simulator inputs are
:mod:`stage_dse.trace.astra_config`.

Backends:

* ``replay``: :func:`stage_dse.trace.replay.replay_trace_dir`, the project's critical-path
  replay of the trace with its own durations (always available; one rank per pipeline stage
  is replayed, the others run the same template, so a set that replays finishes every rank);
* ``astra_unaware`` / ``astra_aware``: ASTRA-sim's analytical network backends, congestion-
  unaware and congestion-aware, when a folder holding their binaries is given (``astra_bin``
  or the environment variable ``STAGE_DSE_ASTRA_BIN``). A run succeeds only if every rank
  prints ``sys[i] finished, C cycles`` (1 cycle = 1 ns) and the process exits 0.

A backend that crashes, exceeds ``timeout_s``, finishes fewer ranks than the set has or prints
nothing is a ``failed`` row with the reason and its log, never a lost row. Rerunning skips the
(row, backend) pairs already stored (``retry_failed`` runs the failed ones again, replacing
their rows); a killed farm loses at most the runs in flight and those not yet flushed.
Trace sets are written under ``<results>/_traces/<config_hash>/`` as by ``select`` (a set whose
manifest is there is reused), simulator inputs and logs under
``<results>/_sim/_runs/<config_hash>/<backend>/``. On a Ray cluster every node must see the
results folder at the same path (a shared filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from stage_dse.errors import ConfigError, StageDseError
from stage_dse.results.sim import RUNS_DIR, SimStore
from stage_dse.trace.astra_config import ASTRA_BACKENDS, astra_config, write_astra_config
from stage_dse.trace.build import TraceConfig
from stage_dse.trace.select import (
    TRACES_DIR,
    check_size,
    config_from_row,
    estimate_trace_bytes,
    select_rows,
)

__all__ = ["ASTRA_BIN_ENV", "BACKENDS", "SimJob", "SimSummary", "run_job", "simulate"]

BACKENDS = ("replay", *ASTRA_BACKENDS)
ASTRA_BIN_ENV = "STAGE_DSE_ASTRA_BIN"
FLUSH_ROWS = 32
FLUSH_S = 10.0
_FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class SimJob:
    """One result row's task: its trace set (written first when ``write``) and backends."""

    config_hash: str
    results: str
    trace_config: TraceConfig
    backends: tuple[str, ...]
    step_s: float
    write: bool = False
    astra_bin: str | None = None
    timeout_s: float = 600.0
    compute: str = "replay"
    run_id: str = ""

    @property
    def trace_dir(self) -> Path:
        return Path(self.results) / TRACES_DIR / self.config_hash


@dataclass
class _Outcome:
    status: str
    reason: str | None = None
    step_s: float | None = None
    finished: int = 0
    ranks: int = 0
    log: Path | None = None
    cpu_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class SimSummary:
    rows: int = 0
    """Result rows selected."""
    skipped: int = 0
    """(row, backend) pairs stored already."""
    ok: int = 0
    failed: int = 0
    written_sets: int = 0
    task_cpu_s: float = 0.0
    """CPU seconds of the tasks (trace writing and simulator runs), wherever they ran."""
    task_wall_s: float = 0.0
    """Wall seconds the tasks ran: over ``wall_s`` x workers, how full the farm kept them."""
    wall_s: float = 0.0
    ratios: dict[str, list[float]] = field(default_factory=dict)


def _cpu_children() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"error|critical|abort|fault|terminate|what\(\)", ln, re.IGNORECASE):
            return ln[:200]
    return lines[-1][:200] if lines else ""


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def run_replay(trace_dir: Path, run_dir: Path) -> _Outcome:
    from stage_dse.trace.replay import replay_trace_dir

    cpu0, t0 = time.process_time(), time.perf_counter()
    log = run_dir / "replay.log"
    ranks = _manifest(trace_dir).get("ranks", 0)
    try:
        r = replay_trace_dir(trace_dir)
    except Exception as exc:  # a set that does not replay is a failed row, with the reason
        reason = str(exc) if isinstance(exc, StageDseError) else f"{type(exc).__name__}: {exc}"
        log.write_text(f"failed: {reason}\n")
        out = _Outcome("failed", reason, ranks=ranks, log=log)
    else:
        log.write_text(
            f"replay_step_s={r.step_s:.9g} simulated_ranks={r.simulated_ranks} nodes={r.nodes} "
            f"rank_finish_s={json.dumps({str(k): v for k, v in r.rank_finish_s.items()})}\n"
        )
        out = _Outcome("ok", None, r.step_s, ranks, ranks, log)
    out.cpu_s, out.wall_s = time.process_time() - cpu0, time.perf_counter() - t0
    return out


def run_astra(
    binary: Path,
    backend: str,
    cfg: TraceConfig,
    trace_dir: Path,
    run_dir: Path,
    timeout_s: float,
    compute: str = "replay",
) -> _Outcome:
    """One ASTRA-sim run of a trace set; every way it can go wrong is a failed outcome."""
    manifest = _manifest(trace_dir)
    ranks = int(manifest.get("ranks", 0))
    groups_path = trace_dir / "comm_groups.json"
    try:
        groups = {int(k): v for k, v in json.loads(groups_path.read_text()).items()}
        conf = astra_config(cfg.hardware, cfg.cluster, ranks, backend, compute, groups)
    except (OSError, ValueError) as exc:
        return _Outcome("failed", f"no simulator input: {exc}", ranks=ranks)
    paths = write_astra_config(conf, run_dir)
    log = run_dir / "run.log"
    cmd = [
        str(binary),
        f"--workload-configuration={trace_dir / manifest.get('file_prefix', 'trace')}",
        f"--comm-group-configuration={groups_path}",
        f"--system-configuration={paths['system']}",
        f"--network-configuration={paths['network']}",
        f"--remote-memory-configuration={paths['memory']}",
        f"--logging-folder={run_dir / 'log'}",
    ]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    cpu0, t0 = _cpu_children(), time.perf_counter()
    timed_out = False
    with open(log, "wb") as fh:
        try:
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=run_dir, start_new_session=True
            )
        except OSError as exc:
            return _Outcome(
                "failed", f"cannot start {binary}: {exc.strerror}", ranks=ranks, log=log
            )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the simulator alone
            rc = proc.wait()
    out = _Outcome("failed", ranks=ranks, log=log)
    out.cpu_s, out.wall_s = _cpu_children() - cpu0, time.perf_counter() - t0
    text = log.read_text(errors="replace")
    finished = {int(i): int(c) for i, c in _FINISHED.findall(_ANSI.sub("", text))}
    out.finished = len(finished)
    whole = ranks > 0 and set(finished) >= set(range(ranks))
    if whole:
        out.step_s = max(finished.values()) * 1e-9
    if timed_out:
        out.reason = f"timed out after {timeout_s:g} s ({len(finished)} of {ranks} ranks finished)"
    elif not text.strip():
        out.reason = f"printed nothing ({_exit_text(rc)})"
    elif rc != 0:
        out.reason = (
            f"{_exit_text(rc)} after {len(finished)} of {ranks} ranks finished: {_last_line(text)}"
        )
    elif not whole:
        out.reason = (
            f"{len(finished)} of {ranks} ranks finished (the simulator exits 0 on a deadlock): "
            f"{_last_line(text)}"
        )
    else:
        out.status = "ok"
        out.reason = "; ".join(conf.notes) or None
    return out


def _manifest(trace_dir: Path) -> dict:
    try:
        return json.loads((trace_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def has_trace_set(trace_dir: Path, config_hash: str) -> bool:
    """A finished set of this row is there (its manifest is written last)."""
    return _manifest(trace_dir).get("config_hash") == config_hash


def run_job(job: SimJob) -> dict:
    """Write the row's set if asked, then run each backend; never raises for a backend."""
    from stage_dse.trace.write import write_trace_set

    wall0 = time.perf_counter()
    out: dict = {"config_hash": job.config_hash, "written": False, "rows": [], "cpu_s": 0.0}
    trace_dir = job.trace_dir
    base = Path(job.results) / "_sim" / RUNS_DIR / job.config_hash
    outcomes: dict[str, _Outcome] = {}
    if job.write:
        cpu0 = time.process_time()
        try:
            write_trace_set(job.trace_config, trace_dir, config_hash=job.config_hash)
        except Exception as exc:  # recorded on every backend's row
            shutil.rmtree(trace_dir, ignore_errors=True)
            reason = str(exc) if isinstance(exc, StageDseError) else f"{type(exc).__name__}: {exc}"
            for b in job.backends:
                outcomes[b] = _Outcome("failed", f"trace set not written: {reason}")
        else:
            out["written"] = True
        out["cpu_s"] += time.process_time() - cpu0
    for backend in job.backends:
        if backend in outcomes:
            continue
        run_dir = base / backend
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        if backend == "replay":
            outcomes[backend] = run_replay(trace_dir, run_dir)
        else:
            binary = Path(job.astra_bin or "") / ASTRA_BACKENDS[backend]
            outcomes[backend] = run_astra(
                binary, backend, job.trace_config, trace_dir, run_dir, job.timeout_s, job.compute
            )
    if out["written"]:
        if "replay" in outcomes and outcomes["replay"].status == "ok":
            out["trace_replay_s"] = outcomes["replay"].step_s
        else:
            from stage_dse.trace.replay import replay_trace_dir

            try:
                out["trace_replay_s"] = replay_trace_dir(trace_dir).step_s
            except StageDseError:
                out["trace_replay_s"] = None
    for backend, o in outcomes.items():
        out["cpu_s"] += o.cpu_s
        out["rows"].append(
            {
                "config_hash": job.config_hash,
                "sim_backend": backend,
                "sim_status": o.status,
                "sim_reason": o.reason,
                "sim_step_s": o.step_s,
                "sim_ratio": o.step_s / job.step_s if o.step_s and job.step_s > 0 else None,
                "sim_finished_ranks": o.finished,
                "sim_ranks": o.ranks,
                "sim_compute": "replay" if backend == "replay" else job.compute,
                "sim_log_path": str(o.log.relative_to(job.results)) if o.log else None,
                "sim_wall_s": o.wall_s,
                "sim_cpu_s": o.cpu_s,
                "sim_run_id": job.run_id,
            }
        )
    out["wall_s"] = time.perf_counter() - wall0
    return out


def astra_bin_folder(astra_bin: str | None) -> Path | None:
    """The folder of the ASTRA-sim binaries: ``astra_bin``, else ``$STAGE_DSE_ASTRA_BIN``."""
    value = astra_bin or os.environ.get(ASTRA_BIN_ENV) or None
    if value is None:
        return None
    folder = Path(value)
    if not folder.is_dir():
        raise ConfigError(
            f"--astra-bin {value}: not a folder (give the folder holding "
            f"{', '.join(ASTRA_BACKENDS.values())}, or set {ASTRA_BIN_ENV})"
        )
    return folder


def resolve_backends(backends: list[str] | None, astra_bin: Path | None) -> tuple[str, ...]:
    """The backends to run: those asked for, else replay plus every ASTRA-sim binary found."""
    if not backends:
        found = [
            b for b, exe in ASTRA_BACKENDS.items() if astra_bin and (astra_bin / exe).is_file()
        ]
        return ("replay", *found)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"--backend {unknown[0]!r} is not one of: {', '.join(BACKENDS)}")
    for b in backends:
        if b in ASTRA_BACKENDS:
            if astra_bin is None:
                raise ConfigError(
                    f"--backend {b} needs ASTRA-sim: give --astra-bin FOLDER or set {ASTRA_BIN_ENV}"
                )
            exe = astra_bin / ASTRA_BACKENDS[b]
            if not (exe.is_file() and os.access(exe, os.X_OK)):
                raise ConfigError(f"--backend {b}: no executable {exe} (build ASTRA-sim first)")
    return tuple(dict.fromkeys(backends))


def simulate(
    results: str | os.PathLike,
    top: int | None = None,
    by: str = "step_s",
    where: str | None = None,
    hashes: list[str] | None = None,
    run: str | None = None,
    max_bytes: int = 2**31,
    backends: list[str] | None = None,
    astra_bin: str | None = None,
    timeout_s: float = 600.0,
    compute: str = "replay",
    executor=None,
    granularity: str = "segment",
    retry_failed: bool = False,
    log=print,
) -> SimSummary:
    """Simulate the selected rows (see the module doc); returns what was done."""
    from stage_dse.results.store import ResultStore, new_run_id
    from stage_dse.runner.executors import LocalExecutor

    if not timeout_s > 0:
        raise ConfigError(f"--timeout-s must be > 0, got {timeout_s}")
    if compute not in ("replay", "roofline"):
        raise ConfigError(f"--compute {compute!r} is not one of: replay, roofline")
    results = Path(results).resolve()
    folder = astra_bin_folder(astra_bin)
    chosen_backends = resolve_backends(backends, folder)
    _, chosen = select_rows(results, top, by, where, hashes, run)
    sim = SimStore(results)
    sim.acquire()
    t0 = time.perf_counter()
    summary = SimSummary(rows=len(chosen))
    try:
        skip = sim.keys() - (sim.keys("failed") if retry_failed else set())
        run_id = new_run_id()
        jobs: list[SimJob] = []
        to_write = []
        for _, row in chosen.iterrows():
            h = str(row["config_hash"])
            todo = tuple(b for b in chosen_backends if (h, b) not in skip)
            summary.skipped += len(chosen_backends) - len(todo)
            if not todo:
                continue
            try:
                cfg = config_from_row(row, granularity)
            except ConfigError as exc:
                raise ConfigError(f"row {h}: {exc}") from None
            write = not has_trace_set(results / TRACES_DIR / h, h)
            if write:
                to_write.append(row)
            jobs.append(
                SimJob(
                    h,
                    str(results),
                    cfg,
                    todo,
                    float(row["step_s"]),
                    write,
                    str(folder or ""),
                    timeout_s,
                    compute,
                    run_id,
                )
            )
        if summary.skipped:
            log(f"{summary.skipped} (row, backend) runs already stored in {sim.root}: skipped")
        if to_write:
            estimate = sum(estimate_trace_bytes(r) for r in to_write)
            check_size(estimate, len(to_write), max_bytes, log)
        if jobs:
            log(f"simulating {len(jobs)} rows on {', '.join(chosen_backends)}")
            _run(jobs, executor or LocalExecutor(), sim, ResultStore(results), summary, log)
    finally:
        sim.release()
        summary.wall_s = time.perf_counter() - t0
    log(
        f"{summary.ok} runs ok, {summary.failed} failed, {summary.skipped} skipped; "
        f"{summary.written_sets} trace sets written; {summary.task_cpu_s:.1f} CPU-s in tasks, "
        f"{summary.wall_s:.1f} s wall; results in {sim.root}"
    )
    return summary


def _run(jobs: list[SimJob], executor, sim: SimStore, store, summary: SimSummary, log) -> None:
    pending_rows: list[dict] = []
    trace_dirs: dict[str, str] = {}
    replays: dict[str, float] = {}
    last = time.perf_counter()

    def flush() -> None:
        nonlocal last
        sim.write(pending_rows)
        pending_rows.clear()
        if trace_dirs:
            store.set_column("trace_dir", dict(trace_dirs))
            store.set_column("trace_replay_s", dict(replays))
            trace_dirs.clear()
            replays.clear()
        last = time.perf_counter()

    by_id = dict(enumerate(jobs))
    try:
        for tid, result in executor.map(run_job, [(i, (j,)) for i, j in by_id.items()]):
            job = by_id[tid]
            if isinstance(result, BaseException):  # the worker died beyond its retries
                reason = f"worker failed: {type(result).__name__}: {str(result)[:200]}"
                result = {
                    "written": False,
                    "cpu_s": 0.0,
                    "rows": [
                        {
                            "config_hash": job.config_hash,
                            "sim_backend": b,
                            "sim_status": "failed",
                            "sim_reason": reason,
                            "sim_finished_ranks": 0,
                            "sim_run_id": job.run_id,
                        }
                        for b in job.backends
                    ],
                }
            if result["written"]:
                summary.written_sets += 1
                trace_dirs[job.config_hash] = f"{TRACES_DIR}/{job.config_hash}"
                replays[job.config_hash] = result.get("trace_replay_s")
            summary.task_cpu_s += result["cpu_s"]
            summary.task_wall_s += result.get("wall_s", 0.0)
            for row in result["rows"]:
                pending_rows.append(row)
                b = row["sim_backend"]
                if row["sim_status"] == "ok":
                    summary.ok += 1
                    if row["sim_ratio"] is not None:
                        summary.ratios.setdefault(b, []).append(row["sim_ratio"])
                    ratio = row["sim_ratio"]
                    ratio_text = f"{ratio:.4f}" if ratio is not None else "n/a"
                    log(f"{job.config_hash} {b}: {row['sim_step_s']:.6g} s, ratio {ratio_text}")
                else:
                    summary.failed += 1
                    log(f"{job.config_hash} {b}: failed: {row['sim_reason']}")
            if len(pending_rows) >= FLUSH_ROWS or time.perf_counter() - last > FLUSH_S:
                flush()
    finally:  # Ctrl-C or an error: keep every finished run
        flush()
