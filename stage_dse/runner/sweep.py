"""The sweep driver: enumerate, skip what is done, evaluate in batches, write part files.

What lives here: :func:`run_grid` (exhaustive search over a
:class:`~stage_dse.spec.sweep.SweepSpec`) and the summary a user sees. It is the only code that
writes results. It takes an executor, so the same sweep runs in-process or on Ray.

The summary is never computed by reading the dataset back: each task sends, with its encoded
part, the partial aggregates of its rows (:mod:`stage_dse.runner.aggregate`), which the driver
merges; a resumed sweep adds the rows it reused by a scan of the folder filtered on their
``config_hash`` and projected to the summary's columns. The driver's memory is then a few
blocks, whatever the sweep's size.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from stage_dse.cost.bind import fp8_recipe_values
from stage_dse.results.schema import config_hash_u64
from stage_dse.results.store import ResultStore, among, as_arrow, new_run_id
from stage_dse.runner.aggregate import SUMMARY_COLUMNS, TIE_REL, RunSummary
from stage_dse.runner.evaluate import (
    Block,
    block_configs,
    block_plans,
    error_rows,
    evaluate_part,
)
from stage_dse.runner.executors import Executor
from stage_dse.search.space import enumerate_plans
from stage_dse.spec.sweep import SweepSpec

__all__ = [
    "TIE_REL",
    "SweepReport",
    "SweepSpec",
    "build_table",
    "rows_of_run",
    "run_grid",
    "tables_notes",
    "top_table",
]

GIB = 2.0**30


@dataclass
class SweepReport:
    name: str
    candidates: int = 0
    valid: int = 0
    skipped: int = 0
    evaluated: int = 0
    rejected: Counter = field(default_factory=Counter)
    status: Counter = field(default_factory=Counter)
    infeasible_reasons: Counter = field(default_factory=Counter)
    trial_states: Counter = field(default_factory=Counter)
    """Optuna searches: trials by final state."""
    seconds: float = 0.0
    run_id: str = ""
    """Recorded in the ``run_id`` column of every row this run evaluated."""
    runner: str = ""
    """Where the run evaluated, and why there (``runner=auto``)."""
    summary: RunSummary | None = None
    """What the summary shows, over this sweep's configurations: the rows this run evaluated
    (aggregated as they streamed by) and, on a resumed sweep, the stored rows it reused."""
    folder_rows: int = 0
    """Rows in the results folder once the run ended (any run's, from the part footers)."""


def _chunks(spec: SweepSpec) -> Iterator[tuple[pd.DataFrame, int, Counter]]:
    """Valid plans per (model, hardware, GPU count), as enumerated."""
    for model in spec.models:
        for hw in spec.hardware:
            for n in spec.gpu_counts:
                cluster = spec.cluster.replace(num_gpus=n)
                e = enumerate_plans(model, spec.training, hw, cluster, spec.space)
                if len(e.table) and spec.memory_limit_bytes is not None:
                    e.table["usable_memory"] = float(spec.memory_limit_bytes)
                yield e.table, e.candidates, e.rejected


def build_table(spec: SweepSpec) -> tuple[pd.DataFrame, int, Counter]:
    """All valid plans of the sweep as one plan table, with candidate and rejection counts."""
    tables, candidates, rejected = [], 0, Counter()
    for table, c, r in _chunks(spec):
        candidates += c
        rejected.update(r)
        if len(table):
            tables.append(table)
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    return table, candidates, rejected


def family_keys(spec: SweepSpec) -> list:
    """The compiled families a sweep can need (structure of models x plan space)."""
    from itertools import product

    from stage_dse.cost.key import cost_key
    from stage_dse.spec import ParallelPlan

    sp = spec.space
    tp_many = isinstance(sp.tp, str) or any(t > 1 for t in sp.tp)
    pp_many = isinstance(sp.pp, str) or any(p > 1 for p in sp.pp)
    hybrid = sorted({g > 0 for g in sp.shard_group})
    keys = set()
    for model in spec.models:
        for fw, zero, rc, seq_par, att, v, base, order, replicas in product(
            sp.frameworks,
            sp.zero_stage,
            sp.recompute,
            sp.sequence_parallel,
            sp.attention,
            sorted({min(v, 2) for v in sp.virtual_stages}),
            list(dict.fromkeys(sp.schedule)),
            sp.rank_order,
            [2 if h else 1 for h in hybrid],
        ):
            piped = v > 1 or base != "1f1b"
            if (seq_par and not tp_many) or (piped and not pp_many):
                continue
            if base != "1f1b" and v > 1:
                continue
            if replicas > 1 and zero == 0:
                continue
            plan = ParallelPlan(
                dp=replicas,
                dp_replicate=replicas,
                tp=2 if seq_par else 1,
                pp=2 if piped else 1,
                zero_stage=zero,
                recompute=rc,
                sequence_parallel=seq_par,
                attention=att,
                schedule="interleaved" if v > 1 else base,
                virtual_stages=v,
                rank_order=order,
                **fw.plan_flags(),
            )
            keys.add(cost_key(model, plan, fw.step(spec.training)))
    return sorted(keys, key=repr)


def run_grid(
    spec: SweepSpec,
    executor: Executor,
    store: ResultStore,
    batch_size: int = 50_000,
    progress: bool = True,
    log: Callable[[str], None] = print,
    top_k: int = 10,
) -> SweepReport:
    """Evaluate every valid plan of ``spec`` not yet in ``store``; write one part per block.

    The driver only counts (printed before anything is evaluated) and cuts each enumeration into
    blocks as it goes: ``batch_size`` rows in this process, on Ray as many as the measured rate
    asks for (:meth:`~stage_dse.runner.executors.RayExecutor.block_rows`). Each executor task
    rebuilds its block, hashes it, drops rows already stored, evaluates the rest and returns
    them encoded as one Parquet part with their summary partial (the ``top_k`` best kept),
    which the driver writes atomically from a background thread and merges into
    ``report.summary``.
    """
    replaced = store.prepare(log)
    try:
        store.check_workload("training", log)
        return _run_grid(spec, executor, store, batch_size, progress, log, replaced, top_k)
    finally:
        store.release()


def _start_and_compile(executor, keys: list, plans: int, log) -> None:
    """Start the executor (Ray: start or join the cluster) and, when the families will meet
    enough rows to repay it, compile them ahead of the evaluation; each phase is logged with
    its time, so nothing is silent for long."""
    from stage_dse.cost.compile import LLVM_MIN_ROWS

    t = time.perf_counter()
    started = executor.start()
    if started:
        log(f"  started {started} in {time.perf_counter() - t:.1f} s")
    if executor.name != "local" and plans / max(1, len(keys)) >= LLVM_MIN_ROWS:
        t = time.perf_counter()
        executor.compile(keys)
        log(f"  compiled up to {len(keys)} plan families in {time.perf_counter() - t:.1f} s")


def unique_axes(spec: SweepSpec) -> tuple[SweepSpec, list[str]]:
    """``spec`` with each repeated model, hardware and GPU count once (the same configurations
    twice would be evaluated and stored twice), and what was merged."""
    changes, notes = {}, []
    for field_name, label, key in (
        ("gpu_counts", "num_gpus", lambda v: v),
        ("models", "models", lambda m: m),
        ("hardware", "hardware", lambda h: h),
    ):
        values = getattr(spec, field_name)
        unique = []
        for v in values:
            if not any(key(v) == key(u) for u in unique):
                unique.append(v)
        if len(unique) < len(values):
            changes[field_name] = tuple(unique)
            shown = [getattr(v, "name", v) for v in values]
            notes.append(f"{label} {shown} evaluated as {[getattr(v, 'name', v) for v in unique]}")
    return (replace(spec, **changes) if changes else spec), notes


def _blocks(spec: SweepSpec, report: SweepReport, batch_size: int) -> list[Block]:
    """The sweep's enumerations cut into blocks of ``batch_size`` rows (counted, not built)."""
    blocks = []
    for model in spec.models:
        for hw in spec.hardware:
            for n in spec.gpu_counts:
                cluster = spec.cluster.replace(num_gpus=n)
                e = enumerate_plans(model, spec.training, hw, cluster, spec.space, count_only=True)
                report.candidates += e.candidates
                report.valid += e.valid
                report.rejected.update(e.rejected)
                for start in range(0, e.valid, batch_size):
                    blocks.append(
                        Block(
                            model=model,
                            training=spec.training,
                            hardware=hw,
                            cluster=cluster,
                            space=spec.space,
                            memory_limit_bytes=spec.memory_limit_bytes,
                            start=start,
                            stop=min(start + batch_size, e.valid),
                            timing=spec.timing,
                        )
                    )
    return blocks


def _ranges(blocks: list[Block]) -> list[Block]:
    """Adjacent blocks of one enumeration merged into one range of rows."""
    out: list[Block] = []
    for b in blocks:
        last = out[-1] if out else None
        if (
            last is not None
            and last.stop == b.start
            and replace(last, stop=b.stop) == replace(b, start=last.start)
        ):
            out[-1] = replace(last, stop=b.stop)
        else:
            out.append(b)
    return out


def _cut(ranges: list[Block], executor: Executor, batch_size: int, cut: dict) -> Iterator:
    """Blocks of ``ranges``, each as large as the executor asks for when it is cut (Ray: from
    the measured cost per plan); ``cut`` maps each block's id to it until its result is in."""
    left = sum(r.stop - r.start for r in ranges)
    bid = 0
    for r in ranges:
        start = r.start
        while start < r.stop:
            rows = max(1, int(executor.block_rows(batch_size, left)))
            block = replace(r, start=start, stop=min(start + rows, r.stop))
            cut[bid] = block
            yield bid, block
            left -= block.stop - block.start
            start = block.stop
            bid += 1


def _stored_rows(store: ResultStore, hashes: list[np.ndarray], summary: RunSummary) -> None:
    """Add the stored rows of these configurations (a resumed sweep) to ``summary``: a scan of
    the folder filtered on their ``config_hash``, projected to the summary's columns."""
    wanted = np.unique(np.concatenate(hashes)) if hashes else np.zeros(0, np.uint64)
    if len(wanted):
        for batch in store.scan(list(SUMMARY_COLUMNS), hashes=wanted):
            summary.add(batch, reused=True)


def _run_grid(spec, executor, store, batch_size, progress, log, replaced, top_k) -> SweepReport:
    t0 = time.perf_counter()
    spec, merged = unique_axes(spec)
    for note in merged:
        log(f"note: repeated values are one value: {note}")
    report = SweepReport(name=spec.name, run_id=new_run_id())
    report.summary = RunSummary(top_k=top_k)
    if replaced:
        log(f"removed {replaced} part files of another stage_dse version (replace_stale)")
    stored = store.hash_values(log)  # sorted uint64
    blocks = _blocks(spec, report, batch_size)
    rejected_total = sum(report.rejected.values())
    log(
        f"sweep {spec.name}: {report.valid:,} valid plans of {report.candidates:,} candidates "
        f"({rejected_total:,} rejected by divisibility rules, enumerated in "
        f"{time.perf_counter() - t0:.2f} s); {len(stored):,} rows already in {store.root}"
    )
    reused: list[np.ndarray] = []
    if len(stored) and blocks:
        # a resumed sweep: blocks whose every configuration is stored need no worker (and a
        # sweep with nothing left starts no Ray); the stored rows of this sweep's
        # configurations are summarized from the folder
        todo = []
        for b in blocks:
            hashes = config_hash_u64(block_plans(b))
            hit = among(hashes, stored)
            if hit.any():
                reused.append(hashes[hit])
            if not hit.all():
                todo.append(b)
        kept = {id(b) for b in todo}
        report.skipped += sum(b.stop - b.start for b in blocks if id(b) not in kept)
        blocks = todo
        if not blocks:
            log("every configuration is already stored: nothing to evaluate")
    left = sum(b.stop - b.start for b in blocks)
    keys = family_keys(spec) if blocks else []
    report.runner = executor.choose(left, keys)
    if blocks:
        log(f"  evaluating up to {left:,} plans on {report.runner}")
        _start_and_compile(executor, keys, left, log)
    bar = _progress(report.valid, progress)
    shared_done = executor.share(stored) if len(stored) and blocks else None
    cut: dict[int, Block] = {}
    tasks = (
        (bid, (b, spec.name, shared_done, report.run_id, top_k))
        for bid, b in _cut(_ranges(blocks), executor, batch_size, cut)
    )
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = []
        for bid, result in executor.map(evaluate_part, tasks):
            block = cut.pop(bid)
            if isinstance(result, BaseException):
                configs = block_configs(block)
                configs = configs[~among(config_hash_u64(block_plans(block)), stored)]
                message = f"{type(result).__name__}: {result}"
                rows = error_rows(configs, message, spec.name, report.run_id)
                pending.append(writer.submit(store.write, rows))
                n_rows, statuses = len(rows), {"error": len(rows)}
                if len(rows):
                    report.summary.add(as_arrow(rows))
            else:
                if result.rows:
                    pending.append(writer.submit(store.write_encoded, result.data))
                n_rows, statuses = result.rows, result.status
                if result.summary is not None:
                    report.summary.merge(result.summary)
                executor.observe(block.stop - block.start, result.cpu_s)
            report.evaluated += n_rows
            report.skipped += (block.stop - block.start) - n_rows
            report.status.update({k: v for k, v in statuses.items() if v})
            bar.update(block.stop - block.start)
        for f in pending:
            f.result()  # surface write errors
    bar.close()
    report.runner = executor.describe() or report.runner
    _stored_rows(store, reused, report.summary)
    report.folder_rows = store.row_count()
    infeasible = report.status.get("infeasible", 0)
    if infeasible:
        report.infeasible_reasons["does not fit in memory"] += infeasible
    report.seconds = time.perf_counter() - t0
    return report


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="plan", unit_scale=True, file=sys.stderr, desc="evaluating")


