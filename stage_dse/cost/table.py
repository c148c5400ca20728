"""Columnar plan tables and their vectorized evaluation.

A *plan table* is a pandas DataFrame with one row per configuration: the numeric symbol columns
(:data:`stage_dse.cost.compile.SYMBOL_NAMES`, e.g. ``hidden``, ``tp``, ``peak_flops``), the
structural columns (:data:`KEY_COLUMNS`, e.g. ``recompute``, ``zero_stage``) that select a
compiled family, and any label columns (model name, hardware name, ...), which are carried
along untouched. :func:`evaluate_table` groups rows by family and evaluates each group with one
call of its compiled function. :class:`PlanColumns` holds the same table as columns, constants
kept as scalars (what enumeration produces and sweep workers evaluate with
:func:`evaluate_columns`, without building a DataFrame).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from functools import lru_cache
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from stage_dse.cost.bind import bind, bind_hardware, check_fits_cluster
from stage_dse.cost.columns import cost_columns
from stage_dse.cost.compile import SYMBOL_NAMES, family_for
from stage_dse.cost.key import KEY_COLUMNS, key_from_values
from stage_dse.cost.labels import Labels
from stage_dse.cost.measured import MeasuredFamily
from stage_dse.spec import (
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    ParallelPlan,
    TrainingSpec,
    check_gemm_dtype,
    validate_plan,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "KEY_COLUMNS",
    "PlanColumns",
    "config_row",
    "evaluate_columns",
    "evaluate_plans",
    "evaluate_table",
    "key_from_values",
    "model_columns",
    "plan_row",
    "plans_table",
]

CHUNK_ROWS = 1 << 17
_FILL_ROWS = 1 << 12  # rows of the symbol matrix filled together (~2.5 MB: in cache)


def model_columns(model: ModelSpec, training: TrainingSpec) -> dict[str, object]:
    """Structural columns of a model and training step (and their labels)."""
    return {
        "workload": "training",
        "kv_bytes": 0,
        "model": model.name,
        "norm": model.norm.value,
        "mlp": model.mlp.value,
        "position": model.position.value,
        "tied_embeddings": model.tied_embeddings,
        "bias": model.bias,
        "dropout": model.dropout,
        "moe": model.is_moe,
        "has_shared_experts": model.num_shared_experts > 0,
        "has_dense_layers": model.has_dense_layers,
        "mla": model.is_mla,
        "sliding_window": model.has_sliding_window,
        "chunked_attention": model.has_chunked_attention,
        "sparse_attention": model.has_sparse_attention,
        "mtp": model.mtp_layers > 0,
        "parallel_block": model.parallel_block,
        "param_bytes": training.params_dtype.bytes,
        "grad_bytes": training.grads_dtype.bytes,
        "optimizer_bytes_per_param": training.optimizer_bytes_per_param,
    }


def plan_row(
    model: ModelSpec,
    training: TrainingSpec,
    plan: ParallelPlan,
    hardware: HardwareSpec,
    cluster: ClusterSpec,
) -> dict[str, object]:
    """Every column of one validated configuration."""
    validate_plan(model, training, plan)
    check_fits_cluster(plan, cluster)
    check_gemm_dtype(training, hardware)
    return config_row(model, training, plan, hardware, cluster)


def config_row(
    model: ModelSpec,
    training: TrainingSpec,
    plan: ParallelPlan,
    hardware: HardwareSpec,
    cluster: ClusterSpec,
) -> dict[str, object]:
    """Every column of one configuration, without validating it (callers do: training plans
    through :func:`plan_row`, serving plans through their own rules)."""
    row: dict[str, object] = {**model_columns(model, training), "hardware": hardware.name}
    row["cluster"] = cluster.name
    row.update(bind(model, training, plan))
    row.update(bind_hardware(hardware, cluster))
    row.update(
        {
            "num_gpus": plan.num_gpus,
            "expert_tensor_parallel": plan.expert_tensor_parallel,
            "ep_over_tp": plan.ep_over_tp,
            "ep_over_cp": plan.ep_over_cp,
            "sequence_parallel": plan.sequence_parallel,
            "attention": plan.attention.value,
            "zero_stage": plan.zero_stage,
            "recompute": plan.recompute_label,
            "schedule": plan.schedule.value,
            "stage_layers": plan.stage_layers,
            "rank_order": "-".join(a.value for a in plan.rank_order),
            "overlap_grad_reduce": plan.overlap_grad_reduce,
            "overlap_param_gather": plan.overlap_param_gather,
            "tp_comm_overlap": plan.tp_comm_overlap,
            "tp_dgrad_overlap": plan.tp_dgrad_overlap,
            "ep_comm_overlap": plan.ep_comm_overlap,
            "zero_sync_per_tensor": plan.zero_sync_per_tensor,
            "grad_sync_per_step": plan.grad_sync_per_step,
            "ep_dispatch_dedup": plan.ep_dispatch_dedup,
            "fused_elementwise": plan.fused_elementwise,
            "fused_activation": plan.fused_activation,
            "fused_projections": plan.fused_projections,
            "moe_weighted_activation": plan.moe_weighted_activation,
            "cuda_graphs": plan.cuda_graphs_label,
        }
    )
    return row


def plans_table(
    model: ModelSpec,
    training: TrainingSpec,
    plans: Iterable[ParallelPlan],
    hardware: HardwareSpec,
    cluster: ClusterSpec,
) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame([plan_row(model, training, p, hardware, cluster) for p in plans])


class PlanColumns:
    """A plan table kept as columns: a column is either one value for every row (a constant,
    e.g. the model's hidden size) or an array of ``rows`` values (a numpy array, or a
    :class:`~stage_dse.cost.labels.Labels` for text). Sweeps evaluate these without building a
    DataFrame (nor importing pandas); :meth:`frame` gives the equivalent plan table."""

    def __init__(self, rows: int, columns: dict[str, object]) -> None:
        self.rows = rows
        self.columns = columns

    def __len__(self) -> int:
        return self.rows

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def is_constant(self, name: str) -> bool:
        return not isinstance(self.columns[name], np.ndarray | Labels)

    def array(self, name: str) -> np.ndarray | Labels:
        """A column with one value per row."""
        v = self.columns[name]
        if not self.is_constant(name):
            return v
        if isinstance(v, str):
            return Labels(np.zeros(self.rows, dtype=np.int8), [v])
        return np.full(self.rows, v)

    def take(self, index: np.ndarray) -> PlanColumns:
        """The rows at ``index`` (positions or a boolean mask)."""
        cols = {
            k: v if self.is_constant(k) else v[index]  # type: ignore[index]
            for k, v in self.columns.items()
        }
        rows = int(index.sum()) if index.dtype == bool else len(index)
        return PlanColumns(rows, cols)

    def frame(self) -> pd.DataFrame:
        import pandas as pd

        columns = {k: self.array(k) for k in self.columns}
        return pd.DataFrame(
            {k: v.to_pandas() if isinstance(v, Labels) else v for k, v in columns.items()}
        )

    def family_runs(self) -> list[tuple[dict, int, int]]:
        """Maximal runs of rows sharing the structural columns: (their values, start, stop)."""
        cuts: set[int] = set()
        constant: dict[str, object] = {}
        varying = []  # (column, codes, categories or None)
        for col in KEY_COLUMNS:
            v = self.columns[col]
            if self.is_constant(col):
                constant[col] = v
                continue
            if isinstance(v, Labels):
                varying.append((col, v.codes, v.categories))
                v = v.codes
            else:
                varying.append((col, v, None))
            cuts.update((np.flatnonzero(v[1:] != v[:-1]) + 1).tolist())
        bounds = [0, *sorted(cuts), self.rows]
        runs = []
        for a, b in pairwise(bounds):
            values = dict(constant)
            for col, codes, categories in varying:
                values[col] = codes[a] if categories is None else categories[codes[a]]
            runs.append((values, a, b))
        return runs


def evaluate_columns(
    plans: PlanColumns,
    subset: str = "all",
    timing: str = "roofline",
    measured_gpu: str | None = None,
) -> tuple[list[str], np.ndarray]:
    """Every cost of every row of ``plans``: output names and a ``(rows, len(names))`` matrix
    (one compiled call per run of rows of one family, see :func:`evaluate_table`; with
    ``timing="measured"``, every row on the table set ``measured_gpu``)."""
    missing = [c for c in (*SYMBOL_NAMES, *KEY_COLUMNS) if c not in plans]
    if missing:
        raise KeyError(f"plan table lacks columns: {', '.join(missing)}")
    if len(plans) == 0:
        return [], np.zeros((0, 0))
    if timing == "measured" and subset == "all":
        from stage_dse.kernels.tables import load_tables

        tables = load_tables(measured_gpu) if measured_gpu else None
        runs = [
            (MeasuredFamily(key_from_values(v), b - a, tables), a, b)
            for v, a, b in plans.family_runs()
        ]
    else:
        runs = [
            (family_for(key_from_values(v), subset, b - a), a, b) for v, a, b in plans.family_runs()
        ]
    return _evaluate_runs(_Rows([plans.columns[n] for n in SYMBOL_NAMES], plans.rows), runs)


class _Rows:
    """The symbol matrix of a plan table (its columns, arrays or scalars) built a window of
    rows at a time, as :func:`_evaluate_runs` slices it: never the whole table's at once. One
    buffer serves every slice (a fresh matrix per family run paid its page faults each time),
    with the columns equal on every row (the hardware's and cluster's values, most of a
    table) written into it once. A window runs from the slice that opened it through the last
    whole run that ends within :data:`_FILL_ROWS` rows of its start, so the short runs of a
    table's next families are views of rows already written (a table of a few thousand rows
    is written once, not once per family) and no run is written twice; a slice is valid until
    the next one is taken. ``run_ends``: where the runs of rows that will be asked for end, in
    order (empty: each slice is written as asked)."""

    def __init__(self, columns: list, rows: int) -> None:
        self.columns, self.rows = columns, rows
        self.run_ends: list[int] = []
        self._buffer: np.ndarray | None = None
        self._window = (0, 0)  # rows of the table held by the buffer
        constant = [_constant(c) for c in columns]
        self._fixed = [j for j, c in enumerate(constant) if c]
        self._varying = [j for j, c in enumerate(constant) if not c]  # arrays

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop = rows.start, rows.stop
        w0, w1 = self._window
        if w0 <= start and stop <= w1:
            return self._buffer[start - w0 : stop - w0]  # type: ignore[index]
        size = max(min(max(stop - start, _FILL_ROWS), CHUNK_ROWS, self.rows), stop - start)
        if self._buffer is None or len(self._buffer) < size:
            row = np.zeros(len(self.columns))
            for j in self._fixed:
                c = self.columns[j]
                row[j] = c if np.ndim(c) == 0 else c[0]
            self._buffer = np.empty((size, len(self.columns)))
            self._buffer[:] = row  # one broadcast copy, not a strided write per column
        # through the last whole run that fits (no run is written twice)
        limit = min(start + max(stop - start, _FILL_ROWS), start + len(self._buffer), self.rows)
        whole = bisect_right(self.run_ends, limit)  # runs ending within the limit
        end = max(stop, self.run_ends[whole - 1]) if whole else stop
        x = self._buffer[: end - start]
        # a block of rows at a time, so that the column-by-column writes stay in cache (a
        # column's slice is contiguous, a row-major matrix's column is not)
        for lo in range(start, end, _FILL_ROWS):
            hi = min(lo + _FILL_ROWS, end)
            block = x[lo - start : hi - start]
            for j in self._varying:
                block[:, j] = self.columns[j][lo:hi]
        self._window = (start, end)
        return x[: stop - start]


def _constant(column) -> bool:
    """A scalar, or an array whose rows all hold its first value."""
    if isinstance(column, int | float):  # the common scalar, without numpy's dispatch
        return True
    column = np.asarray(column)
    if column.ndim == 0 or len(column) == 0:
        return True
    return bool(column[0] == column[-1]) and bool((column == column[0]).all())


def _evaluate_runs(x: np.ndarray | _Rows, runs: list) -> tuple[list[str], np.ndarray]:
    """Evaluate rows ``[a, b)`` of ``x`` with their family; the union of the output columns
    (a communication column a family does not have is 0 bytes)."""
    if isinstance(x, _Rows):
        x.run_ends = [b for _, _, b in runs]
    names, where = _union_layout(tuple(family.names for family, _, _ in runs))
    # every row is written below (a family's missing columns as zeros): no zero-filled page
    out = np.empty((len(x), len(names)))
    longest = min(max((b - a for _, a, b in runs), default=0), CHUNK_ROWS)
    # long runs: one output buffer per output count, reused by every chunk (short ones take
    # fresh matrices, which the allocator recycles without the kernel)
    buffers: dict[int, np.ndarray] | None = {} if longest >= _FILL_ROWS else None
    for (family, a, b), (spans, missing, columns, absent) in zip(runs, where, strict=True):
        for lo in range(a, b, CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, b)
            if buffers is None:
                y = family(x[lo:hi])
            else:
                n_out = len(family.names)
                if n_out not in buffers:
                    buffers[n_out] = np.empty((longest, n_out))
                y = family.into(x[lo:hi], buffers[n_out][: hi - lo])
            if hi - lo < _INDEXED_ROWS:  # a short run: one indexed copy, one indexed zero fill
                out[lo:hi, columns] = y
                if len(absent):
                    out[lo:hi, absent] = 0.0
                continue
            for start, stop, first, last in spans:
                out[lo:hi, start:stop] = y[:, first:last]
            for start, stop in missing:
                out[lo:hi, start:stop] = 0.0
    return list(names), out


_INDEXED_ROWS = 1024
"""Runs shorter than this are copied into the union matrix by one indexed assignment (its
columns scattered), longer ones as slices of consecutive columns: per call, the indexed copy
costs less than the five or so slices of a typical family; per row, slices cost less (one
indexed copy of scattered columns took 32 ms of a 130,800-plan table, slices 5 ms)."""


@lru_cache(maxsize=256)
def _union_layout(families: tuple[tuple[str, ...], ...]):
    """The union of the families' output names (first seen first), and for each family where
    its outputs go, as runs of consecutive columns (``(start, stop)`` in the union, ``(first,
    last)`` in the family's own order: slice copies, several times faster than one indexed
    copy of scattered columns), the runs of union columns it has no output for, and the same
    two as index arrays (for short runs, see :data:`_INDEXED_ROWS`)."""
    names: dict[str, int] = {}
    for family in families:
        for n in family:
            names.setdefault(n, len(names))
    where = []
    for family in families:
        cols = [names[n] for n in family]
        spans, first = [], 0
        for i in range(1, len(cols) + 1):
            if i == len(cols) or cols[i] != cols[i - 1] + 1:
                spans.append((cols[first], cols[i - 1] + 1, first, i))
                first = i
        held = np.zeros(len(names), dtype=bool)
        held[cols] = True
        step = np.diff(np.concatenate(([0], (~held).astype(np.int8), [0])))
        missing = list(zip(np.flatnonzero(step == 1).tolist(), np.flatnonzero(step == -1).tolist()))
        where.append((spans, missing, np.array(cols, dtype=np.intp), np.flatnonzero(~held)))
    return list(names), where


def evaluate_plans(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with the costs of every row joined under the result columns' names
    (``step_s``, ``mfu``, ``mem_total_bytes``, ``comm_dp_bytes``, ...), as a results folder
    stores them and :func:`stage_dse.cost.bind.evaluate_plan` returns them."""
    return table.join(cost_columns(evaluate_table(table)))


