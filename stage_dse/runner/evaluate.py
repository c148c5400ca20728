"""The pure evaluation function every executor runs: plan rows in, result rows out.

``evaluate_batch`` takes a batch of a plan table (valid plans, see
:mod:`stage_dse.cost.table`) and returns result rows in the schema of
:mod:`stage_dse.results.schema`. It does no I/O except reading the compiled-family cache, and
it never raises for a row: a plan that does not fit is ``infeasible`` with its numbers and the
missing bytes in ``reason``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from stage_dse import __version__
from stage_dse.cost.columns import SERVING_COLUMNS, cost_arrays, cost_columns
from stage_dse.cost.labels import Labels
from stage_dse.cost.table import PlanColumns, evaluate_columns, evaluate_table
from stage_dse.results.schema import (
    CONFIG_COLUMNS,
    RESULT_SCHEMA,
    config_hash,
    config_hash_u64,
    hex_hashes,
)
from stage_dse.results.store import among, encode_part
from stage_dse.runner.aggregate import RunSummary
from stage_dse.search.space import SearchSpace, enumerate_plans
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec, TrainingSpec

SERVING_OUTPUTS = set(SERVING_COLUMNS.values())

__all__ = [
    "Block",
    "EncodedPart",
    "block_configs",
    "block_plans",
    "done_hashes",
    "error_rows",
    "evaluate_batch",
    "evaluate_block",
    "evaluate_part",
    "finalize_rows",
    "invalid_rows",
    "rows_table",
]

GIB = 2.0**30
INFEASIBLE_REASON = "does not fit in usable memory (short by -mem_headroom_bytes)"


def finalize_rows(
    configs: pd.DataFrame, costs: pd.DataFrame | None, sweep: str, run_id: str = ""
) -> pd.DataFrame:
    """Result rows in schema order: configs, their hash, outcome, costs, provenance."""
    out = configs[list(CONFIG_COLUMNS)].copy()
    if "config_hash" in configs:
        out.insert(0, "config_hash", configs["config_hash"].astype(str))
    else:
        out.insert(0, "config_hash", config_hash(configs))
    out.insert(1, "sweep", sweep)
    out.insert(2, "run_id", run_id)
    if costs is not None:
        cc = cost_columns(costs)
        for c in cc.columns:
            out[c] = cc[c].to_numpy()
    if "framework" in configs:
        out["framework"] = configs["framework"].to_numpy()
    for field in RESULT_SCHEMA:
        if field.name not in out:
            out[field.name] = None
    out["package_version"] = __version__
    out["timing"] = configs["timing"].to_numpy() if "timing" in configs else "roofline"
    return out[[f.name for f in RESULT_SCHEMA]]


def evaluate_batch(
    batch: pd.DataFrame,
    sweep: str = "default",
    run_id: str = "",
    measured_gpu: dict[str, str | None] | None = None,
) -> pd.DataFrame:
    """Evaluate valid plans; status ``ok`` when they fit in usable memory, else ``infeasible``.
    A ``timing`` column of ``measured`` times kernels from the table sets ``measured_gpu``
    names per hardware."""
    timing = str(batch["timing"].iloc[0]) if "timing" in batch and len(batch) else "roofline"
    costs = evaluate_table(batch, timing=timing, measured_gpu=measured_gpu)
    rows = finalize_rows(batch, costs, sweep, run_id)
    headroom = costs["mem_headroom_bytes"].to_numpy()
    fits = headroom >= 0
    rows["status"] = pd.Categorical.from_codes(
        (~fits).astype(np.int8), categories=["ok", "infeasible"]
    )
    # the shortfall itself is -mem_headroom_bytes (same row): the reason stays categorical
    rows["reason"] = pd.Categorical.from_codes(
        (~fits).astype(np.int8), categories=["", INFEASIBLE_REASON]
    )
    return rows


def invalid_rows(
    configs: pd.DataFrame, reasons: list[str], sweep: str, run_id: str = ""
) -> pd.DataFrame:
    rows = finalize_rows(configs, None, sweep, run_id)
    rows["status"] = "invalid"
    rows["reason"] = reasons
    return rows


def error_rows(configs: pd.DataFrame, message: str, sweep: str, run_id: str = "") -> pd.DataFrame:
    rows = finalize_rows(configs, None, sweep, run_id)
    rows["status"] = "error"
    rows["reason"] = message
    return rows


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` of the valid plans of one enumeration: small to send, rebuilt
    (deterministically) where it is evaluated."""

    model: ModelSpec
    training: TrainingSpec
    hardware: HardwareSpec
    cluster: ClusterSpec
    space: SearchSpace
    memory_limit_bytes: float | None
    start: int
    stop: int
    timing: str = "roofline"


def block_plans(block: Block) -> PlanColumns:
    """The plans of a block, as columns (rebuilt from the enumeration)."""
    plans = enumerate_plans(
        block.model,
        block.training,
        block.hardware,
        block.cluster,
        block.space,
        rows=slice(block.start, block.stop),
    ).columns
    assert plans is not None
    if block.memory_limit_bytes is not None:
        plans.columns["usable_memory"] = float(block.memory_limit_bytes)
    plans.columns["timing"] = block.timing
    return plans


def block_configs(block: Block) -> pd.DataFrame:
    """The plan table of a block, with its config hashes."""
    plans = block_plans(block)
    table = plans.frame()
    table["config_hash"] = config_hash(plans).to_numpy()
    return table


def done_hashes(hashes: Iterable[str]) -> np.ndarray:
    """Stored config hashes as the sorted uint64 array :func:`evaluate_block` skips."""
    return np.unique(np.fromiter((int(h, 16) for h in hashes), dtype=np.uint64))


