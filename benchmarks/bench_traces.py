"""Trace-writing benchmark: Llama-3-70B style sets at 64, 4,096 and 32,768 ranks and one
Llama-3-405B set at 131,072 ranks (TP 8, PP 16, DP 1024, seq 8192).

Small sets are written in this process; the two large ones as Ray tasks over rank ranges (Ray
is started first; its start-up is not counted). CPU seconds are this process's plus those the
tasks report; peak RSS is the largest of this process and any task's worker. Each set is
checked cheaply per stage while it is built, measured, then deleted (they are large).

Each set is then replayed (:mod:`stage_dse.trace.replay`): one rank per stage, and every rank
for the 64-rank set; the replay lines give its CPU seconds and the replayed step time
beside the cost model's.

Run: ``python benchmarks/bench_traces.py [--skip-largest]``; one machine-readable line per set.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.runner.executors import RayExecutor
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.trace import TraceConfig, write_trace_set
from stage_dse.trace.replay import replay_trace_dir

H100 = load_hardware("h100_sxm")
SETS = [
    (
        "llama3_70b",
        ParallelPlan(dp=1, tp=8, pp=8, sequence_parallel=True, zero_stage=1),
        64,
        8192,
        False,
    ),
    (
        "llama3_70b",
        ParallelPlan(dp=64, tp=8, pp=8, sequence_parallel=True, zero_stage=1),
        1024,
        8192,
        False,
    ),
    (
        "llama3_70b",
        ParallelPlan(dp=512, tp=8, pp=8, sequence_parallel=True, zero_stage=1),
        1024,
        8192,
        True,
    ),
    (
        "llama3_405b",
        ParallelPlan(dp=1024, tp=8, pp=16, sequence_parallel=True, zero_stage=1, recompute="full"),
        2048,
        8192,
        True,
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-largest", action="store_true")
    args = parser.parse_args()
    sets = SETS[:-1] if args.skip_largest else SETS
    t0 = time.perf_counter()
    executor = RayExecutor()
    cpus = executor.num_cpus  # Ray starts on first use
    print(f"ray start: {time.perf_counter() - t0:.1f} s ({cpus} CPUs)")
    try:
        for name, plan, batch, seq, use_ray in sets:
            ranks = plan.num_gpus
            cfg = TraceConfig(
                model=load_model(name),
                training=TrainingSpec(seq_len=seq, global_batch_size=batch),
                plan=plan,
                hardware=H100,
                cluster=load_cluster("dgx_h100", num_gpus=ranks),
            )
            out = tempfile.mkdtemp(prefix="stage_dse_traces_")
            try:
                w0, c0 = time.perf_counter(), time.process_time()
                ts = write_trace_set(cfg, out, executor=executor if use_ray else None)
                wall = time.perf_counter() - w0
                cpu = time.process_time() - c0 + ts.worker_cpu_s
                rss = max(
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    ts.worker_peak_rss_mib,
                )
                for w in ts.warnings:
                    print(f"  warning: {w}")
                print(
                    f"{name} tp={plan.tp} pp={plan.pp} dp={plan.dp} microbatches="
                    f"{plan.num_microbatches(cfg.training)} nodes/rank(stage 0)="
                    f"{sum(ts.nodes_per_stage[0].values())} via={'ray' if use_ray else 'local'}"
                )
                print(
                    f"ranks={ranks} wall_s={wall:.2f} cpu_s={cpu:.2f} peak_rss_mb={rss:.0f} "
                    f"bytes={ts.bytes} files={ts.files}"
                )
                c0 = time.process_time()
                r = replay_trace_dir(out)
                print(
                    f"  replay ranks={ranks} simulated={r.simulated_ranks} nodes={r.nodes} "
                    f"cpu_s={time.process_time() - c0:.2f} step_s={r.step_s:.4f} "
                    f"cost_step_s={r.cost_step_s:.4f}"
                )
                if ranks <= 64:
                    c0 = time.process_time()
                    full = replay_trace_dir(out, all_ranks=True)
                    print(
                        f"  replay ranks={ranks} simulated={full.simulated_ranks} "
                        f"nodes={full.nodes} cpu_s={time.process_time() - c0:.2f} "
                        f"step_s={full.step_s:.4f} (every rank)"
                    )
            finally:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        executor.close()
    _ = os


if __name__ == "__main__":
    main()
