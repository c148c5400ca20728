"""A million-plan sweep end to end (the ``stage-dse`` command line) against the bare evaluator.

Space: Llama-3-70B (seq 8192, global batch 1024) on H100s x GPU counts 128..16384 x the wide plan
space (``plan=wide``): 1,020,624 valid plans. Two fresh processes, each measured by
``os.wait4`` (user + system CPU seconds, peak RSS ``ru_maxrss`` of that child alone):

* ``bare``: imports stage_dse, enumerates the plan table (``build_table``) and evaluates it
  with ``evaluate_table`` once; it prints the CPU seconds of each step, and the spec's Hydra
  composition is left out of its figure;
* ``cli``: ``python -m stage_dse.cli ... runner=local`` into an empty results folder:
  Hydra, enumeration, hashing, evaluation, Parquet parts, the streamed summary and its print.

Both load the same compiled families from the disk cache (a first, untimed bare run fills
it). ``--repeat N`` alternates the two N times (the machine is shared: the median ratio is the
figure). ``--ray`` also runs the sweep in this process through ``run_grid`` with
``runner=local`` and with an embedded Ray, and prints Ray's CPU seconds (this process, its
reaped children and the live Ray processes it started, from ``/proc``) over local's, the
figure behind ``runner=auto``'s projection (``RAY_CPU_FACTOR``, ``RAY_START_S``).

Run: ``python benchmarks/bench_sweep.py [--repeat 3] [--ray]``; the last line is machine
readable.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ARGS = [
    "model=llama3_70b",
    "hardware=h100_sxm",
    "plan=wide",
    "num_gpus=[128,256,512,1024,2048,4096,8192,16384]",
    "training.seq_len=8192",
    "training.global_batch_size=1024",
]

BARE = f"""
import time
t0 = time.process_time()
from hydra import compose, initialize_config_dir
from stage_dse.config import conf_dir
from stage_dse.config.schema import register_schemas, to_sweep
register_schemas()
with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
    spec = to_sweep(compose(config_name="config", overrides={ARGS!r}))
t1 = time.process_time()
from stage_dse.cost.table import evaluate_table
from stage_dse.runner.sweep import build_table
table, _, _ = build_table(spec)
t2 = time.process_time()
evaluate_table(table)
t3 = time.process_time()
print(f"plans={{len(table)}} config_s={{t1 - t0:.2f}} enumerate_s={{t2 - t1:.2f}} "
      f"evaluate_table_s={{t3 - t2:.2f}}")
"""
"""The bare evaluator: the same plan table, ``evaluate_table`` once. Its figure is the
process's CPU seconds less ``config_s`` (Hydra composing the spec, which the bare evaluator
does not need; stage_dse's own import is counted)."""


