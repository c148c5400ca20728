"""A sweep's summary, aggregated from its result rows as they stream by.

The summary a user reads after a sweep (outcome counts, the fastest and the cheapest feasible
plans with their ties, the closest plans that do not fit, the fastest plan per model, hardware
and GPU count, the median share of measured kernel time) needs a few rows of a million. Each
executor task reduces the rows it evaluated to a :class:`RunSummary` (a few dozen rows of
:data:`SUMMARY_COLUMNS`); the driver merges them, so the dataset is never read back whole. Rows
a resumed sweep finds already stored are added from a scan of the results folder filtered by
their ``config_hash`` and projected to :data:`SUMMARY_COLUMNS`
(:meth:`stage_dse.results.store.ResultStore.scan`).

Exact for the ranking the top table makes (:func:`stage_dse.runner.sweep.top_table`): a part
keeps every feasible row within :data:`TIE_REL` of its own k-th best value. The k-th best of the
whole sweep is at most the k-th best of any part, so every row the global ranking can show or
tie with is kept by the part it came from, and merging prunes again the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

__all__ = ["MISSES", "SUMMARY_COLUMNS", "TIE_REL", "RunSummary"]

TIE_REL = 1e-3
"""Plans whose ranking value (step time, GPU-seconds) lies within this fraction of the first
plan of their group tie: a 0.1% difference is far below what the model resolves (its error
on published runs is some 15%), so the table says they tie and lists the one with more memory
headroom first instead of ranking them by noise."""

SUMMARY_COLUMNS = (
    "config_hash", "run_id", "status", "reason", "model", "hardware", "num_gpus", "dp", "tp",
    "pp", "cp", "ep", "micro_batch", "zero_stage", "dp_replicate", "recompute", "sequence_parallel",
    "virtual_stages", "schedule", "stage_layers", "framework", "step_s", "mfu", "mem_total_bytes",
    "mem_headroom_bytes", "measured_share",
)  # fmt: skip
"""The columns the summary reads: those of the top table, the closest misses and the counts."""
RANK_KEYS = ("step_s", "gpu_seconds")
"""The rankings kept: step time, and GPU-seconds per step (``mode=budget``)."""
MISSES = 5
"""Closest plans that do not fit, kept for ``mode=budget``."""
GROUP = ("model", "hardware", "num_gpus")


def _text(col: pa.Array) -> pa.Array:
    """A column with no nulls (null text is ``""``)."""
    if col.null_count == 0:
        return col
    if pa.types.is_dictionary(col.type) or pa.types.is_string(col.type):
        return col.cast(pa.string()).fill_null("")
    return col


def _categories(col: pa.Array) -> tuple[np.ndarray, list]:
    """Integer codes of a column's values (equal values, equal codes) within one array, and
    the value of each code."""
    col = _text(col)
    if pa.types.is_dictionary(col.type):
        return col.indices.to_numpy(zero_copy_only=False), col.dictionary.to_pylist()
    values = col.to_numpy(zero_copy_only=False)
    names, codes = np.unique(
        values.astype(str) if values.dtype == object else values, return_inverse=True
    )
    return codes, list(names)


def _codes(col: pa.Array) -> np.ndarray:
    """Integer codes of a column's values (equal values, equal codes) within one array."""
    return _categories(col)[0]


def _group_codes(col: pa.Array) -> np.ndarray:
    """Codes for grouping: integers as they are, text by :func:`_codes`."""
    if pa.types.is_integer(col.type) and col.null_count == 0:
        values = col.to_numpy()
        return values - values.min() if len(values) else values
    return _codes(col)


def _is(col: pa.Array, value: str) -> np.ndarray:
    """Rows whose (text) value is ``value``."""
    col = _text(col)
    if pa.types.is_dictionary(col.type):
        hit = [i for i, v in enumerate(col.dictionary.to_pylist()) if v == value]
        return np.isin(col.indices.to_numpy(zero_copy_only=False), hit)
    return col.to_numpy(zero_copy_only=False).astype(object) == value


def _floats(col: pa.Array) -> np.ndarray:
    return col.to_numpy(zero_copy_only=False).astype(np.float64)


def _plain(batch: pa.RecordBatch, idx: np.ndarray) -> pa.Table:
    """Rows ``idx`` of the summary columns, text as plain strings (parts have their own
    dictionaries; a few rows are cheaper to merge as strings)."""
    picked = batch.select(list(SUMMARY_COLUMNS)).take(pa.array(idx, type=pa.int64()))
    arrays = [a.cast(pa.string()) if pa.types.is_dictionary(a.type) else a for a in picked.columns]
    return pa.Table.from_arrays(arrays, names=list(SUMMARY_COLUMNS))


def _key(table: pa.RecordBatch | pa.Table, by: str) -> np.ndarray:
    step = _floats(table.column("step_s"))
    if by == "gpu_seconds":
        return step * table.column("num_gpus").to_numpy(zero_copy_only=False)
    return step