def _rank_with_ties(ok: pd.DataFrame, by: str, k: int) -> tuple[pd.DataFrame, list[str]]:
    """The ``k`` best rows by ``by`` with tie groups (values within :data:`TIE_REL` of the
    group's first) ordered by memory headroom, largest first; and each row's tie label
    (``"2="``: tied, the group's rank) or ``""``."""
    if len(ok) == 0 or k < 1:
        return ok.head(0), []
    head = ok.nsmallest(k, by)
    edge = float(head[by].max()) * (1 + TIE_REL)
    cand = ok[ok[by] <= edge].sort_values([by, "mem_total_bytes"], kind="stable")
    values = cand[by].to_numpy(dtype=np.float64)
    group = np.zeros(len(values), dtype=np.int64)
    start = 0
    for i in range(1, len(values)):
        if values[i] > values[start] * (1 + TIE_REL):
            start = i
        group[i] = start  # the group's first position in value order
    cand = cand.assign(_group=group, _headroom=-cand["mem_headroom_bytes"].to_numpy())
    cand = cand.sort_values(["_group", "_headroom"], kind="stable")
    sizes = pd.Series(group).value_counts()
    best = cand.head(k)
    labels = [f"{g + 1}=" if sizes[g] > 1 else "" for g in best["_group"]]
    return best.drop(columns=["_group", "_headroom"]), labels


