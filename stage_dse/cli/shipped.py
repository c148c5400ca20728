"""``python -m stage_dse.cli.shipped``: rewrite (or ``--check``) the numpy programs the package
ships for the presets' common plan families (:mod:`stage_dse.cost.shipped`).

The tables whose families are shipped: the default sweep's plan space (``conf/config.yaml``:
Llama 3 8B on 64 H100s, 4096-token sequences, 256 per step, Megatron-Core, every valid plan)
and GPT-3 175B on 512 A100s as ``benchmarks/bench_llm_analysis.py`` enumerates it, both
subsets a sweep evaluates (the memory check, then everything).
"""

from __future__ import annotations

import argparse

from stage_dse.cost.key import CostKey
from stage_dse.cost.shipped import FAMILIES, shipped_files, write_shipped

__all__ = ["main", "preset_families", "preset_tables", "stale"]


def preset_tables() -> list:
    """The plan tables (``PlanColumns``) whose families are shipped."""
    from stage_dse.config import load_cluster, load_framework, load_hardware, load_model
    from stage_dse.search import SearchSpace, enumerate_plans
    from stage_dse.spec import TrainingSpec

    default = enumerate_plans(
        load_model("llama3_8b"),
        TrainingSpec(seq_len=4096, global_batch_size=256),
        load_hardware("h100_sxm"),
        load_cluster("dgx_h100", num_gpus=64),
        SearchSpace(frameworks=(load_framework("megatron_core"),)),
    ).columns
    space = SearchSpace(
        tp=(1, 2, 4, 8),
        pp=(1, 2, 4, 8, 16),
        micro_batch_size=(1, 2, 4),
        zero_stage=(0, 1, 2, 3),
        recompute=("none", "selective", "full"),
        sequence_parallel=(False, True),
    )
    gpt3 = enumerate_plans(
        load_model("gpt3_175b"),
        TrainingSpec(seq_len=2048, global_batch_size=1536),
        load_hardware("a100_80gb"),
        load_cluster("dgx_a100", num_gpus=512),
        space,
    ).columns
    return [default, gpt3]


def preset_families() -> set[tuple[CostKey, str]]:
    """Every (family, output subset) the preset tables' evaluation meets."""
    from stage_dse.cost.compile import record_families
    from stage_dse.cost.table import evaluate_columns

    with record_families() as met:
        for table in preset_tables():
            for subset in ("memory", "all"):
                evaluate_columns(table, subset)
    return met


def stale() -> tuple[list[str], list[str]]:
    """(missing, extra) shipped file names against the preset tables' families."""
    want = shipped_files(preset_families())
    have = {p.name for p in FAMILIES.glob("*.txt")}
    return sorted(want - have), sorted(have - want)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stage_dse.cli.shipped",
        description="Rewrite the shipped numpy programs of the preset tables' plan families.",
    )
    parser.add_argument("--check", action="store_true", help="only say whether they are current")
    args = parser.parse_args(argv)
    if args.check:
        missing, extra = stale()
        print(f"{len(missing)} missing, {len(extra)} stale")
        return 1 if missing or extra else 0
    written, removed = write_shipped(preset_families())
    print(f"wrote {written} family programs to {FAMILIES}, removed {removed} stale ones")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
