"""Simulator-farm benchmark: 100 result rows of 8-64 ranks through the replay backend.

A results folder of Llama-3-8B (4 layers, seq 2048, global batch 64) on 8, 16, 32 and 64 H100s
(every plan of micro-batch 1, no recompute) is swept first (not counted); then
``stage_dse.trace.simulate.simulate`` takes the best 25 rows of each GPU count, writes their
trace sets and replays them on an embedded Ray sized to the machine.

Printed: CPU seconds of the farm (this process and every process it started, Ray's workers
and raylet included, read from /proc before Ray stops; Ray's start-up is excluded by starting
it first), the tasks' own CPU seconds, wall seconds, and how busy the cores were (the tasks'
CPU seconds over wall seconds x cores; the share of wall seconds x cores that a task was
running, which says whether the farm kept every worker fed even when other processes take the
CPU; and the machine's non-idle share from /proc/stat over the same interval).
``--local`` runs the same rows in this process instead (no Ray).

Run: ``python benchmarks/bench_simulate.py [--rows 100] [--local]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.runner.executors import RayExecutor
from stage_dse.search import SearchSpace
from stage_dse.spec import TrainingSpec
from stage_dse.trace.simulate import simulate

GPU_COUNTS = (8, 16, 32, 64)
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (with the children they reaped)."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(x) for x in fields[11:15]) * TICK_S
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return total


def machine_busy() -> tuple[float, float]:
    """(non-idle, total) jiffies of every core since boot."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def make_results(path: Path) -> None:
    spec = SweepSpec(
        name="bench_sim",
        models=(load_model("llama3_8b").replace(num_layers=4),),
        training=TrainingSpec(seq_len=2048, global_batch_size=64),
        hardware=(load_hardware("h100_sxm"),),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=GPU_COUNTS,
        space=SearchSpace(micro_batch_size=(1,), virtual_stages=(1,), recompute=("none",)),
    )
    run_grid(spec, LocalExecutor(), ResultStore(path), batch_size=10_000, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--local", action="store_true", help="in this process instead of Ray")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_sim_"))
    try:
        results = tmp / "results"
        make_results(results)
        df = load(results)
        ok = df[df["status"] == "ok"].sort_values("step_s")
        per = -(-args.rows // len(GPU_COUNTS))
        chosen = ok.groupby("num_gpus", group_keys=False).head(per).head(args.rows)
        hashes = list(chosen["config_hash"])
        ranks = chosen["num_gpus"].value_counts().sort_index().to_dict()
        cores = os.cpu_count() or 1
        executor = LocalExecutor() if args.local else RayExecutor(num_cpus=cores)
        started = executor.start()
        cpu0, busy0, wall0 = tree_cpu_s(os.getpid()), machine_busy(), time.perf_counter()
        summary = simulate(results, hashes=hashes, executor=executor, log=lambda s: None)
        wall = time.perf_counter() - wall0
        cpu = tree_cpu_s(os.getpid()) - cpu0
        busy1 = machine_busy()
        executor.close()
        machine = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
        ratios = summary.ratios.get("replay", [])
        print(
            f"bench_simulate rows={len(hashes)} ranks_per_row={ranks} executor="
            f"{started or 'local'} ok={summary.ok} failed={summary.failed} "
            f"sets_written={summary.written_sets}"
        )
        print(
            f"farm_cpu_s={cpu:.1f} task_cpu_s={summary.task_cpu_s:.1f} wall_s={wall:.1f} "
            f"cores={cores} task_cpu_share={summary.task_cpu_s / (wall * cores):.2f} "
            f"workers_occupied={summary.task_wall_s / (wall * cores):.2f} "
            f"machine_busy={machine:.2f} goal_cpu_s=60 "
            f"{'PASS' if cpu < 60 else 'FAIL'}"
        )
        if ratios:
            print(
                f"replay/analytic ratio: min {min(ratios):.3f} median "
                f"{sorted(ratios)[len(ratios) // 2]:.3f} max {max(ratios):.3f}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
