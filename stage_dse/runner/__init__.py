"""Running sweeps: the pure batch evaluation, its executors (local, Ray), the sweep driver."""

from stage_dse.runner.evaluate import evaluate_batch
from stage_dse.runner.executors import LocalExecutor, RayExecutor, make_executor
from stage_dse.runner.sweep import SweepReport, SweepSpec, build_table, run_grid, top_table

__all__ = [
    "LocalExecutor",
    "RayExecutor",
    "SweepReport",
    "SweepSpec",
    "build_table",
    "evaluate_batch",
    "make_executor",
    "run_grid",
    "top_table",
]
