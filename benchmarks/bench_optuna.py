"""How well the Optuna search does against the enumerated optimum, on a small and a large space.

Spaces (Llama-3-70B on DGX H100 nodes, objective ``step_s``):

- small: seq 4096, global batch 512, the default plan space (tp, pp every divisor, micro-batch
  1-8, ZeRO 0-3, three recompute modes, sequence parallelism) on 256 GPUs: ~2,200 valid plans.
- large: seq 8192, global batch 1024, a wide plan space (tp, pp, cp every divisor, micro-batch
  1-16, two attention kernels, virtual stages up to 10) on 256-8192 GPUs, with HBM (80, 141,
  192 GiB) and scale-out bandwidth (200-1600 Gbit/s) as co-design axes: ~12M configurations.

Each search runs ``--trials`` trials (default 1,000) with the TPE sampler in batches of
``--batch`` (default 64, the preset's) on the local executor into a fresh results folder.
Printed per space: trials asked, distinct configurations evaluated, the share of trials that
were invalid plans (``FAIL``), the share pruned for memory, the best step time found, the
enumerated optimum over every configuration of the space (memory-feasible plans only; the
enumeration evaluates every plan of every variant with the compiled evaluator, outside the
search's CPU time), the gap between them, and the search's CPU seconds (``time.process_time``:
sampling, screening, evaluation, Parquet writes).

Run: ``python benchmarks/bench_optuna.py`` (``--trials N``, ``--seeds 0 1 2``). With an older
checkout first on ``PYTHONPATH`` the same script measures its driver (then found at
``stage_dse.search.optuna_search``). The last line is machine readable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.columns import cost_arrays
from stage_dse.cost.table import evaluate_columns
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.spec import TrainingSpec
from stage_dse.spec.sweep import OptunaSpec

try:
    from stage_dse.runner.optuna_driver import run_optuna
except ImportError:  # an older checkout: the driver lived in search/
    from stage_dse.search.optuna_search import run_optuna

GIB = 2.0**30
MODEL, HW, CLUSTER = load_model("llama3_70b"), load_hardware("h100_sxm"), load_cluster("dgx_h100")


@dataclass(frozen=True)
class Case:
    name: str
    spec: SweepSpec
    hbm_gib: tuple[float, ...] = ()
    inter_gbit_s: tuple[float, ...] = ()


CASES = (
    Case(
        "small",
        SweepSpec(
            name="small",
            models=(MODEL,),
            training=TrainingSpec(seq_len=4096, global_batch_size=512),
            hardware=(HW,),
            cluster=CLUSTER,
            gpu_counts=(256,),
            space=SearchSpace(),
        ),
    ),
    Case(
        "large",
        SweepSpec(
            name="large",
            models=(MODEL,),
            training=TrainingSpec(seq_len=8192, global_batch_size=1024),
            hardware=(HW,),
            cluster=CLUSTER,
            gpu_counts=(256, 512, 1024, 2048, 4096, 8192),
            space=SearchSpace(
                tp="auto",
                pp="auto",
                cp="auto",
                micro_batch_size=(1, 2, 4, 8, 16),
                attention=("flash", "materialized"),
                virtual_stages=(1, 2, 3, 4, 5, 6, 8, 10),
            ),
        ),
        hbm_gib=(80.0, 141.0, 192.0),
        inter_gbit_s=(200.0, 400.0, 800.0, 1600.0),
    ),
)


def variants(case: Case):
    """(hardware, cluster) of every co-design combination, as the search builds them."""
    for gib in case.hbm_gib or (None,):
        hw = HW if gib is None else HW.replace(hbm_bytes=gib * GIB, name=f"{HW.name}@{gib:g}GiB")
        for gbit in case.inter_gbit_s or (None,):
            yield hw, gbit


def enumerated_optimum(case: Case, chunk: int = 200_000) -> tuple[int, float, float]:
    """(configurations, fastest memory-feasible step time, CPU seconds) by full enumeration."""
    t0 = time.process_time()
    spec, total, best = case.spec, 0, np.inf
    for g in spec.gpu_counts:
        for hw, gbit in variants(case):
            cluster = CLUSTER.replace(num_gpus=g)
            if gbit is not None:
                cluster = cluster.replace(inter_bandwidth_bytes_per_s=gbit * 1e9 / 8)
            valid = enumerate_plans(MODEL, spec.training, hw, cluster, spec.space, count_only=True)
            for start in range(0, valid.valid, chunk):
                rows = slice(start, start + chunk)
                e = enumerate_plans(MODEL, spec.training, hw, cluster, spec.space, rows=rows)
                names, out = evaluate_columns(e.columns)
                costs = cost_arrays(names, out)
                step = np.where(costs["mem_headroom_bytes"] >= 0, costs["step_s"], np.inf)
                best = min(best, float(step.min()))
                total += len(e.columns)
    return total, best, time.process_time() - t0


def search(case: Case, trials: int, seed: int, batch: int = 64) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench_optuna_"))
    try:
        settings = OptunaSpec(
            n_trials=trials,
            batch_size=batch,
            seed=seed,
            hbm_gib=case.hbm_gib,
            inter_gbit_s=case.inter_gbit_s,
        )
        t0 = time.process_time()
        run_optuna(
            case.spec,
            settings,
            LocalExecutor(),
            ResultStore(root / case.name),
            progress=False,
            log=lambda _: None,
        )
        cpu = time.process_time() - t0
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(root / case.name / "_optuna.journal"))
        )
        study = optuna.load_study(study_name=case.name, storage=storage)
        states = [t.state.name for t in study.trials]
        df = load(root / case.name)
        ok = df[df["status"] == "ok"]
        return {
            "trials": len(states),
            "distinct": int(df["config_hash"].nunique()),
            "invalid_share": states.count("FAIL") / len(states),
            "pruned_share": states.count("PRUNED") / len(states),
            "best_step_s": float(ok["step_s"].min()) if len(ok) else float("nan"),
            "cpu_s": cpu,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES])
    parser.add_argument("--batch", type=int, default=64, help="search.batch_size")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    summary = {}
    for case in (c for c in CASES if c.name in args.cases):
        size, optimum, enum_cpu = enumerated_optimum(case)
        print(
            f"{case.name}: {size:,} configurations; enumerated optimum {optimum:.3f} s "
            f"({enum_cpu:.2f} CPU-s to evaluate them all)"
        )
        runs = []
        for seed in args.seeds:
            r = search(case, args.trials, seed, args.batch)
            r["gap_pct"] = 100 * (r["best_step_s"] / optimum - 1)
            runs.append(r)
            print(
                f"  seed {seed}: {r['trials']:,} trials, {r['distinct']:,} distinct configs, "
                f"invalid {r['invalid_share']:.1%}, pruned (memory) {r['pruned_share']:.1%}, "
                f"best {r['best_step_s']:.3f} s (gap {r['gap_pct']:+.1f}%), "
                f"{r['cpu_s']:.1f} CPU-s"
            )
        summary[case.name] = {"configurations": size, "optimum_s": optimum, "runs": runs}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
