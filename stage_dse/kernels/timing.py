"""Kernel seconds for arrays of op shapes: measured where a table reaches, roofline elsewhere.

How an op meets a table (:class:`~stage_dse.cost.time.Kernel` gives its shape on one GPU):

* **Linear GEMMs** (forward, input gradient, weight gradient alike) are looked up as GEMMs of
  their own (m, n, k): rows of the left operand, columns of the right, contraction (the weight
  gradient of ``y = x W`` is ``W' = x^T dy``: m the input features, n the output features, k the
  tokens). bf16 GEMMs use the ``bf16`` table, FP8 ones (``gemm_bytes`` 1) the ``fp8`` table
  where the GPU has one (the quantize kernel before it stays on the roofline). Beyond the
  table's largest m a GEMM runs as ``m / m_max`` waves of the largest measured one.
* **Fused attention**: the prefill attention table of the same (query heads, key/value heads,
  head dim) on one GPU, by (micro-batch, sequence); only self-attention over the whole
  sequence (no context parallelism: the query and key sequences must be equal). The kernel is
  causal, as in training. Backward: :data:`~stage_dse.cost.time.ATTENTION_BACKWARD_FACTOR` x
  the forward. Beyond the table's largest batch, time grows linearly with the batch.
* **Collectives** inside one scale-up domain of 2, 4 or 8 GPUs: the NCCL table of the same kind
  and GPU count, by bytes per GPU (all-gather: the gathered buffer; reduce-scatter: its input).
  Below the smallest measured message the smallest message's latency; beyond the largest,
  linear in bytes. A group spanning domains keeps the alpha-beta model for its scale-out part:
  its time is the alpha-beta time with the intra-domain part (the same collective over the
  domain's members) replaced by the measured one; ``measured_share`` counts it as roofline.

Anything else, and any shape outside a table (including an unmeasured cell), keeps its roofline
time and is counted as such.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from stage_dse.kernels.tables import MeasuredTables

__all__ = ["kernel_seconds"]


def kernel_seconds(
    kernels, shape_out: np.ndarray, tables: MeasuredTables | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds, measured)`` of shape ``(rows, len(kernels))``. ``shape_out`` holds, per
    kernel in order, its shape columns and then its roofline seconds. The kernels of one
    table are looked up together, in one vectorized call."""
    rows = len(shape_out)
    starts = np.cumsum([0] + [len(k.shape) + 1 for k in kernels])
    roofline = shape_out[:, [starts[j + 1] - 1 for j in range(len(kernels))]]
    seconds = roofline.copy()
    measured = np.zeros((rows, len(kernels)), dtype=bool)
    if tables is None or rows == 0:
        return seconds, measured
    by_table: dict[str, list[int]] = {}
    for j, kernel in enumerate(kernels):
        by_table.setdefault(kernel.table, []).append(j)
    for table, js in by_table.items():
        n = len(kernels[js[0]].shape)
        shape = np.concatenate([shape_out[:, starts[j] : starts[j] + n] for j in js])
        if table in ("gemm", "attention"):
            got, inside = _gemm(shape, tables) if table == "gemm" else _attention(shape, tables)
            whole = inside
        else:
            full = roofline[:, js].T.reshape(-1)
            got, inside, whole = _collective(table, shape, full, tables)
        scale = np.repeat([float(kernels[j].scale) for j in js], rows)
        got = (got * scale).reshape(len(js), rows).T
        inside = inside.reshape(len(js), rows).T
        seconds[:, js] = np.where(inside, got, roofline[:, js])
        measured[:, js] = whole.reshape(len(js), rows).T
    return seconds, measured


def _gemm(shape: np.ndarray, tables: MeasuredTables):
    m, n, k, gemm_bytes = shape.T
    out = np.full(len(shape), np.nan)
    inside = np.zeros(len(shape), dtype=bool)
    for dtype, rows in (("bf16", gemm_bytes >= 1.5), ("fp8", gemm_bytes < 1.5)):
        grid = tables.gemm.get(dtype)
        if grid is None or not rows.any():
            continue
        m_max = grid.axes[0][-1]
        waves = np.maximum(1.0, m[rows] / m_max)
        got, ok = grid.lookup(np.minimum(m[rows], m_max), n[rows], k[rows])
        out[rows] = got * waves
        inside[rows] = ok
    return out, inside


def _attention(shape: np.ndarray, tables: MeasuredTables):
    batch, seq_q, heads, kv, head_dim, seq_k = shape.T
    out = np.full(len(shape), np.nan)
    inside = np.zeros(len(shape), dtype=bool)
    whole = np.abs(seq_q - seq_k) <= 1e-9 * seq_k
    integral = (heads == np.round(heads)) & (kv == np.round(kv)) & (head_dim < 1e4)
    code = np.where(integral, (heads * 1e4 + kv) * 1e4 + head_dim, -1.0)
    for value in pd.unique(code[whole & integral]):
        layout = (int(value // 1e8), int(value // 1e4 % 1e4), int(value % 1e4))
        grid = tables.attention.get(layout)
        rows = whole & (code == value)
        if grid is None:
            continue
        b_max = grid.axes[0][-1]
        scale = np.maximum(1.0, batch[rows] / b_max)
        got, ok = grid.lookup(np.minimum(batch[rows], b_max), seq_q[rows])
        out[rows] = got * scale
        inside[rows] = ok
    return out, inside


def _collective(kind: str, shape: np.ndarray, roofline: np.ndarray, tables: MeasuredTables):
    """(seconds, timed with a measurement, timed wholly by one): inside one domain the
    measured collective; across domains the alpha-beta time with its intra-domain part
    replaced by the measured one (counted as roofline in ``measured_share``)."""
    size, n_in, n_out, intra = shape.T
    out = np.full(len(shape), np.nan)
    inside = np.zeros(len(shape), dtype=bool)
    for gpus in (2, 4, 8):
        grid = tables.nccl.get((kind, gpus))
        rows = np.abs(n_in - gpus) < 1e-9
        if grid is None or not rows.any():
            continue
        lo, hi = grid.axes[0][0], grid.axes[0][-1]
        got, ok = grid.lookup(np.clip(size[rows], lo, hi))
        out[rows] = got * np.maximum(1.0, size[rows] / hi)
        inside[rows] = ok
    one_domain = np.abs(n_out - 1.0) < 1e-9
    spans = inside & ~one_domain
    out[spans] = np.maximum(roofline[spans] - intra[spans] + out[spans], roofline[spans] * 0.0)
    return out, inside, inside & one_domain
