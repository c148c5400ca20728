"""How the evaluator's outputs are named as result columns (no I/O, no pyarrow).

The compiled cost families name their outputs after the symbolic model (``mem_total``,
``time_step_s``, one ``comm_<kind>_<group>`` per communicator); a result row and
:func:`stage_dse.cost.bind.evaluate_plan` use the names below instead, with units in them
(``mem_total_bytes``, ``step_s``), and sum communication by collective kind and by parallel axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from stage_dse.cost.key import EMBEDDING_GROUP

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COMM_COLUMNS",
    "COST_COLUMNS",
    "SERVING_COLUMNS",
    "cost_arrays",
    "cost_columns",
    "named_outputs",
]

# cost output name -> result column
COST_COLUMNS: dict[str, str] = {
    "params_total": "params",
    "params_active": "params_active",
    "mem_weights": "mem_weights_bytes",
    "mem_grads": "mem_grads_bytes",
    "mem_optimizer": "mem_optimizer_bytes",
    "mem_activations": "mem_activations_bytes",
    "mem_recompute_working": "mem_recompute_working_bytes",
    "mem_total": "mem_total_bytes",
    "mem_headroom_bytes": "mem_headroom_bytes",
    "mem_stage": "mem_stage",
    "flops_model": "model_flops",
    "flops_model_causal": "model_flops_causal",
    "flops_matmul": "matmul_flops",
    "flops_recompute": "recompute_flops",
    "flops_hardware": "hardware_flops",
    "time_step_s": "step_s",
    "time_compute_s": "compute_s",
    "time_tp_comm_s": "tp_comm_s",
    "time_ep_comm_s": "ep_comm_s",
    "time_cp_comm_s": "cp_comm_s",
    "time_zero_comm_s": "zero_comm_s",
    "time_pp_comm_s": "pp_comm_s",
    "time_bubble_s": "bubble_s",
    "time_offload_s": "offload_s",
    "time_dp_comm_s": "dp_comm_s",
    "time_optimizer_s": "optimizer_s",
    "tokens_per_s": "tokens_per_s",
    "mfu": "mfu",
    "mfu_causal": "mfu_causal",
    "hfu": "hfu",
    "achieved_flops_per_gpu": "achieved_flops_per_s_per_gpu",
    "measured_share": "measured_share",
}
SERVING_COLUMNS: dict[str, str] = {
    "serve_ttft_s": "ttft_s",
    "serve_tpot_s": "tpot_s",
    "serve_tokens_per_s_per_gpu": "decode_tokens_per_s_per_gpu",
    "serve_weights_bytes": "serve_weights_bytes",
    "serve_kv_bytes_per_token": "kv_bytes_per_token",
    "serve_kv_cache_bytes": "kv_cache_bytes",
    "serve_working_bytes": "serve_working_bytes",
    "serve_mem_total_bytes": "serve_mem_total_bytes",
    "serve_mem_headroom_bytes": "serve_mem_headroom_bytes",
    "serve_kv_capacity_seqs": "kv_capacity_seqs",
    "serve_decode_memory_s": "decode_memory_s",
    "serve_decode_compute_s": "decode_compute_s",
    "serve_weight_read_s": "weight_read_s",
    "cb_requests_per_s": "requests_per_s",
    "cb_total_tokens_per_s_per_gpu": "total_tokens_per_s_per_gpu",
    "cb_tokens_per_s_per_user": "tokens_per_s_per_user",
}
"""Serving outputs (rows with ``workload == "serving"``; null for training rows)."""
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
COMM_AXES = ("tp", "cp", "ep", "dp", "pp")
COMM_COLUMNS = (
    *(f"comm_{k}_bytes" for k in COMM_KINDS),
    *(f"comm_{a}_bytes" for a in COMM_AXES),
    "comm_total_bytes",
)


def _axis_of(group_label: str) -> str:
    """The parallel axis a communicator group serves: data groups (dp, cp-ep-dp) count as dp."""
    if group_label == EMBEDDING_GROUP:  # first and last stage of each pipeline
        return "pp"
    parts = group_label.split("-")
    if {"dp", "ds", "dr"} & set(parts):  # ds, dr: a hybrid-sharded group and its replicas
        return "dp"
    if "ep" in parts:
        return "ep"
    if "pp" in parts:
        return "pp"
    if "tp" in parts:
        return "tp"
    return parts[0]


ABSENT, ZERO = -1, -2
"""Layout indices of a column the family has no output for: NaN, or 0 (a roofline row's
``measured_share``)."""


def cost_arrays(names: list[str], out: np.ndarray) -> dict[str, np.ndarray]:
    """Result cost columns from the evaluator's output ``names`` and ``(rows, names)`` matrix:
    renamed outputs, and communication summed by collective kind and by parallel axis."""
    renamed, sums, _ = _layout(tuple(names))
    by_column = np.ascontiguousarray(out.T)  # one contiguous row per output
    nan, zeros = np.full(len(out), np.nan), np.zeros(len(out))
    cols = {d: by_column[i] if i >= 0 else (zeros if i == ZERO else nan) for i, d in renamed}
    for column, rows in sums:
        cols[column] = by_column[rows].sum(axis=0) if rows else zeros
    return cols


def cost_columns(costs: pd.DataFrame) -> pd.DataFrame:
    """Result cost columns from the evaluator's output columns."""
    import pandas as pd

    arrays = cost_arrays(list(costs.columns), costs.to_numpy(dtype=np.float64))
    return pd.DataFrame(arrays, index=costs.index)


