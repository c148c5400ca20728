"""The pure evaluation function every executor runs: plan rows in, result rows out.

``evaluate_batch`` takes a batch of a plan table (valid plans, see
:mod:`stage_dse.cost.table`) and returns result rows in the schema of
:mod:`stage_dse.results.schema`. It does no I/O except reading the compiled-family cache, and
it never raises for a row: a plan that does not fit is ``infeasible`` with its numbers and the
missing bytes in ``reason``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from stage_dse import __version__
from stage_dse.cost.table import evaluate_table
from stage_dse.results.schema import CONFIG_COLUMNS, RESULT_SCHEMA, config_hash, cost_columns

__all__ = ["error_rows", "evaluate_batch", "finalize_rows", "invalid_rows"]

GIB = 2.0**30


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
    rows["status"] = np.where(fits, "ok", "infeasible")
    need = costs["mem_total"].to_numpy() / GIB
    have = batch["usable_memory"].to_numpy() / GIB
    reason = pd.Series("", index=rows.index, dtype=object)
    bad = ~fits
    if bad.any():
        reason[bad] = [
            f"needs {n:.1f} GiB > usable {h:.1f} GiB (short {n - h:.1f} GiB)"
            for n, h in zip(need[bad], have[bad])
        ]
    rows["reason"] = reason.astype(str)
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