def _best_within_ties(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the values within :data:`TIE_REL` of the ``k``-th smallest (NaN never)."""
    finite = np.flatnonzero(~np.isnan(values))
    if len(finite) <= k:
        return finite
    kth = np.partition(values[finite], k - 1)[k - 1]
    return finite[values[finite] <= kth * (1 + TIE_REL)]


def _first_per_group(groups: list[np.ndarray], values: np.ndarray) -> np.ndarray:
    """Position of the smallest value in each group (the first one on equal values); groups
    are given by integer codes per column."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    key = np.zeros(len(values), dtype=np.int64)
    for codes in groups:
        codes = codes.astype(np.int64)
        key = key * (int(codes.max()) + 1) + codes
    if key[0] == key[-1] and (key == key[0]).all():  # one group (an evaluated block)
        return np.array([int(np.argmin(values))])
    order = np.lexsort((values, key))  # stable: equal values keep their order
    first = np.r_[True, key[order][1:] != key[order][:-1]]
    return order[first]


@dataclass
class RunSummary:
    """Partial aggregates of result rows; :meth:`add` rows, :meth:`merge` partials."""

    top_k: int = 10
    rows: int = 0
    reused: int = 0
    """Of ``rows``, those stored by an earlier run (a resumed sweep)."""
    status: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    """``(status, reason)`` of the rows not ``ok``."""
    top: dict[str, pa.Table] = field(default_factory=dict)
    misses: pa.Table | None = None
    best: pa.Table | None = None
    measured_share: list[np.ndarray] = field(default_factory=list)
    """Of the feasible rows this run evaluated (``timing=measured``)."""

    # ------------------------------------------------------------------ aggregation
    def add(self, rows: pa.Table | pa.RecordBatch, reused: bool = False) -> None:
        """Aggregate result rows (any columns of the results schema, at least
        :data:`SUMMARY_COLUMNS`)."""
        batches = rows.to_batches() if isinstance(rows, pa.Table) else [rows]
        for batch in batches:
            if batch.num_rows:
                self._add_batch(batch, reused)

    def _add_batch(self, batch: pa.RecordBatch, reused: bool) -> None:
        n = batch.num_rows
        self.rows += n
        self.reused += n if reused else 0
        status = batch.column("status")
        codes, names = _categories(status)
        counts = np.bincount(codes, minlength=len(names))
        ok_code = names.index("ok") if "ok" in names else -1
        rcodes, rnames = _categories(batch.column("reason"))
        for code, count in enumerate(counts):
            if not count:
                continue
            self.status[str(names[code])] += int(count)
            if code != ok_code:
                per = np.bincount(rcodes[codes == code], minlength=len(rnames))
                for r in np.flatnonzero(per):
                    self.reasons[(str(names[code]), str(rnames[r] or ""))] += int(per[r])
        ok = codes == ok_code
        ok_idx = np.flatnonzero(ok)
        if len(ok_idx):
            for by in RANK_KEYS:
                keep = ok_idx[_best_within_ties(_key(batch, by)[ok_idx], self.top_k)]
                self._merge_top(by, _plain(batch, keep))
            step = _floats(batch.column("step_s"))[ok_idx]
            groups = [_group_codes(batch.column(g))[ok_idx] for g in GROUP]
            finite = ~np.isnan(step)
            first = _first_per_group([g[finite] for g in groups], step[finite])
            self._merge_best(_plain(batch, ok_idx[finite][first]))
            if not reused:
                share = _floats(batch.column("measured_share"))[ok_idx]
                if not np.isnan(share).all():
                    self.measured_share.append(share)
        bad = np.flatnonzero(_is(status, "infeasible"))
        if len(bad):
            self._merge_misses(_plain(batch, bad[self._miss_order(batch, bad)]))

    @staticmethod
    def _miss_order(table, idx: np.ndarray) -> np.ndarray:
        """The :data:`MISSES` closest misses among rows ``idx``: least memory short first,
        then the fastest."""
        headroom = _floats(table.column("mem_headroom_bytes"))[idx]
        step = _floats(table.column("step_s"))[idx]
        return np.lexsort((step, -headroom))[:MISSES]

    def _merge_top(self, by: str, table: pa.Table) -> None:
        if by in self.top:
            table = pa.concat_tables([self.top[by], table])
        keep = _best_within_ties(_key(table, by), self.top_k)
        self.top[by] = table.take(pa.array(keep, type=pa.int64()))

    def _merge_best(self, table: pa.Table) -> None:
        if self.best is not None:
            table = pa.concat_tables([self.best, table])
        groups = [_group_codes(table.column(g).combine_chunks()) for g in GROUP]
        first = _first_per_group(groups, _floats(table.column("step_s")))
        self.best = table.take(pa.array(np.sort(first), type=pa.int64()))

    def _merge_misses(self, table: pa.Table) -> None:
        if self.misses is not None:
            table = pa.concat_tables([self.misses, table])
        order = self._miss_order(table, np.arange(table.num_rows))
        self.misses = table.take(pa.array(order, type=pa.int64()))

    def merge(self, other: RunSummary) -> None:
        """Fold another partial (of other rows) into this one."""
        self.rows += other.rows
        self.reused += other.reused
        self.status.update(other.status)
        self.reasons.update(other.reasons)
        for by, table in other.top.items():
            self._merge_top(by, table)
        if other.best is not None:
            self._merge_best(other.best)
        if other.misses is not None:
            self._merge_misses(other.misses)
        self.measured_share.extend(other.measured_share)

    # ------------------------------------------------------------------ answers
    def candidates(self, by: str = "step_s") -> pd.DataFrame:
        """The feasible rows the ranking by ``by`` can show (the ``top_k`` best and every row
        they tie with), for :func:`stage_dse.runner.sweep.top_table`."""
        return _frame(self.top.get(by))

    def closest_misses(self) -> pd.DataFrame:
        """The :data:`MISSES` plans that miss usable memory by the fewest bytes."""
        return _frame(self.misses)

    def best_per_group(self) -> pd.DataFrame:
        """The fastest feasible plan of each model, hardware and GPU count."""
        return _frame(self.best).sort_values(list(GROUP), kind="stable")

    def median_measured_share(self) -> float | None:
        if not self.measured_share:
            return None
        return float(np.nanmedian(np.concatenate(self.measured_share)))


def _frame(table: pa.Table | None) -> pd.DataFrame:
    if table is None:
        return pd.DataFrame({c: [] for c in SUMMARY_COLUMNS})
    return table.to_pandas()