def named_outputs(names: Sequence[str], values: np.ndarray) -> dict[str, float]:
    """One evaluated row as ``{name: float}``: every output that is a result column under the
    column's name, communication summed into the ``comm_*_bytes`` columns, and the remaining
    detail outputs (per-communicator bytes, per-stage figures) under their own names (the
    single-row form of :func:`cost_arrays`, in plain Python: ~3 us per call)."""
    held = _ROW_LAYOUTS.get(id(names))
    if held is None or held[0] is not names:
        if len(_ROW_LAYOUTS) >= 256:
            _ROW_LAYOUTS.clear()
        held = _ROW_LAYOUTS[id(names)] = (names, _row_layout(tuple(names)))
    names_out, pick = held[1]
    v = np.asarray(values, dtype=np.float64).reshape(-1).tolist()
    v.append(math.nan)  # ABSENT
    v.append(0.0)  # ZERO
    return dict(zip(names_out, pick(v)))


_ROW_LAYOUTS: dict[int, tuple] = {}
"""A family's output names (held, so their id stays theirs) -> :func:`_row_layout`, found by
identity rather than by hashing every name on each single-plan call."""


def _row_layout(names: tuple[str, ...]):
    """:func:`_layout` for one row held as a list with NaN and 0 appended: every output name
    (result columns, summed communication columns, the other outputs) and one function that
    gives their values in that order."""
    renamed, sums, extra = _layout(names)
    n = len(names)
    picked = [n if i == ABSENT else n + 1 if i == ZERO else i for i, _ in renamed]
    return (
        tuple(d for _, d in renamed) + tuple(c for c, _ in sums) + tuple(e for _, e in extra),
        _row_function(picked, [rows for _, rows in sums], [i for i, _ in extra]),
    )


def _row_function(picked: list[int], summed: list[list[int]], rest: list[int]):
    """``v -> (v[i] for i in picked) + (sum of v[j] over each summed list) + (v[k] for k in
    rest)`` as one function written from the indices, so a row costs one call rather than a
    getter and a ``sum`` per communication column (their 11 sums were 1.9 of a 5 us call).
    Terms are added left to right from the first, as ``sum`` adds them."""
    items = [f"v[{i}]" for i in picked]
    items += [" + ".join(f"v[{j}]" for j in rows) if rows else "0.0" for rows in summed]
    items += [f"v[{k}]" for k in rest]
    return eval(f"lambda v: ({', '.join(items)},)")  # built from integer indices only


@lru_cache(maxsize=256)
def _layout(names: tuple[str, ...]):
    """Where each result column of a family's outputs comes from: ``(index, column)`` for
    renamed outputs (:data:`ABSENT`, :data:`ZERO`), ``(column, indices)`` for summed
    communication, ``(index, name)`` for the outputs that are no column."""
    where = {n: i for i, n in enumerate(names)}
    renamed = [(where.get(s, ABSENT), d) for s, d in COST_COLUMNS.items()]
    renamed += [(where[s], d) for s, d in SERVING_COLUMNS.items() if s in where]
    if "params_active" not in where and "params_total" in where:  # dense: all weights active
        renamed.append((where["params_total"], "params_active"))
    if "measured_share" not in where and "time_step_s" in where:  # roofline timing
        renamed.append((ZERO, "measured_share"))
    sums: dict[str, list[int]] = {c: [] for c in COMM_COLUMNS}
    for i, name in enumerate(names):
        if not name.startswith("comm_") or name == "comm_total":
            continue
        body = name[len("comm_") :]
        kind = next(k for k in COMM_KINDS if body.startswith(k + "_"))
        sums[f"comm_{kind}_bytes"].append(i)
        sums[f"comm_{_axis_of(body[len(kind) + 1 :])}_bytes"].append(i)
    if "comm_total" in where:
        sums["comm_total_bytes"] = [where["comm_total"]]
    known = {*COST_COLUMNS, *SERVING_COLUMNS, "comm_total"}
    extra = [(i, n) for i, n in enumerate(names) if n not in known]
    return renamed, list(sums.items()), extra
