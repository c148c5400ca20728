"""The pure evaluation function every executor runs: plan rows in, result rows out.

``evaluate_batch`` takes a batch of a plan table (valid plans, see
:mod:`stage_dse.cost.table`) and returns result rows in the schema of
:mod:`stage_dse.results.schema`. It does no I/O except reading the compiled-family cache, and
it never raises for a row: a plan that does not fit is ``infeasible`` with its numbers and the
missing bytes in ``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from stage_dse import __version__
from stage_dse.cost.table import evaluate_table
from stage_dse.results.schema import (
    CONFIG_COLUMNS,
    RESULT_SCHEMA,
    SERVING_COLUMNS,
    config_hash,
    cost_columns,
)
from stage_dse.search.space import SearchSpace, enumerate_plans
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec, TrainingSpec

SERVING_OUTPUTS = set(SERVING_COLUMNS.values())

__all__ = [
    "Block",
    "block_configs",
    "error_rows",
    "evaluate_batch",
    "evaluate_block",
    "finalize_rows",
    "invalid_rows",
]

GIB = 2.0**30
INFEASIBLE_REASON = "does not fit in usable memory (short by -mem_headroom_bytes)"


def finalize_rows(configs: pd.DataFrame, costs: pd.DataFrame | None, sweep: str) -> pd.DataFrame:
    """Result rows in schema order: configs, their hash, outcome, costs, provenance."""
    out = configs[list(CONFIG_COLUMNS)].copy()
    if "config_hash" in configs:
        out.insert(0, "config_hash", configs["config_hash"].astype(str))
    else:
        out.insert(0, "config_hash", config_hash(configs))
    out.insert(1, "sweep", sweep)
    if costs is not None:
        cc = cost_columns(costs)
        for c in cc.columns:
            out[c] = cc[c].to_numpy()
    for field in RESULT_SCHEMA:
        if field.name not in out:
            out[field.name] = None
    out["package_version"] = __version__
    return out[[f.name for f in RESULT_SCHEMA]]


def evaluate_batch(batch: pd.DataFrame, sweep: str = "default") -> pd.DataFrame:
    """Evaluate valid plans; status ``ok`` when they fit in usable memory, else ``infeasible``."""
    costs = evaluate_table(batch)
    rows = finalize_rows(batch, costs, sweep)
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


def invalid_rows(configs: pd.DataFrame, reasons: list[str], sweep: str) -> pd.DataFrame:
    rows = finalize_rows(configs, None, sweep)
    rows["status"] = "invalid"
    rows["reason"] = reasons
    return rows


def error_rows(configs: pd.DataFrame, message: str, sweep: str) -> pd.DataFrame:
    rows = finalize_rows(configs, None, sweep)
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


def block_configs(block: Block) -> pd.DataFrame:
    """The plan table of a block, with its config hashes."""
    e = enumerate_plans(
        block.model,
        block.training,
        block.hardware,
        block.cluster,
        block.space,
        rows=slice(block.start, block.stop),
    )
    table = e.table
    if block.memory_limit_bytes is not None:
        table["usable_memory"] = float(block.memory_limit_bytes)
    table["config_hash"] = config_hash(table).to_numpy()
    return table


def evaluate_block(block: Block, sweep: str, done: frozenset[str] | None = None) -> pa.Table:
    """Enumerate a block, drop configurations already in ``done``, evaluate the rest; the
    result rows come back as an Arrow table in the results schema (ready to write)."""
    table = block_configs(block)
    if done:
        table = table[~table["config_hash"].isin(done).to_numpy()]
    if len(table) == 0:
        return RESULT_SCHEMA.empty_table()
    return rows_table(table, evaluate_table(table), sweep)


def _dictionary(codes: np.ndarray, categories: list[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.int32)), pa.array(categories, type=pa.string())
    )


def _column(series: pd.Series, field: pa.Field) -> pa.Array:
    if pa.types.is_dictionary(field.type):
        cat = series if isinstance(series.dtype, pd.CategoricalDtype) else series.astype("category")
        return _dictionary(cat.cat.codes.to_numpy(), [str(c) for c in cat.cat.categories])
    return pa.array(series.to_numpy(), type=field.type)


def rows_table(configs: pd.DataFrame, costs: pd.DataFrame, sweep: str) -> pa.Table:
    """Result rows of evaluated plans straight into Arrow (no intermediate DataFrame)."""
    n = len(configs)
    fits = costs["mem_headroom_bytes"].to_numpy() >= 0
    bad = (~fits).astype(np.int32)
    cc = cost_columns(costs)
    zeros = np.zeros(n, dtype=np.int32)
    arrays = []
    for field in RESULT_SCHEMA:
        name = field.name
        if name == "config_hash":
            arrays.append(pa.array(configs["config_hash"].to_numpy(dtype=str), type=pa.string()))
        elif name == "sweep":
            arrays.append(_dictionary(zeros, [sweep]))
        elif name == "status":
            arrays.append(_dictionary(bad, ["ok", "infeasible"]))
        elif name == "reason":
            arrays.append(_dictionary(bad, ["", INFEASIBLE_REASON]))
        elif name == "package_version":
            arrays.append(_dictionary(zeros, [__version__]))
        elif name in SERVING_OUTPUTS:
            arrays.append(pa.nulls(n, pa.float64()))
        elif name == "trace_dir":
            arrays.append(pa.nulls(n, pa.string()))
        elif name in cc:
            arrays.append(pa.array(cc[name].to_numpy(dtype=np.float64)))
        else:
            arrays.append(_column(configs[name], field))
    return pa.Table.from_arrays(arrays, schema=RESULT_SCHEMA)
