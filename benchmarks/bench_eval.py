"""Benchmark of the vectorized evaluator against a per-plan Python loop.

Builds the full valid plan table (every dp/tp/pp/cp/micro-batch/ZeRO/recompute/sequence-
parallel/attention/schedule combination that passes validation) for two workloads, evaluates
it, and prints plans, seconds, plans per CPU-second and peak RSS; then evaluates a sample of the
same plans one at a time through ``evaluate_plan`` (validation, family lookup, one-row call) as
the per-plan baseline. Compilation of the families happens in the cold pass and is reported
separately; the warm pass is the figure of merit.

A second pass times kernels from measured tables (``timing=measured``, needs the ``measured``
extra): the same tables and loop sample, warm, and a second machine-readable line.

The same warm evaluation through the column path the sweep runner takes
(``evaluate_columns`` over the enumeration's columns, no DataFrame) is reported beside it.

Run: ``python benchmarks/bench_eval.py``. The last two lines are machine readable.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.cost.table import evaluate_columns, evaluate_table
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.spec import ParallelPlan, TrainingSpec

SPACE = SearchSpace(
    tp="auto",
    pp="auto",
    cp="auto",
    micro_batch_size=(1, 2, 4, 8, 16),
    zero_stage=(0, 1, 2, 3),
    recompute=("none", "selective", "full"),
    sequence_parallel=(False, True),
    attention=("flash", "materialized"),
    virtual_stages=(1, 2, 3, 4, 6, 8),
)
WORKLOADS = [
    ("llama3_70b", 8192, 1024, "h100_sxm", "dgx_h100", 1024),
    ("gpt3_175b", 2048, 1536, "a100_80gb", "dgx_a100", 1536),
]
LOOP_SAMPLE = 2000


def cpu() -> float:
    return time.process_time()


def plan_of(row) -> ParallelPlan:
    v = int(row.virtual_stages)
    return ParallelPlan(
        dp=int(row.dp),
        tp=int(row.tp),
        pp=int(row.pp),
        cp=int(row.cp),
        micro_batch_size=int(row.micro_batch),
        zero_stage=int(row.zero_stage),
        recompute=row.recompute,
        sequence_parallel=bool(row.sequence_parallel),
        attention=row.attention,
        schedule="interleaved" if v > 1 else "1f1b",
        virtual_stages=v,
    )


def main() -> None:
    summary = run("roofline")
    from stage_dse.kernels.tables import data_root

    if data_root() is None:
        print("timing=measured skipped: pip install -e '.[measured]'")
        print(summary)
        return
    measured = run("measured")
    print(summary)
    print(measured)


def run(timing: str) -> str:
    total_plans = 0
    warm_cpu = 0.0
    loop_plans = 0
    loop_cpu = 0.0
    columns_cpu = 0.0
    print(f"timing={timing}")
    for name, seq, batch, hw_name, cl_name, gpus in WORKLOADS:
        model, hw = load_model(name), load_hardware(hw_name)
        cl = load_cluster(cl_name, num_gpus=gpus)
        training = TrainingSpec(seq_len=seq, global_batch_size=batch)
        t0 = cpu()
        enum = enumerate_plans(model, training, hw, cl, SPACE)
        t_enum = cpu() - t0
        t0 = cpu()
        evaluate_table(enum.table, timing=timing)
        t_cold = cpu() - t0
        t0, w0 = cpu(), time.perf_counter()
        res = evaluate_table(enum.table, timing=timing)
        t_warm, wall = cpu() - t0, time.perf_counter() - w0
        n = len(enum.table)
        gpu = None
        if timing == "measured":
            from stage_dse.kernels.tables import table_set

            gpu = table_set(hw_name)
        t0 = cpu()
        evaluate_columns(enum.columns, timing=timing, measured_gpu=gpu)
        t_columns = cpu() - t0
        columns_cpu += t_columns
        feasible = int((res["mem_headroom_bytes"] >= 0).sum())
        families = enum.table.groupby(
            ["zero_stage", "recompute", "sequence_parallel", "attention", "schedule"]
        ).ngroups
        print(
            f"{name} on {gpus} {hw_name}: candidates={enum.candidates} valid={n} "
            f"feasible={feasible} enumerate_cpu_s={t_enum:.3f} cold_eval_cpu_s={t_cold:.2f} "
            f"(compiles {families} families) "
            f"warm_eval_cpu_s={t_warm:.3f} wall_s={wall:.3f} plans_per_cpu_s={n / t_warm:,.0f} "
            f"columns_eval_cpu_s={t_columns:.3f} columns_plans_per_cpu_s={n / t_columns:,.0f}"
        )
        total_plans += n
        warm_cpu += t_warm
        rng = np.random.default_rng(0)
        sample = enum.table.iloc[rng.choice(n, size=min(LOOP_SAMPLE, n), replace=False)]
        plans = [plan_of(r) for r in sample.itertuples()]
        t0 = cpu()
        for plan in plans:
            evaluate_plan(model, training, plan, hardware=hw, cluster=cl, timing=timing)
        t_loop = cpu() - t0
        loop_plans += len(plans)
        loop_cpu += t_loop
        print(
            f"  per-plan loop: {len(plans)} plans in {t_loop:.2f} cpu_s "
            f"= {len(plans) / t_loop:,.0f} plans/cpu_s"
        )
    rate = total_plans / warm_cpu
    loop_rate = loop_plans / loop_cpu
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"vectorized / loop = {rate / loop_rate:.0f}x")
    tag = "" if timing == "roofline" else f" timing={timing}"
    return (
        f"plans={total_plans} plans_per_cpu_s={rate:.0f} "
        f"columns_plans_per_cpu_s={total_plans / columns_cpu:.0f} "
        f"loop_plans_per_cpu_s={loop_rate:.0f} peak_rss_mb={peak_mb:.0f}{tag}"
    )


if __name__ == "__main__":
    main()
