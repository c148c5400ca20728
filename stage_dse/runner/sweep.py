"""The sweep driver: enumerate, skip what is done, evaluate in batches, write part files.

What lives here: :class:`SweepSpec` (what one Hydra job sweeps, as domain specs),
:func:`run_grid` (exhaustive search) and the summary a user sees. It is the only code that
writes results. It takes an executor, so the same sweep runs in-process or on Ray.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pandas as pd

from stage_dse.cost.table import KEY_COLUMNS, key_from_values
from stage_dse.errors import ConfigError
from stage_dse.results.schema import config_hash
from stage_dse.results.store import ResultStore
from stage_dse.runner.evaluate import error_rows
from stage_dse.runner.executors import Executor
from stage_dse.search.space import SearchSpace, enumerate_plans
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec, TrainingSpec

__all__ = ["SweepReport", "SweepSpec", "build_table", "run_grid", "top_table"]

GIB = 2.0**30


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """One inner sweep: models x hardware x GPU counts x plan space, on one cluster design."""

    name: str
    models: tuple[ModelSpec, ...]
    training: TrainingSpec
    hardware: tuple[HardwareSpec, ...]
    cluster: ClusterSpec
    gpu_counts: tuple[int, ...]
    space: SearchSpace
    memory_limit_bytes: float | None = None
    """Budget mode: usable memory per GPU replaces the hardware's."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"sweep_name={self.name!r} must be a plain folder name")
        if not self.gpu_counts:
            raise ConfigError("num_gpus must list at least one GPU count")
        for n in self.gpu_counts:
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ConfigError(f"num_gpus values must be integers > 0, got {n!r}")
            per_node = self.cluster.gpus_per_node
            if n > per_node and n % per_node:
                raise ConfigError(
                    f"num_gpus({n}) is not a multiple of cluster.gpus_per_node({per_node})"
                )
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ConfigError(
                f"budget.memory_gib must be > 0, got {self.memory_limit_bytes / GIB:g}"
            )


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


def build_table(spec: SweepSpec) -> tuple[pd.DataFrame, int, Counter]:
    """All valid plans of the sweep as one plan table, with candidate and rejection counts."""
    tables, candidates, rejected = [], 0, Counter()
    for model in spec.models:
        for hw in spec.hardware:
            for n in spec.gpu_counts:
                cluster = spec.cluster.replace(num_gpus=n)
                e = enumerate_plans(model, spec.training, hw, cluster, spec.space)
                candidates += e.candidates
                rejected.update(e.rejected)
                if len(e.table):
                    tables.append(e.table)
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    if len(table) and spec.memory_limit_bytes is not None:
        table["usable_memory"] = float(spec.memory_limit_bytes)
    return table, candidates, rejected


def _batches(table: pd.DataFrame, size: int) -> Iterator[tuple[int, pd.DataFrame]]:
    for bid, start in enumerate(range(0, len(table), size)):
        yield bid, table.iloc[start : start + size]


def run_grid(
    spec: SweepSpec,
    executor: Executor,
    store: ResultStore,
    batch_size: int = 50_000,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> SweepReport:
    """Evaluate every valid plan of ``spec`` not yet in ``store``; write one part per batch."""
    t0 = time.perf_counter()
    report = SweepReport(name=spec.name)
    table, report.candidates, report.rejected = build_table(spec)
    report.valid = len(table)
    store.prepare()
    if len(table):
        table["config_hash"] = config_hash(table).to_numpy()
        done = store.hashes()
        if done:
            keep = ~table["config_hash"].isin(done).to_numpy()
            report.skipped = int((~keep).sum())
            table = table[keep].reset_index(drop=True)
    rejected_total = sum(report.rejected.values())
    log(
        f"sweep {spec.name}: {report.valid:,} valid plans of {report.candidates:,} candidates "
        f"({rejected_total:,} rejected by divisibility rules); {report.skipped:,} already in "
        f"{store.root}; evaluating {len(table):,} on {executor.name}"
    )
    if len(table):
        keys = {
            key_from_values(dict(zip(KEY_COLUMNS, vals)))
            for vals in table[list(KEY_COLUMNS)].drop_duplicates().itertuples(index=False)
        }
        executor.compile(sorted(keys, key=repr))
        bar = _progress(len(table), progress)
        batches = dict(_batches(table, batch_size))
        for bid, result in executor.map(list(batches.items()), spec.name):
            configs = batches.pop(bid)
            if isinstance(result, BaseException):
                rows = error_rows(configs, f"{type(result).__name__}: {result}", spec.name)
            else:
                rows = result
            store.write(rows)
            report.evaluated += len(rows)
            report.status.update(rows["status"].value_counts().to_dict())
            infeasible = rows["status"] == "infeasible"
            if infeasible.any():
                report.infeasible_reasons["does not fit in memory"] += int(infeasible.sum())
            bar.update(len(rows))
        bar.close()
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


def top_table(df: pd.DataFrame, k: int = 10, by: str = "step_s") -> pd.DataFrame:
    """The ``k`` best feasible plans, with the columns a user reads first."""
    ok = df[df["status"] == "ok"]
    if by == "gpu_seconds":
        ok = ok.assign(gpu_seconds=ok["step_s"] * ok["num_gpus"])
    best = ok.sort_values([by, "mem_total_bytes"]).head(k)
    return pd.DataFrame(
        {
            "model": best["model"],
            "hardware": best["hardware"],
            "gpus": best["num_gpus"],
            "dp": best["dp"],
            "tp": best["tp"],
            "pp": best["pp"],
            "cp": best["cp"],
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
    ).reset_index(drop=True)
