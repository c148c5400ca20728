"""Cold start: what a first question costs in a fresh process with an empty compile cache.

Each case runs in its own Python process with ``STAGE_DSE_CACHE`` pointing at a new empty
folder, so nothing compiled by an earlier run helps; CPU seconds are the child's user+system
time (``resource.getrusage(RUSAGE_CHILDREN)``, Ray's own processes included for the sweep as
far as they are children that have ended), wall seconds its elapsed time.

* ``one_plan``: import the package, evaluate one plan with :func:`evaluate_plan` (Llama-3-70B,
  1024 H100s, the README's example plan);
* ``table``: import, enumerate and evaluate the plan table of GPT-3 175B on 512 A100s
  (tp 1-8, every pp, sequence parallelism, ZeRO 0-3, each recompute mode, micro-batch 1/2/4);
* ``default_sweep``: the README's ``stage-dse`` in an empty working directory (default runner).

Run: ``python benchmarks/bench_cold.py``. The last line is machine readable.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ONE_PLAN = textwrap.dedent(
    """
    from stage_dse.config import load_cluster, load_hardware, load_model
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.spec import ParallelPlan, TrainingSpec

    plan = ParallelPlan(dp=16, tp=8, pp=8, sequence_parallel=True, zero_stage=1,
                        recompute="selective", schedule="interleaved", virtual_stages=5)
    r = evaluate_plan(load_model("llama3_70b"), TrainingSpec(seq_len=8192, global_batch_size=1024),
                      plan, hardware=load_hardware("h100_sxm"),
                      cluster=load_cluster("dgx_h100", num_gpus=1024))
    print(f"step_s={r['step_s']:.4g}")
    """
)
TABLE = textwrap.dedent(
    """
    from stage_dse.config import load_cluster, load_hardware, load_model
    from stage_dse.cost.table import evaluate_plans
    from stage_dse.search import SearchSpace, enumerate_plans
    from stage_dse.spec import TrainingSpec

    space = SearchSpace(tp=(1, 2, 4, 8), sequence_parallel=(True,), micro_batch_size=(1, 2, 4))
    plans = enumerate_plans(load_model("gpt3_175b"),
                            TrainingSpec(seq_len=2048, global_batch_size=1536),
                            load_hardware("a100_80gb"), load_cluster("dgx_a100", num_gpus=512),
                            space)
    t = evaluate_plans(plans.table)
    fits = t[t.mem_headroom_bytes >= 0]
    print(f"plans={len(t)} fit={len(fits)} best_step_s={fits.step_s.min():.4g}")
    """
)


def run_case(name: str, argv: list[str], cwd: Path, cache: Path) -> tuple[float, float, str]:
    env = dict(os.environ, STAGE_DSE_CACHE=str(cache))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if out.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{out.stderr[-2000:]}")
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    print(f"case={name} cpu_s={cpu:.2f} wall_s={wall:.2f}  # {last[:100]}", flush=True)
    return cpu, wall, out.stdout


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = {}
        for name, argv in (
            ("one_plan", [sys.executable, "-c", ONE_PLAN]),
            ("table", [sys.executable, "-c", TABLE]),
            ("default_sweep", ["stage-dse"]),
        ):
            work, cache = root / name, root / f"{name}-cache"
            work.mkdir()
            cache.mkdir()
            cases[name] = run_case(name, argv, work, cache)
    print(
        f"cold_one_plan_cpu_s={cases['one_plan'][0]:.2f} "
        f"cold_table_cpu_s={cases['table'][0]:.2f} "
        f"default_sweep_wall_s={cases['default_sweep'][1]:.2f}"
    )


if __name__ == "__main__":
    main()