def _child(cmd: list[str], cwd: str) -> tuple[float, float, float, str]:
    """Run ``cmd``; its CPU seconds, wall seconds, peak RSS (MiB) and stdout."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        err = proc.stderr.read()
        proc.stderr.close()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {err[-2000:]}")
    return usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024, text


def _bare(cwd: str) -> tuple[float, float, float, dict]:
    cpu, wall, rss, text = _child([sys.executable, "-c", BARE], cwd)
    fields = {k: float(v) for k, v in (kv.split("=") for kv in text.split()[-4:])}
    return cpu - fields["config_s"], wall, rss, fields


def _cli(cwd: str) -> tuple[float, float, float, str]:
    results = tempfile.mkdtemp(prefix="stage_dse_bench_")
    try:
        cmd = [sys.executable, "-m", "stage_dse.cli", *ARGS, "runner=local"]
        cmd += ["runner.progress=false", f"results_dir={results}"]
        return _child(cmd, cwd)
    finally:
        shutil.rmtree(results, ignore_errors=True)


def _tree_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(pid)] = int(stat[1])
        cpu[int(pid)] = (int(stat[11]) + int(stat[12])) / ticks
    me, total = os.getpid(), 0.0
    for pid in cpu:
        p = pid
        while p in parent and p not in (0, 1, me):
            p = parent[p]
        if p == me and pid != me:
            total += cpu[pid]
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + child.ru_utime + child.ru_stime + total


def _ray_vs_local() -> None:
    from hydra import compose, initialize_config_dir

    from stage_dse.config import conf_dir
    from stage_dse.config.schema import register_schemas, to_sweep
    from stage_dse.results.store import ResultStore
    from stage_dse.runner.executors import LocalExecutor, RayExecutor
    from stage_dse.runner.sweep import run_grid

    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        spec = to_sweep(compose(config_name="config", overrides=ARGS))
    figures = {}
    for kind in ("local", "ray"):
        out = tempfile.mkdtemp(prefix="stage_dse_bench_")
        executor = LocalExecutor() if kind == "local" else RayExecutor()
        try:
            c0, t0 = _tree_cpu_s(), time.perf_counter()
            started = executor.start()
            c_start, t_start = _tree_cpu_s() - c0, time.perf_counter() - t0
            report = run_grid(
                spec,
                executor,
                ResultStore(os.path.join(out, "r")),
                batch_size=20_000,
                progress=False,
                log=lambda s: None,
            )
            cpu = _tree_cpu_s() - c0 - c_start
            wall = time.perf_counter() - t0 - t_start
        finally:
            executor.close()
            shutil.rmtree(out, ignore_errors=True)
        figures[kind] = cpu
        print(
            f"run_grid {kind}: {report.evaluated:,} plans, {cpu:.1f} CPU-s, {wall:.1f} s wall"
            + (f" after a start of {t_start:.1f} s, {c_start:.1f} CPU-s" if started else "")
            + f"; {report.runner}"
        )
    print(f"ray / local CPU-s: {figures['ray'] / figures['local']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--ray", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.repeat < 1:  # --repeat 0 --ray: the Ray comparison only
        _ray_vs_local()
        return
    cwd = tempfile.mkdtemp(prefix="stage_dse_bench_cwd_")
    _bare(cwd)  # fills the compile cache: both runs below load the same families from disk
    ratios, cli_cpu, bare_cpu, rss, eval_cpu = [], [], [], [], []
    plans = 0
    for i in range(args.repeat):
        b_cpu, b_wall, b_rss, parts = _bare(cwd)
        c_cpu, c_wall, c_rss, text = _cli(cwd)
        plans = int(parts["plans"])
        assert f"evaluated {plans:,} in" in text, text[-3000:]
        print(
            f"[{i + 1}] bare evaluator process: {b_cpu:.2f} CPU-s ({b_wall:.1f} s wall, peak "
            f"{b_rss:,.0f} MiB; Hydra's {parts['config_s']:.2f} CPU-s left out; enumerate "
            f"{parts['enumerate_s']:.2f}, evaluate_table {parts['evaluate_table_s']:.2f})"
        )
        print(
            f"[{i + 1}] stage-dse cli (runner=local): {c_cpu:.2f} CPU-s ({c_wall:.1f} s wall, "
            f"peak {c_rss:,.0f} MiB): {c_cpu / b_cpu:.2f}x the bare process"
        )
        ratios.append(c_cpu / b_cpu)
        cli_cpu.append(c_cpu)
        bare_cpu.append(b_cpu)
        rss.append(c_rss)
        eval_cpu.append(parts["evaluate_table_s"])
    print(
        f"median of {args.repeat}: cli {statistics.median(cli_cpu):.2f} CPU-s, bare "
        f"{statistics.median(bare_cpu):.2f} CPU-s ({statistics.median(ratios):.2f}x), "
        f"evaluate_table alone {statistics.median(eval_cpu):.2f} CPU-s; cli peak RSS "
        f"{max(rss):,.0f} MiB"
    )
    shutil.rmtree(cwd, ignore_errors=True)
    if args.ray:
        _ray_vs_local()
    print(
        f"plans={plans} cli_cpu_s={statistics.median(cli_cpu):.2f} "
        f"bare_cpu_s={statistics.median(bare_cpu):.2f} ratio={statistics.median(ratios):.2f} "
        f"cli_peak_rss_mib={max(rss):.0f}"
    )


if __name__ == "__main__":
    main()