def top_table(df: pd.DataFrame, k: int = 10, by: str = "step_s") -> pd.DataFrame:
    """The ``k`` best feasible plans, with the columns a user reads first. Plans that tie
    (:data:`TIE_REL`) share a rank in a ``tie`` column (present only when some do), the one
    with more memory headroom first."""
    ok = df[df["status"] == "ok"]
    if by == "gpu_seconds":
        ok = ok.assign(gpu_seconds=ok["step_s"] * ok["num_gpus"])
    best, ties = _rank_with_ties(ok, by, k)
    table = pd.DataFrame(
        {
            "model": best["model"],
            "hardware": best["hardware"],
            "gpus": best["num_gpus"],
            "dp": best["dp"],
            "tp": best["tp"],
            "pp": best["pp"],
            "cp": best["cp"],
            "ep": best["ep"],
            "mbs": best["micro_batch"],
            "zero": best["zero_stage"],
            "recompute": best["recompute"],
            "sp": best["sequence_parallel"],
            "chunks": best["virtual_stages"],
            "step_s": best["step_s"].round(3),
            "mfu": best["mfu"].round(3),
            "mem_gib": (best["mem_total_bytes"] / GIB).round(1),
            "headroom_gib": (best["mem_headroom_bytes"] / GIB).round(1),
        }
    )
    if best["stage_layers"].nunique() > 1:  # a sweep over layer splits: say which
        table.insert(13, "split", best["stage_layers"].astype(str))
    replicas = best.get("dp_replicate")
    if replicas is not None and (replicas.fillna(1) > 1).any():  # hybrid sharding: say how
        at = table.columns.get_loc("zero") + 1
        table.insert(at, "replicas", replicas.fillna(1).astype(int))
    schedules = best.get("schedule")
    if schedules is not None and schedules.astype(str).isin(("zb1p", "dualpipe")).any():
        table.insert(table.columns.get_loc("chunks") + 1, "schedule", schedules.astype(str))
    frameworks = best.get("framework")
    if frameworks is not None and frameworks.nunique() > 1:  # a sweep over frameworks
        table.insert(2, "framework", frameworks.astype(str))
    if by == "gpu_seconds":  # the ranking key, shown
        table.insert(table.columns.get_loc("step_s") + 1, "gpu_s", best["gpu_seconds"].round(1))
    if any(ties):
        shown = "gpu_s" if by == "gpu_seconds" else "step_s"
        table.insert(table.columns.get_loc(shown) + 1, "tie", ties)
    return table.reset_index(drop=True)


