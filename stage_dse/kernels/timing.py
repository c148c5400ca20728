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
  An inference engine's all-reduce (``engine_all_reduce``) takes the faster of NCCL's and
  TensorRT-LLM's own kernel (what engines call for tensor-parallel sums).

Serving kernels (:mod:`stage_dse.cost.serving`):

* **Prefill attention** (``context_attention``): the prefill table of the same (heads, kv heads,
  head dim) and cache bytes, by (batch, prompt), never below the time of moving its operands
  at the peak HBM bandwidth (some measured points are faster); **decode attention**
  (``generation_attention``): the decode table, by (batch, KV length); DeepSeek-V3's latent
  attention (``context_mla``, ``generation_mla``) the MLA tables by heads on one GPU, only
  for its dimensions (192-dim query/key heads and 128-dim values in prefill; a 576-dim cached
  latent read as keys and its 512-dim part as values in decode). A batch beyond what the
  table measured at that length (beyond its largest batch, or in a cell the collection left
  out: long caches are measured at small batches only) runs as waves of the largest batch
  measured there (``batch / b`` times its time): these kernels stream the cache, linear in
  the batch where the cut falls.
* **GEMMs** as in training, at their own m (decode: the running batch); FP4 GEMMs
  (``gemm_bytes`` below 0.75) on the ``nvfp4`` table where the GPU has one.
* **Routed experts** (``moe``): the fused MoE table of the same layout (hidden and expert
  widths, top-k, experts, expert tensor and expert parallel degrees) and routing, by the
  tokens of the expert-parallel group, in the experts' format (:func:`_moe_formats`: FP8
  experts on the per-tensor FP8 table where measured, else the block-scaled one). Beyond the
  largest measured token count the kernel runs as waves of the largest (its time linear in
  the tokens).

