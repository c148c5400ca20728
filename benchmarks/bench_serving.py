"""A serving sweep of more than 1,000 configurations through the serving driver, in-process.

Space: Llama-3-8B and Llama-3-70B on H100 and H200 (a DGX H100 cluster):

* static batching: tp 1..8 x pp 1, 2, 4 x batch 1..128 (6) x prompt 512..8192 (4), 576 per
  model;
* continuous batching (pp 1): tp 1..8 x running limit 16, 64, 256 x prompt 1024, 4096 x prefill
  budget 1024, 4096, 96 per model;

1,344 configurations, each job with TTFT/TPOT targets so that the SLA front is taken too.
Every job goes through :func:`stage_dse.runner.serving_job.run_serving_job` (the code
``stage-dse workload=serving`` runs) into a fresh results folder: configurations built and
validated, evaluated, hashed, written as Parquet parts, read back, ranked.

The figure is the CPU seconds of this process (``resource.getrusage``: user + system) around
the sweeps only; the imports and presets are loaded before (a warm-up import), and compiled
serving programs come from the disk cache as in any run after the first. The figure is the
process's first sweep (its serving programs are built in it); ``--repeat N`` runs the sweeps
N - 1 more times into fresh folders and also reports the median (later sweeps reuse the
programs in memory); ``--timing measured`` costs every row with measured kernel tables (the
``measured`` extra). The target is under 5 CPU-s.

Run: ``python benchmarks/bench_serving.py [--repeat 3] [--timing measured]``; the last line is
machine readable.
"""

from __future__ import annotations

import argparse
import importlib
import resource
import statistics
import tempfile
from pathlib import Path

MODELS = ("llama3_8b", "llama3_70b")
HARDWARE = ("h100_sxm", "h200")
STATIC = {
    "tp": (1, 2, 4, 8),
    "pp": (1, 2, 4),
    "batch_sizes": (1, 4, 16, 32, 64, 128),
    "prompt_lens": (512, 1024, 2048, 8192),
}
CONTINUOUS = {
    "tp": (1, 2, 4, 8),
    "batch_sizes": (16, 64, 256),
    "prompt_lens": (1024, 4096),
    "prefill_budgets": (1024, 4096),
    "mode": "continuous",
}
TARGET_S = 5.0


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def jobs(timing: str):
    from stage_dse.config import load_cluster, load_hardware, load_model
    from stage_dse.spec.sweep import ServingJob, ServingSweepSpec

    hardware = tuple(load_hardware(h) for h in HARDWARE)
    cluster = load_cluster("dgx_h100")
    out = []
    for name in MODELS:
        model = load_model(name)
        for kind, axes in (("static", STATIC), ("continuous", CONTINUOUS)):
            sweep = ServingSweepSpec(
                name=f"{name}_{kind}", model=model, hardware=hardware, cluster=cluster, **axes
            )
            out.append(ServingJob(sweep=sweep, timing=timing, ttft_sla_ms=1000, tpot_sla_ms=50))
    return out


def sweep(root: Path, timing: str) -> tuple[int, int, float]:
    """All jobs into fresh folders under ``root``: (configurations, rows, CPU seconds)."""
    from stage_dse.results.store import ResultStore
    from stage_dse.runner.serving_job import run_serving_job

    todo = jobs(timing)  # presets read before the clock starts
    configs = rows = 0
    t0 = cpu_s()
    for job in todo:
        result = run_serving_job(job, ResultStore(root / job.sweep.name), log=lambda s: None)
        configs += result.report.candidates
        rows += len(result.rows)
    return configs, rows, cpu_s() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timing", choices=("roofline", "measured"), default="roofline")
    args = ap.parse_args()
    for module in ("stage_dse.config", "stage_dse.runner.serving_job"):
        importlib.import_module(module)  # the warm-up import

    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            configs, rows, s = sweep(Path(tmp) / f"run{i}", args.timing)
            seconds.append(s)
            print(f"run {i}: {configs:,} configurations, {rows:,} rows, {s:.2f} CPU-s")
    first, median = seconds[0], statistics.median(seconds)
    verdict = "within" if first < TARGET_S else "over"
    print(
        f"serving sweep ({args.timing}): {configs:,} configurations in {first:.2f} CPU-s "
        f"(the process's first sweep), {configs / first:,.0f} configurations per CPU-s; "
        f"{verdict} the {TARGET_S:g} CPU-s target"
    )
    if len(seconds) > 1:
        print(f"median of {len(seconds)} sweeps in the process: {median:.2f} CPU-s")
    print(f"BENCH configs={configs} cpu_s={first:.3f} configs_per_cpu_s={configs / first:.0f}")


if __name__ == "__main__":
    main()
