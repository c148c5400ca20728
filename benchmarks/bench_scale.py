"""How the column path's cost grows with the table: 100k, 1M and 10M plans.

The sweep runner hands ``evaluate_columns`` one block of plans at a time; a caller with a
large table (or a large block) hands it everything at once. This benchmark evaluates tables
of growing size built from one enumeration (Llama-3-70B on 1,024 H100s, the table of
``bench_eval.py``): each plan repeated ``k`` times in place, so the table keeps the
enumeration's 96 family runs, each ``k`` times longer, and only the row count grows.

Per size it prints the CPU seconds of one warm call (median of ``--repeat`` calls), the plans
per CPU-second, the minor page faults per call and the process's peak RSS, then the log-log
slope of CPU seconds over rows between consecutive sizes (1.0: linear). Run:
``python benchmarks/bench_scale.py [--max-rows 10000000] [--repeat 3]``; the last line is
machine readable. The 10M-row table needs about 6 GB (its 4.5 GB output matrix included).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from itertools import pairwise

import numpy as np
from bench_eval import SPACE  # the enumeration bench_eval times (run from benchmarks/)

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.table import evaluate_columns
from stage_dse.search import enumerate_plans
from stage_dse.spec import TrainingSpec


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    a = parser.parse_args()
    model, hw = load_model("llama3_70b"), load_hardware("h100_sxm")
    cluster = load_cluster("dgx_h100", num_gpus=1024)
    training = TrainingSpec(seq_len=8192, global_batch_size=1024)
    base = enumerate_plans(model, training, hw, cluster, SPACE).columns
    evaluate_columns(base)  # families compiled (or loaded) before any timed call
    sizes = [n for n in (100_000, 1_000_000, 10_000_000) if n <= a.max_rows]
    rows: list[tuple[int, float]] = []
    for n in sizes:
        k = -(-n // base.rows)
        table = base.take(np.repeat(np.arange(base.rows), k)[:n])
        cpu, faulted = [], []
        for _ in range(a.repeat):
            f0, t0 = faults(), time.process_time()
            _, out = evaluate_columns(table)
            cpu.append(time.process_time() - t0)
            faulted.append(faults() - f0)
            del out
        t = statistics.median(cpu)
        rows.append((n, t))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"rows={n:,} cpu_s={t:.3f} plans_per_cpu_s={n / t:,.0f} "
            f"minor_faults_per_call={statistics.median(faulted):,.0f} peak_rss_mb={peak:,.0f}"
        )
        del table
    slopes = [math.log(t2 / t1) / math.log(n2 / n1) for (n1, t1), (n2, t2) in pairwise(rows)]
    print("slopes=" + ",".join(f"{s:.3f}" for s in slopes) + f" max_rows={rows[-1][0]}")


if __name__ == "__main__":
    main()
