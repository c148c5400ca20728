"""End-to-end sweep throughput through Ray versus the bare evaluator on the same space.

Space: Llama-3-70B (seq 8192, global batch 1024) x GPU counts 256..16384 x three hardware
presets x the wide plan space; at least a million valid plans. The sweep path includes
enumeration, config hashing, Ray task dispatch and Parquet part writing; Ray is started first
and its start-up time printed separately. The bare figure is ``evaluate_table`` on the same
plan table in this process.

Run: ``python benchmarks/bench_sweep.py``; the last line is machine readable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.table import evaluate_table
from stage_dse.results.store import ResultStore
from stage_dse.runner import RayExecutor, SweepSpec, build_table, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import TrainingSpec

SPEC = SweepSpec(
    name="bench",
    models=(load_model("llama3_70b"),),
    training=TrainingSpec(seq_len=8192, global_batch_size=1024),
    hardware=tuple(load_hardware(n) for n in ("h100_sxm", "h200", "b200", "a100_80gb", "mi300x")),
    cluster=load_cluster("dgx_h100"),
    gpu_counts=(256, 512, 1024, 2048, 4096, 8192, 16384),
    space=SearchSpace(
        tp=(1, 2, 4, 8),
        pp="auto",
        cp=(1, 2, 4, 8),
        micro_batch_size=(1, 2, 4),
        attention=("flash", "materialized"),
        virtual_stages=(1, 2, 4, 5),
    ),
)


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.perf_counter()
    table, candidates, _ = build_table(SPEC)
    t_build = time.perf_counter() - t0
    n = len(table)
    print(f"space: {candidates:,} candidates, {n:,} valid plans (enumerated in {t_build:.2f} s)")
    evaluate_table(table.iloc[:1])  # warm nothing heavy; families compile below
    t0 = time.perf_counter()
    evaluate_table(table)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    evaluate_table(table)
    t_bare = time.perf_counter() - t0
    bare_rate = n / t_bare
    print(
        f"bare evaluator: {t_bare:.2f} s = {bare_rate:,.0f} plans/s "
        f"(first pass with compiles {t_cold:.1f} s)"
    )
    del table

    t0 = time.perf_counter()
    executor = RayExecutor()
    cpus = executor.num_cpus  # Ray starts on first use
    t_ray = time.perf_counter() - t0
    print(f"ray start: {t_ray:.1f} s ({cpus} CPUs, workers have imported stage_dse)")
    out = tempfile.mkdtemp(prefix="stage_dse_bench_")
    try:
        store = ResultStore(os.path.join(out, SPEC.name))
        t0 = time.perf_counter()
        report = run_grid(
            SPEC, executor, store, batch_size=50_000, progress=False, log=lambda s: None
        )
        t_sweep = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in store.parts())
        print(
            f"sweep through ray: {report.evaluated:,} rows in {t_sweep:.2f} s "
            f"({len(store.parts())} part files, {size / 2**20:.0f} MiB)"
        )
    finally:
        executor.close()
        shutil.rmtree(out, ignore_errors=True)
    sweep_rate = report.evaluated / t_sweep
    print(f"ray sweep / bare evaluator: {bare_rate / sweep_rate:.2f}x slower")
    print(
        f"plans={report.evaluated} sweep_plans_per_s={sweep_rate:.0f} "
        f"evaluator_plans_per_s={bare_rate:.0f}"
    )


if __name__ == "__main__":
    main()
