"""Side by side with llm-analysis (PyPI ``llm-analysis``, Cheng Li's analytical model of
training latency and memory) on the plans both can express.

The workload is GPT-3 175B (``megatron-lm-175b`` in llm-analysis, the ``gpt3_175b`` preset
here) trained at sequence 2048 and global batch 1536 on 512 A100-SXM-80GB GPUs, over tensor
parallelism 1/2/4/8 (sequence parallel), pipeline 1/2/4/8/16, ZeRO 0-3, recompute
none/selective/full and micro-batch 1/2/4: the 672 plans whose micro-batches divide the batch.
Both tools get the same plan list (this package's enumeration of that space).

Three figures, each a ratio of CPU seconds measured in this run:

* ``per_plan``: one plan per call in a loop, warm (both tools imported, this package's
  families compiled by a pass before the timed one): ``evaluate_plan`` against
  ``LLMAnalysis(...).training(...)``;
* ``table``: the whole table at once, warm: ``evaluate_columns`` (what sweeps call) against the
  llm-analysis loop; ``evaluate_plans`` (a pandas table in, costs joined) is printed beside it;
* ``fresh``: a new Python process that imports the tool and answers the 672 plans, this
  package with an empty compile cache (``STAGE_DSE_CACHE`` a new folder) and with the cache
  the previous child left; CPU seconds are each child's user+system time from ``os.wait4``,
  children alternated ``--repeat`` times and the medians printed.

Run: ``pip install llm-analysis`` then ``python benchmarks/bench_llm_analysis.py``. The last
line is machine readable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

SETUP = textwrap.dedent(
    """
    from stage_dse.config import load_cluster, load_hardware, load_model
    from stage_dse.search import SearchSpace, enumerate_plans
    from stage_dse.spec import TrainingSpec

    SPACE = SearchSpace(tp=(1, 2, 4, 8), pp=(1, 2, 4, 8, 16), micro_batch_size=(1, 2, 4),
                        zero_stage=(0, 1, 2, 3), recompute=("none", "selective", "full"),
                        sequence_parallel=(False, True))
    MODEL, TRAINING = load_model("gpt3_175b"), TrainingSpec(seq_len=2048, global_batch_size=1536)
    HARDWARE, CLUSTER = load_hardware("a100_80gb"), load_cluster("dgx_a100", num_gpus=512)


    def plan_columns():
        # llm-analysis runs sequence parallelism wherever tp > 1 (sp_size = tp_size)
        cols = enumerate_plans(MODEL, TRAINING, HARDWARE, CLUSTER, SPACE).columns
        return cols.take(cols.array("sequence_parallel") == (cols.array("tp") > 1))
    """
)

OURS_FRESH = SETUP + textwrap.dedent(
    """
    from stage_dse.cost.table import evaluate_columns
    names, y = evaluate_columns(plan_columns())
    print(len(y))
    """
)

PEER = textwrap.dedent(
    """
    import logging
    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import (ParallelismConfig, get_dtype_config_by_name,
                                     get_gpu_config_by_name, get_model_config_by_name)

    logging.disable(logging.CRITICAL)
    RECOMPUTE = {"none": 0, "selective": 1, "full": 2}


    def peer_loop(plans):
        model = get_model_config_by_name("megatron-lm-175b")
        gpu = get_gpu_config_by_name("a100-sxm-80gb")
        dtype = get_dtype_config_by_name("w16a16e16")
        out = []
        for dp, tp, pp, mbs, zero, rc in plans:
            a = LLMAnalysis(model, gpu, dtype,
                            ParallelismConfig(tp_size=tp, pp_size=pp, dp_size=dp),
                            flops_efficiency=0.5, hbm_memory_efficiency=0.9)
            r = a.training(batch_size_per_gpu=mbs, global_batch_size=1536, seq_len=2048,
                           activation_recomputation=ActivationRecomputation(RECOMPUTE[rc]),
                           ds_zero=DSZeRO(zero))
            out.append(r["latency_per_iter"])
        return out
    """
)

PEER_FRESH = PEER + textwrap.dedent(
    """
    import json, sys
    print(len(peer_loop([tuple(p) for p in json.loads(sys.argv[1])])))
    """
)


CALLS = 20
"""Whole-table calls per timed pass (one 672-plan table is a few milliseconds of CPU)."""


def plan_tuples(columns) -> list[tuple]:
    return [
        (int(dp), int(tp), int(pp), int(mbs), int(z), str(rc))
        for dp, tp, pp, mbs, z, rc in zip(
            columns.array("dp"),
            columns.array("tp"),
            columns.array("pp"),
            columns.array("micro_batch"),
            columns.array("zero_stage"),
            columns.array("recompute"),
            strict=True,
        )
    ]


def run_child(code: str, *args: str, env: dict | None = None) -> tuple[float, str]:
    """CPU seconds (user + system) of one fresh interpreter running ``code``."""
    before = os.times()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, env=env, check=False
    )
    after = os.times()
    if proc.returncode:
        raise SystemExit(f"child failed:\n{proc.stderr.decode()[-2000:]}")
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return cpu, proc.stdout.decode().strip()


def in_process(repeat: int) -> dict[str, float]:
    scope: dict = {}
    exec(SETUP + PEER, scope)
    import stage_dse.cost.compile as compile_module
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.cost.table import evaluate_columns, evaluate_plans
    from stage_dse.spec import ParallelPlan

    columns = scope["plan_columns"]()
    plans = plan_tuples(columns)
    ours = [
        ParallelPlan(
            dp=dp,
            tp=tp,
            pp=pp,
            micro_batch_size=mbs,
            zero_stage=z,
            recompute=rc,
            sequence_parallel=tp > 1,
        )
        for dp, tp, pp, mbs, z, rc in plans
    ]
    args = (scope["MODEL"], scope["TRAINING"])
    kw = {"hardware": scope["HARDWARE"], "cluster": scope["CLUSTER"]}
    frame = columns.frame()

    def loop_ours() -> None:
        for p in ours:
            evaluate_plan(*args, p, **kw)

    def timed(figures: dict, name: str, run) -> None:
        t = time.process_time()
        run()
        figures.setdefault(name, []).append(time.process_time() - t)

    figures: dict[str, list[float]] = {}
    scope["peer_loop"](plans)
    # as the first process to meet the families runs them: derived, then interpreted
    loop_ours()
    for _ in range(repeat):
        timed(figures, "peer", lambda: scope["peer_loop"](plans))
        timed(figures, "per_plan_interpreted", loop_ours)
    # as any later process runs them: compiled (from the second process on)
    compile_module.LLVM_MIN_ROWS = 0
    loop_ours()
    evaluate_columns(columns)
    evaluate_plans(frame)
    for _ in range(repeat):
        timed(figures, "peer", lambda: scope["peer_loop"](plans))
        timed(figures, "per_plan", loop_ours)
        # one table takes a few ms: time CALLS of them (CPU-time accounting is coarse)
        timed(figures, "table", lambda: [evaluate_columns(columns) for _ in range(CALLS)])
        timed(figures, "frame", lambda: [evaluate_plans(frame) for _ in range(CALLS)])
    out = {k: statistics.median(v) for k, v in figures.items()}
    out["table"] /= CALLS
    out["frame"] /= CALLS
    out["plans"] = len(plans)
    return out


def fresh(repeat: int, plans_json: str) -> dict[str, float]:
    """Medians of ``repeat`` rounds of fresh processes: llm-analysis, then this package with
    a new empty cache three times (first, second and third process to meet the families),
    then with another empty cache and the shipped family programs off (``STAGE_DSE_SHIPPED=0``:
    every family derived, as for a model outside the presets), twice."""
    names = ("peer", "first", "second", "third", "derived", "derived_second")
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeat):
        cpu["peer"].append(run_child(PEER_FRESH, plans_json)[0])
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, STAGE_DSE_CACHE=cache)
            for name in ("first", "second", "third"):
                cpu[name].append(run_child(OURS_FRESH, env=env)[0])
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, STAGE_DSE_CACHE=cache, STAGE_DSE_SHIPPED="0")
            for name in ("derived", "derived_second"):
                cpu[name].append(run_child(OURS_FRESH, env=env)[0])
    return {k: statistics.median(v) for k, v in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed passes / fresh rounds")
    a = parser.parse_args()
    try:
        import llm_analysis  # noqa: F401
    except ImportError:
        raise SystemExit("llm-analysis is not installed: pip install llm-analysis") from None
    import json

    with tempfile.TemporaryDirectory() as cache:
        os.environ["STAGE_DSE_CACHE"] = cache  # read when the cache is first used
        w = in_process(a.repeat)
    n = int(w["plans"])
    us = 1e6 / n
    peer = w["peer"]
    print(f"plans={n} (GPT-3 175B, 512 A100s); CPU time per plan, medians of {a.repeat}:")
    print(f"  llm-analysis loop                   {peer * us:8.1f} us")
    for label, name in (
        ("evaluate_plan loop, interpreted", "per_plan_interpreted"),
        ("evaluate_plan loop, compiled", "per_plan"),
        ("evaluate_columns (sweeps), compiled", "table"),
        ("evaluate_plans (pandas), compiled", "frame"),
    ):
        print(f"  {label:35s} {w[name] * us:8.2f} us  ({peer / w[name]:.1f}x)")
    scope: dict = {}
    exec(SETUP, scope)
    columns = scope["plan_columns"]()
    f = fresh(a.repeat, json.dumps(plan_tuples(columns)))
    print(f"a fresh process answering the {n} plans, CPU-s (medians of {a.repeat}):")
    print(f"  llm-analysis                        {f['peer']:8.2f}")
    for label, name in (
        ("stage_dse, empty cache", "first"),
        ("stage_dse, second process", "second"),
        ("stage_dse, third process", "third"),
        ("stage_dse, empty cache, none shipped", "derived"),
        ("stage_dse, second, none shipped", "derived_second"),
    ):
        print(f"  {label:35s} {f[name]:8.2f}  ({f['peer'] / f[name]:.2f}x)")
    print(
        f"plans={n} per_plan_ratio={peer / w['per_plan']:.2f} "
        f"per_plan_interpreted_ratio={peer / w['per_plan_interpreted']:.2f} "
        f"table_ratio={peer / w['table']:.1f} fresh_empty_ratio={f['peer'] / f['first']:.2f} "
        f"fresh_second_ratio={f['peer'] / f['second']:.2f} "
        f"fresh_third_ratio={f['peer'] / f['third']:.2f} "
        f"fresh_unshipped_ratio={f['peer'] / f['derived']:.2f} "
        f"fresh_unshipped_second_ratio={f['peer'] / f['derived_second']:.2f}"
    )


if __name__ == "__main__":
    main()