def rows_of_run(
    df: pd.DataFrame,
    workload: str,
    models,
    hardware,
    cluster: str,
    gpus=None,
    training=None,
    timing: str = "roofline",
) -> pd.DataFrame:
    """The rows of one run's configurations (a results folder may hold other runs' rows too):
    same workload, models, hardware (Optuna's capacity variants ``name@..GiB`` included),
    cluster, GPU counts, training step and timing source."""
    hw = df["hardware"].astype(str).str.split("@").str[0]
    keep = (
        (df["workload"].astype(str) == workload)
        & df["model"].astype(str).isin(list(models))
        & hw.isin(list(hardware))
        & (df["cluster"].astype(str) == cluster)
        & (df["timing"].astype(object).fillna("roofline").astype(str) == timing)
    )
    if gpus is not None:
        keep &= df["num_gpus"].isin(list(gpus))
    if training is not None:
        keep &= (df["seq"] == training.seq_len) & (df["global_batch"] == training.global_batch_size)
        keep &= df["gemm_bytes"] == training.gemm_dtype.bytes
        recipe = fp8_recipe_values(training.fp8_recipe, training.block_scaled)
        for col, value in recipe.items():  # rows before recipes: 0
            if col in df:
                keep &= df[col].fillna(0) == value
            elif value:
                keep &= False
    return df[keep]


def tables_notes(hardware) -> list[str]:
    """``timing=measured``: one line per part without measured kernel tables (its rows keep
    the roofline)."""
    from stage_dse.kernels.tables import table_set

    return [
        f"note: timing=measured: no measured kernel tables for {hw.name}; its rows use the roofline"
        for hw in hardware
        if table_set(hw) is None
    ]
