"""Analysis helpers over a results dataset (pandas in, pandas out; no writing)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

from stage_dse.errors import StageDseError
from stage_dse.results.store import ResultStore

__all__ = ["best_per", "load", "pareto"]


def load(path: str | os.PathLike, filters=None, columns: list[str] | None = None) -> pd.DataFrame:
    """Read a sweep's results folder (``results/<sweep>``) as a DataFrame.

    ``filters`` is a pyarrow expression (``pyarrow.dataset.field("status") == "ok"``) or a
    list of ``(column, op, value)`` tuples as in ``pandas.read_parquet``.
    """
    import pyarrow.parquet as pq

    if not os.path.isdir(path):
        raise StageDseError(f"{path} is not a results folder (no such directory)")
    if isinstance(filters, list):
        filters = pq.filters_to_expression(filters)
    return ResultStore(path).read(columns=columns, filters=filters)


def pareto(df: pd.DataFrame, objectives: Sequence[str], feasible_only: bool = True) -> pd.DataFrame:
    """Rows not dominated on ``objectives`` (all minimized; prefix a name with ``-`` to
    maximize), sorted by the first objective."""
    if feasible_only and "status" in df:
        df = df[df["status"] == "ok"]
    if len(df) == 0:
        return df
    cols, signs = [], []
    for obj in objectives:
        sign = -1.0 if obj.startswith("-") else 1.0
        cols.append(obj.lstrip("-"))
        signs.append(sign)
    values = df[cols].to_numpy(dtype=np.float64) * np.asarray(signs)
    order = np.lexsort(values.T[::-1])
    values = values[order]
    keep = np.ones(len(values), dtype=bool)
    for i in range(len(values)):
        if not keep[i]:
            continue
        later = values[i + 1 :]
        dominated = np.all(later >= values[i], axis=1) & np.any(later > values[i], axis=1)
        keep[i + 1 :] &= ~dominated
        same = np.all(later == values[i], axis=1)
        keep[i + 1 :] &= ~same
    return df.iloc[order[keep]].sort_values(cols[0])


def best_per(df: pd.DataFrame, by: str | Sequence[str], objective: str = "step_s") -> pd.DataFrame:
    """The best feasible row (lowest ``objective``) for each value of ``by``."""
    ok = df[df["status"] == "ok"] if "status" in df else df
    if len(ok) == 0:
        return ok
    idx = ok.groupby(list([by] if isinstance(by, str) else by), observed=True)[objective].idxmin()
    return ok.loc[idx].sort_values(list([by] if isinstance(by, str) else by))