Anything else, and any shape outside a table (including an unmeasured cell), keeps its roofline
time and is counted as such.
"""

from __future__ import annotations

from functools import partial

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
    roof_cols, groups = _arrangement(kernels)
    roofline = shape_out[:, roof_cols]
    seconds = roofline.copy()
    measured = np.zeros((rows, len(kernels)), dtype=bool)
    if tables is None or rows == 0:
        return seconds, measured
    for table, js, cols, scales in groups:
        shape = np.concatenate([shape_out[:, c] for c in cols])
        if table in LOOKUPS:
            got, inside = _looked_up(table, shape, tables)
            whole = inside
        else:
            full = roofline[:, js].T.reshape(-1)
            got, inside, whole = _collective(table, shape, full, tables)
        got = (got.reshape(len(js), rows) * scales[:, None]).T
        inside = inside.reshape(len(js), rows).T
        seconds[:, js] = np.where(inside, got, roofline[:, js])
        measured[:, js] = whole.reshape(len(js), rows).T
    return seconds, measured


_ARRANGEMENTS: dict[int, tuple] = {}


def _arrangement(kernels) -> tuple:
    """Where each kernel's shape and roofline columns sit in ``shape_out``, and the kernels
    grouped by table with their scales as floats (kept per kernel list: the lists are the
    compiled families' own, met again at every call)."""
    got = _ARRANGEMENTS.get(id(kernels))
    if got is not None and got[0] is kernels:
        return got[1]
    starts = np.cumsum([0] + [len(k.shape) + 1 for k in kernels])
    roof_cols = [int(starts[j + 1] - 1) for j in range(len(kernels))]
    by_table: dict[str, list[int]] = {}
    for j, kernel in enumerate(kernels):
        by_table.setdefault(kernel.table, []).append(j)
    groups = []
    for table, js in by_table.items():
        n = len(kernels[js[0]].shape)
        cols = [slice(int(starts[j]), int(starts[j]) + n) for j in js]
        scales = np.array([float(kernels[j].scale) for j in js])
        groups.append((table, js, cols, scales))
    arrangement = (roof_cols, groups)
    if len(_ARRANGEMENTS) >= 1024:
        _ARRANGEMENTS.clear()
    _ARRANGEMENTS[id(kernels)] = (kernels, arrangement)  # kept alive: the id stays theirs
    return arrangement


_MEMO: dict = {}
_MEMO_MAX_ROWS = 4096  # per lookup: larger ones (sweep blocks) are not met twice
_MEMO_TOTAL_ROWS = 1_000_000
_memo_rows = 0


def _looked_up(table: str, shape: np.ndarray, tables: MeasuredTables, lookup=None):
    """A table's lookup of ``shape`` (``LOOKUPS[table]`` unless ``lookup`` is given, called
    with the shapes and tables alike), remembered: a fit or a serving fixed point asks for the
    same shapes again and again (the tables' times depend on nothing else), only the roofline
    around them moves. Results are read-only arrays."""
    global _memo_rows
    shape = np.ascontiguousarray(shape, dtype=float)
    key = (table, id(tables), shape.shape, shape.tobytes())
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is tables:
        return hit[1], hit[2]
    got, inside = (LOOKUPS[table] if lookup is None else lookup)(shape, tables)
    if len(shape) <= _MEMO_MAX_ROWS:
        if _memo_rows + len(shape) > _MEMO_TOTAL_ROWS:
            _MEMO.clear()
            _memo_rows = 0
        got.setflags(write=False)
        inside.setflags(write=False)
        _MEMO[key] = (tables, got, inside)  # the tables kept alive: their id stays theirs
        _memo_rows += len(shape)
    return got, inside


def _gemm(shape: np.ndarray, tables: MeasuredTables):
    m, n, k, gemm_bytes = shape.T
    out = np.full(len(shape), np.nan)
    inside = np.zeros(len(shape), dtype=bool)
    for dtype, rows in (
        ("bf16", gemm_bytes >= 1.5),
        ("fp8", (gemm_bytes < 1.5) & (gemm_bytes >= 0.75)),
        ("nvfp4", gemm_bytes < 0.75),
    ):
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


def _batched(grid, batch: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A (batch, length) table at each query; a batch the table did not measure at that
    length (beyond its largest, or in a cell left out) as ``batch / b`` waves of the largest
    batch ``b <= batch`` measured there."""
    got, ok = grid.lookup(batch, length)
    lengths = grid.axes[1]
    todo = ~ok & (batch >= grid.axes[0][0]) & (length >= lengths[0]) & (length <= lengths[-1])
    for b in grid.axes[0][::-1]:
        rows = np.flatnonzero(todo & (batch >= b))
        if not len(rows):
            continue
        part, inside = grid.lookup(np.full(len(rows), b), length[rows])
        rows, part = rows[inside], part[inside]
        got[rows] = part * batch[rows] / b
        ok[rows] = True
        todo[rows] = False
    return got, ok


def _layouts(columns: np.ndarray, usable: np.ndarray, exact: bool = True):
    """Each distinct row of ``columns`` (layout numbers: heads, dims, bytes) among the
    ``usable`` rows, with the mask of the rows that have it: integral positive rows only
    (``exact=False``: any finite row, the values kept as floats)."""
    if exact:
        keep = usable & np.all((columns == np.round(columns)) & (columns > 0), axis=1)
    else:
        keep = usable & np.all(np.isfinite(columns), axis=1)
    if not keep.any():
        return
    values = columns[keep].astype(np.int64) if exact else columns[keep]
    layouts, codes = np.unique(values, axis=0, return_inverse=True)
    where = np.flatnonzero(keep)
    for i, layout in enumerate(layouts):
        rows = np.zeros(len(columns), dtype=bool)
        rows[where[codes.reshape(-1) == i]] = True
        yield tuple((int(v) if exact else float(v)) for v in layout), rows


def _serving_attention(grids: str, dims: tuple[int, ...] | None = None):
    """Lookup of a serving attention table: shape (batch, length, floor seconds, *layout,
    cache bytes); ``dims``: the only head dimensions the table measured (MLA: DeepSeek-V3's),
    which the layout's middle entries must equal (they are not part of the table's key). A
    time below the floor (the kernel's operands at the peak HBM bandwidth: A100's decode
    table holds a few such points, up to 1.7x faster than its memory) is taken at the floor."""

    def lookup(shape: np.ndarray, tables: MeasuredTables):
        batch, length, floor = shape[:, 0], shape[:, 1], shape[:, 2]
        layout = shape[:, 3:]
        out = np.full(len(shape), np.nan)
        inside = np.zeros(len(shape), dtype=bool)
        for key, rows in _layouts(layout, np.ones(len(shape), dtype=bool)):
            if dims is not None:
                if key[1:-1] != dims:
                    continue
                key = (key[0], key[-1])
            grid = getattr(tables, grids).get(key)
            if grid is not None:
                got, ok = _batched(grid, batch[rows], length[rows])
                out[rows], inside[rows] = np.maximum(got, floor[rows]), ok
        return out, inside

    return lookup


def _collective_grids(kind: str, gpus: int, tables: MeasuredTables) -> list:
    if kind == "engine_all_reduce":
        grids = [tables.nccl.get(("all_reduce", gpus)), tables.custom_all_reduce.get(gpus)]
    else:
        grids = [tables.nccl.get((kind, gpus))]
    return [g for g in grids if g is not None]


def _collective(kind: str, shape: np.ndarray, roofline: np.ndarray, tables: MeasuredTables):
    """(seconds, timed with a measurement, timed wholly by one): inside one domain the
    measured collective (the fastest of its tables); across domains the alpha-beta time with
    its intra-domain part replaced by the measured one (counted as roofline in
    ``measured_share``)."""
    out, inside = _looked_up(kind, shape, tables, partial(_measured_collective, kind))
    out = out.copy()
    n_out, intra = shape[:, 2], shape[:, 3]
    one_domain = np.abs(n_out - 1.0) < 1e-9
    spans = inside & ~one_domain
    out[spans] = np.maximum(roofline[spans] - intra[spans] + out[spans], roofline[spans] * 0.0)
    return out, inside, inside & one_domain


def _measured_collective(kind: str, shape: np.ndarray, tables: MeasuredTables):
    """The fastest measured time of each collective over its own GPU count (NaN where no
    table has it), and whether one had it."""
    size, n_in = shape[:, 0], shape[:, 1]
    out = np.full(len(shape), np.nan)
    inside = np.zeros(len(shape), dtype=bool)
    for gpus in (2, 4, 8):
        rows = np.abs(n_in - gpus) < 1e-9
        if not rows.any():
            continue
        for grid in _collective_grids(kind, gpus, tables):
            lo, hi = grid.axes[0][0], grid.axes[0][-1]
            got, ok = grid.lookup(np.clip(size[rows], lo, hi))
            got = got * np.maximum(1.0, size[rows] / hi)
            best = out[rows]
            faster = ok & ~(best <= got)  # NaN (nothing yet) is never faster
            best[faster] = got[faster]
            out[rows] = best
            inside[rows] |= ok
    return out, inside


def _moe_formats(expert_bytes: float, gemm_bytes: float) -> tuple[str, ...]:
    """The ``moe_perf`` formats that time experts stored in ``expert_bytes`` per value whose
    GEMMs run at ``gemm_bytes`` (the experts' GEMM format, ``expert_gemm_bytes``), in order of
    preference: 16-bit experts in bf16; FP8 experts where the GEMMs run in FP8 (W8A8; none for
    FP8 storage on 16-bit math); MXFP4 experts (0.53125 bytes) with MXFP8 activations where
    their GEMMs run in FP8 (W4A8: the engine's choice on Blackwell,
    ``EngineSpec.mxfp4_moe_activations``), else with 16-bit activations (W4A16); NVFP4 experts
    (0.5625 bytes) with FP4 GEMMs."""
    if expert_bytes >= 1.5:
        return ("bfloat16",)
    if expert_bytes >= 0.75:
        return ("fp8", "fp8_block") if gemm_bytes < 1.5 else ()
    if abs(expert_bytes - 0.53125) < 1e-9:
        return ("w4a8_mxfp4_mxfp8",) if gemm_bytes < 1.5 else ("w4a16_mxfp4",)
    return ("nvfp4",) if gemm_bytes < 0.75 else ()


def _moe(shape: np.ndarray, tables: MeasuredTables):
    from stage_dse.spec.serving import MOE_ROUTINGS

    tokens = shape[:, 0]
    out = np.full(len(shape), np.nan)
    inside = np.zeros(len(shape), dtype=bool)
    if not tables.moe:
        return out, inside
    for key, rows in _layouts(shape[:, 1:], np.ones(len(shape), dtype=bool), exact=False):
        hidden, width, topk, experts, tp, ep, expert_bytes, gemm_bytes, routing = key
        grid = None
        for fmt in _moe_formats(expert_bytes, gemm_bytes):
            grid = tables.moe.get(
                (
                    fmt,
                    *(int(v) for v in (hidden, width, topk, experts, tp, ep)),
                    MOE_ROUTINGS[int(routing)],
                )
            )
            if grid is not None:
                break
        if grid is None:
            continue
        t_max = grid.axes[0][-1]
        got, ok = grid.lookup(np.minimum(tokens[rows], t_max))
        out[rows] = got * np.maximum(1.0, tokens[rows] / t_max)
        inside[rows] = ok
    return out, inside


LOOKUPS = {
    "moe": _moe,
    "gemm": _gemm,
    "attention": _attention,
    "context_attention": _serving_attention("context"),
    "generation_attention": _serving_attention("generation"),
    "context_mla": _serving_attention("context_mla", (192, 128)),
    "generation_mla": _serving_attention("generation_mla", (576, 512)),
}
"""Compute-kernel tables by :attr:`~stage_dse.cost.time.Kernel.table` (the rest are
collectives)."""