TIMINGS = ("roofline", "measured")


def evaluate_table(
    table: pd.DataFrame,
    subset: str = "all",
    timing: str = "roofline",
    measured_gpu: dict[str, str | None] | None = None,
) -> pd.DataFrame:
    """Every cost of every row, indexed like ``table`` (one compiled call per family/chunk).

    ``subset="memory"`` evaluates only parameters and memory (``mem_headroom_bytes`` included).
    ``timing="measured"`` times linear GEMMs, fused attention and one-domain collectives from
    tables of measured kernels (:mod:`stage_dse.kernels`), per hardware label:
    ``measured_gpu`` maps a hardware name to its table set (default
    :data:`stage_dse.kernels.tables.GPU_TABLES`; None: roofline only); the extra output
    ``measured_share`` is the share of the step time that came from tables.

    Output columns are the union over the families present; a communication column a family
    does not have (no such collective in its graph) is 0 bytes.
    """
    import pandas as pd

    missing = [c for c in (*SYMBOL_NAMES, *KEY_COLUMNS) if c not in table.columns]
    if missing:
        raise KeyError(f"plan table lacks columns: {', '.join(missing)}")
    if timing not in TIMINGS:
        raise ValueError(f"timing={timing!r} is not one of: {', '.join(TIMINGS)}")
    if len(table) == 0:
        return pd.DataFrame(index=table.index)
    if timing == "measured" and subset == "all":
        from stage_dse.kernels.tables import load_tables, table_set

        chosen = measured_gpu or {}
        parts = []
        for hw, rows in table.groupby("hardware", observed=True, sort=False):
            # a name the caller maps to None has no tables; an unmapped one its preset's
            gpu = table_set(str(hw), (chosen[hw] or "none") if hw in chosen else "")
            tables = load_tables(gpu) if gpu else None
            parts.append(_evaluate(rows, lambda key, n, t=tables: MeasuredFamily(key, n, t)))
        return pd.concat(parts).reindex(table.index)
    return _evaluate(table, lambda key, n: family_for(key, subset, n))