def evaluate_block(
    block: Block, sweep: str, done: np.ndarray | None = None, run_id: str = ""
) -> pa.Table:
    """Enumerate a block, drop configurations already in ``done`` (see :func:`done_hashes`),
    evaluate the rest; the result rows come back as an Arrow table in the results schema,
    built column by column from the plan and cost arrays (no DataFrame on the way)."""
    plans = block_plans(block)
    hashes = config_hash_u64(plans)
    if done is not None and len(done):
        keep = ~among(hashes, done)
        plans, hashes = plans.take(keep), hashes[keep]
    if len(plans) == 0:
        return RESULT_SCHEMA.empty_table()
    gpu = None
    if block.timing == "measured":
        from stage_dse.kernels.tables import table_set

        gpu = table_set(block.hardware)
    names, out = evaluate_columns(plans, timing=block.timing, measured_gpu=gpu)
    return rows_table(plans, hashes, cost_arrays(names, out), sweep, run_id)


@dataclass(frozen=True)
class EncodedPart:
    """What a sweep task sends back: one Parquet part file, encoded, its row counts, the
    summary partial of its rows and the CPU time the task took."""

    data: bytes
    rows: int
    status: dict[str, int]
    summary: RunSummary | None = None
    cpu_s: float = 0.0
    """Thread CPU seconds of the task (enumeration, evaluation, encoding): the measured cost
    per plan that ``runner=auto`` and the Ray block size go by."""


def evaluate_part(
    block: Block,
    sweep: str,
    done: np.ndarray | None = None,
    run_id: str = "",
    top_k: int = 10,
) -> EncodedPart:
    """:func:`evaluate_block`, encoded as a part file where it ran: Parquet encoding is spread
    over the workers and a compressed part travels instead of the Arrow columns, with the
    summary of its rows (:class:`~stage_dse.runner.aggregate.RunSummary`, ``top_k`` best)."""
    t0 = time.thread_time()
    table = evaluate_block(block, sweep, done, run_id)
    summary = RunSummary(top_k=top_k)
    summary.add(table)
    data = encode_part(table) if len(table) else b""
    return EncodedPart(data, len(table), dict(summary.status), summary, time.thread_time() - t0)


def _dictionary(codes: np.ndarray, categories: list[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.int32)), pa.array(categories, type=pa.string())
    )


def _config_column(plans: PlanColumns, name: str, field: pa.Field) -> pa.Array:
    value = plans.columns[name]
    n = len(plans)
    if pa.types.is_dictionary(field.type):
        if isinstance(value, Labels | pd.Categorical):
            return _dictionary(value.codes, [str(c) for c in value.categories])
        if isinstance(value, np.ndarray):
            cat = pd.Categorical(value.astype(str))
            return _dictionary(cat.codes, list(cat.categories))
        return _dictionary(np.zeros(n, dtype=np.int32), [str(value)])
    if plans.is_constant(name):
        value = np.full(n, value)
    return pa.array(value, type=field.type)


def rows_table(
    plans: PlanColumns,
    hashes: np.ndarray,
    costs: dict[str, np.ndarray],
    sweep: str,
    run_id: str = "",
) -> pa.Table:
    """Result rows of evaluated plans (``costs`` from :func:`cost_arrays`) as Arrow."""
    n = len(plans)
    bad = (~(costs["mem_headroom_bytes"] >= 0)).astype(np.int32)  # as evaluate_batch: NaN fails
    zeros = np.zeros(n, dtype=np.int32)
    offsets = np.arange(0, 16 * (n + 1), 16, dtype=np.int32)
    arrays = []
    for field in RESULT_SCHEMA:
        name = field.name
        if name == "config_hash":
            data = hex_hashes(hashes)
            arrays.append(pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data)))
        elif name == "sweep":
            arrays.append(_dictionary(zeros, [sweep]))
        elif name == "run_id":
            arrays.append(_dictionary(zeros, [run_id]))
        elif name == "status":
            arrays.append(_dictionary(bad, ["ok", "infeasible"]))
        elif name == "reason":
            arrays.append(_dictionary(bad, ["", INFEASIBLE_REASON]))
        elif name == "package_version":
            arrays.append(_dictionary(zeros, [__version__]))
        elif name in SERVING_OUTPUTS:
            arrays.append(pa.nulls(n, pa.float64()))
        elif name in ("serving_mode", "request_mix", "engine", "weight_only", "output_lengths",
                      "moe_routing", "moe_dispatch"):  # fmt: skip
            arrays.append(pa.nulls(n, field.type))
        elif name in ("prefill_budget", "arrival_rate", "draft_tokens", "acceptance", "clients",
                      "burst", "max_total_tokens"):  # fmt: skip
            arrays.append(pa.nulls(n, pa.float64()))
        elif name == "timing":
            arrays.append(_dictionary(zeros, [str(plans.columns.get("timing", "roofline"))]))
        elif name == "framework" and name not in plans.columns:
            arrays.append(pa.nulls(n, field.type))
        elif name == "trace_dir":
            arrays.append(pa.nulls(n, pa.string()))
        elif name == "trace_replay_s":
            arrays.append(pa.nulls(n, pa.float64()))
        elif name in costs:  # NaN (an output the family does not have) is stored as null
            arrays.append(pa.array(costs[name], type=pa.float64(), from_pandas=True))
        else:
            arrays.append(_config_column(plans, name, field))
    return pa.Table.from_arrays(arrays, schema=RESULT_SCHEMA)