def _factorize(column: pd.Series) -> tuple[np.ndarray, list]:
    """Integer codes of a key column and the values they stand for: a categorical's own codes,
    a boolean's 0/1, else ``pandas.factorize`` (the first two cost nothing to compute)."""
    import pandas as pd

    if isinstance(column.dtype, pd.CategoricalDtype) and not column.hasnans:
        return column.cat.codes.to_numpy(dtype=np.int64), list(column.cat.categories)
    if column.dtype == np.bool_:
        return column.to_numpy().astype(np.int64), [False, True]
    c, u = pd.factorize(column, sort=False)
    return c, list(u)


def _symbol_column(column: pd.Series) -> np.ndarray:
    """A symbol column as numpy holds it (integers, floats, booleans: the symbol matrix casts
    them as it is written, where converting each column to float64 first copied the table's
    integer columns once more, a tenth of a large table's time), else as float64."""
    if isinstance(column.dtype, np.dtype) and column.dtype.kind in "iufb":
        return column.to_numpy()
    return column.to_numpy(dtype=np.float64)


def _evaluate(table: pd.DataFrame, make) -> pd.DataFrame:
    import pandas as pd

    codes = np.zeros(len(table), dtype=np.int64)
    factors: list[tuple[np.ndarray, list]] = []
    for col in KEY_COLUMNS:
        c, u = _factorize(table[col])
        codes = codes * max(len(u), 1) + c
        factors.append((c, u))
    columns = [_symbol_column(table[name]) for name in SYMBOL_NAMES]
    runs = np.flatnonzero(np.diff(codes)) + 1
    if len(runs) + 1 == len(np.unique(codes)):
        order = None  # rows of each family are already contiguous (enumeration emits them so)
        starts = np.concatenate(([0], runs))
    else:
        order = np.argsort(codes, kind="stable")
        starts = np.concatenate(([0], np.flatnonzero(np.diff(codes[order])) + 1))
        columns = [c[order] for c in columns]
    ends = np.concatenate((starts[1:], [len(table)]))
    families = []
    for a, b in zip(starts, ends):
        row = a if order is None else order[a]
        values = {col: u[c[row]] for col, (c, u) in zip(KEY_COLUMNS, factors)}
        families.append((make(key_from_values(values), b - a), a, b))
    names, out = _evaluate_runs(_Rows(columns, len(table)), families)
    if order is not None:
        unsorted = np.empty_like(out)
        unsorted[order] = out
        out = unsorted
    return pd.DataFrame(out, columns=names, index=table.index, copy=False)
