"""Kernel latencies measured on real GPUs, read from the ``aiconfigurator-core`` package.

``aiconfigurator-core`` (Apache-2.0, the data package of NVIDIA's AIConfigurator; install with
``pip install -e ".[measured]"``) ships Parquet tables of kernel latencies measured under CUDA
graphs, in milliseconds, under ``aiconfigurator_core/systems/data/<gpu>/<op>/<backend>/<version>/``.
This module reads three of them for one GPU into :class:`~stage_dse.kernels.interp.GridTable`
objects, in seconds and bytes:

* ``gemm_perf``: GEMM latency by (m, n, k), one table per GEMM dtype (``bf16``; ``fp8`` on
  GPUs with FP8 tensor cores; ``nvfp4`` on GPUs with FP4 tensor cores);
* ``context_attention_perf``: fused prefill attention by (batch, sequence length), one table per
  (heads, kv heads, head dim), 16-bit inputs, no sliding window; a 16-bit cache (what training
  uses, :attr:`MeasuredTables.attention`) and, for serving, an FP8 cache where measured;
* ``generation_attention_perf``: decode attention (one query token per sequence against its
  KV cache) by (batch, KV length), one table per (heads, kv heads, head dim, cache bytes);
  the package's ``step`` counts cached positions beyond the ``isl`` of 1, so the KV length
  is ``isl + step``;
* ``context_mla_perf`` / ``generation_mla_perf``: DeepSeek-V3's multi-head latent attention
  (128-dim nope and 64-dim rotary query/key parts, 128-dim values, a 512-rank latent) in
  prefill by (batch, sequence) and in decode by (batch, KV length), one table per (heads on
  one GPU, cache bytes);
* ``nccl_perf``: NCCL all-reduce / all-gather / reduce-scatter / all-to-all by message size,
  one table per GPU count (2, 4, 8: one NVLink domain), 16-bit elements (``message_size`` is
  in elements there; here it is bytes, 2 per element);
* ``custom_allreduce_perf``: TensorRT-LLM's own all-reduce kernel (one-shot / two-shot over
  NVLink, what inference engines run instead of NCCL's for tensor-parallel sums), the same
  axes as NCCL's;
* ``moe_perf``: TensorRT-LLM's fused mixture-of-experts layer on one GPU (routing, the
  permutation of tokens to their experts, the grouped gate/up and down GEMMs with the
  activation between them, the weighted un-permutation; not the router GEMM nor any
  collective) by ``num_tokens``: the tokens of the whole expert-parallel group, of which the
  GPU runs the share routed to its ``num_experts / moe_ep_size`` experts, each expert's
  intermediate width split ``moe_tp_size`` ways. One table per (expert format, hidden width,
  expert width, top-k, experts, moe_tp_size, moe_ep_size, routing distribution): ``balanced``
  (every expert the same share) or a power law of the experts' loads
  (``power_law_1.01``, ``power_law_1.2``). Collections measure different models, so every
  collection is read, the newest one's measurement of a layout kept; among kernels measured
  for one layout (CUTLASS, DeepGEMM, ...) the fastest at each token count (the engine picks
  its MoE backend: TensorRT-LLM's low-latency FP4 kernel included), the non-gated kernels
  (ReLU² experts) left out.

The TensorRT-LLM backend's newest collection is used (its GEMMs and attention are the
cuBLAS/FMHA kernels training frameworks call too). Tables load once per process (and per Ray
worker).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

from stage_dse.diskcache import cache_dir, load_pickle, store_pickle
from stage_dse.errors import ConfigError
from stage_dse.kernels.interp import GridTable

__all__ = ["GPU_TABLES", "MeasuredTables", "data_root", "load_tables", "table_set"]

GPU_TABLES = {
    "a100_80gb": "a100_sxm",
    "a100_40gb": "a100_sxm",  # same SMs and clocks; only HBM size differs
    "h100_sxm": "h100_sxm",
    "h200": "h200_sxm",
    "b200": "b200_sxm",
}
"""Hardware preset -> the package's table set (``hardware.measured_gpu`` overrides)."""
BACKEND = "trtllm"


def table_set(hardware, chosen: str | None = None) -> str | None:
    """The table set of a :class:`~stage_dse.spec.HardwareSpec`, or of a hardware name with an
    explicit choice ``chosen`` (None: no measured tables). A choice of ``""`` means the
    preset's default (:data:`GPU_TABLES`), ``"none"`` no tables."""
    name = hardware if isinstance(hardware, str) else hardware.name
    if chosen is None and not isinstance(hardware, str):
        chosen = hardware.measured_gpu
    chosen = chosen or GPU_TABLES.get(name)
    return None if chosen in (None, "", "none") else chosen


MS = 1e-3
FORMAT = "f4"
"""Layout of the cached copy (:func:`_cache_file`): a new one whenever the tables read change."""
KV_BYTES = {"bfloat16": 2, "fp8": 1}
"""KV cache dtype of the package -> bytes per element."""
NCCL_OPS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "alltoall",
}


def data_root() -> Path | None:
    """``aiconfigurator_core/systems/data`` of the installed package, or None."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "systems" / "data"
    return root if root.is_dir() else None


class MeasuredTables:
    """The GEMM, attention and NCCL tables of one GPU (see the module docstring)."""

    def __init__(
        self,
        gpu: str,
        gemm: dict,
        attention: dict,
        nccl: dict,
        version: str,
        *,
        context: dict | None = None,
        generation: dict | None = None,
        context_mla: dict | None = None,
        generation_mla: dict | None = None,
        custom_all_reduce: dict | None = None,
        moe: dict | None = None,
    ):
        self.gpu = gpu
        self.gemm: dict[str, GridTable] = gemm
        self.attention: dict[tuple[int, int, int], GridTable] = attention
        """Prefill attention, 16-bit cache, by (heads, kv heads, head dim); grid (batch, seq)."""
        self.nccl: dict[tuple[str, int], GridTable] = nccl
        self.version = version
        self.context: dict[tuple[int, int, int, int], GridTable] = context or {
            (*layout, 2): grid for layout, grid in attention.items()
        }
        """Prefill attention by (heads, kv heads, head dim, cache bytes); grid (batch, seq)."""
        self.generation: dict[tuple[int, int, int, int], GridTable] = generation or {}
        """Decode attention by (heads, kv heads, head dim, cache bytes); grid (batch, KV
        length)."""
        self.context_mla: dict[tuple[int, int], GridTable] = context_mla or {}
        """MLA prefill by (heads on one GPU, cache bytes); grid (batch, seq)."""
        self.generation_mla: dict[tuple[int, int], GridTable] = generation_mla or {}
        """MLA decode by (heads on one GPU, cache bytes); grid (batch, KV length)."""
        self.custom_all_reduce: dict[int, GridTable] = custom_all_reduce or {}
        """TensorRT-LLM's all-reduce by GPU count; grid (bytes,)."""
        self.moe: dict[tuple, GridTable] = moe or {}
        """Fused MoE layers by (expert format, hidden, expert width, top-k, experts, moe tp,
        moe ep, routing distribution); grid (tokens of the expert-parallel group,)."""

    def __repr__(self) -> str:
        return (
            f"MeasuredTables({self.gpu}, {BACKEND} {self.version}: gemm {sorted(self.gemm)}, "
            f"{len(self.attention)} attention head layouts, {len(self.generation)} decode "
            f"attention layouts, {len(self.generation_mla)} MLA decode layouts, "
            f"{len(self.nccl)} NCCL tables, {len(self.moe)} MoE layouts)"
        )


@lru_cache(maxsize=8)
def load_tables(gpu: str) -> MeasuredTables:
    """The measured tables of table set ``gpu`` (e.g. ``a100_sxm``); a clear error when the
    extra is not installed or the GPU has no tables."""
    root = data_root()
    if root is None:
        raise ConfigError(
            "timing=measured needs the measured-kernel tables: pip install -e '.[measured]' "
            "(aiconfigurator-core)"
        )
    if not (root / gpu).is_dir():
        have = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir()))
        raise ConfigError(f"hardware.measured_gpu={gpu!r} has no tables; tables exist for: {have}")
    version = _newest(root / gpu / "gemm" / BACKEND, "gemm_perf.parquet")
    cache = _cache_file(gpu, version)
    cached = load_pickle(cache) if cache is not None else None
    if cached is not None:  # a truncated or foreign cache file is rebuilt, never trusted
        return cached
    tables = _read(root, gpu, version)
    if cache is not None:
        store_pickle(cache, tables)  # a read-only cache folder: read from the package each time
    return tables


def _cache_file(gpu: str, version: str) -> Path | None:
    """The compact copy of a GPU's tables (pickled grids, a few hundred kB) in the compile
    cache folder, keyed by the package's version and the collection's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        package = installed("aiconfigurator-core")
    except PackageNotFoundError:
        return None
    return cache_dir() / f"measured-{gpu}-{BACKEND}-{version}-aic{package}-{FORMAT}.pkl"


def _read(root: Path, gpu: str, version: str) -> MeasuredTables:
    import pandas as pd

    gemm_frame = pd.read_parquet(root / gpu / "gemm" / BACKEND / version / "gemm_perf.parquet")
    gemm = {}
    for ours, theirs in (("bf16", "bfloat16"), ("fp8", "fp8"), ("nvfp4", "nvfp4")):
        g = gemm_frame[gemm_frame["gemm_dtype"] == theirs]
        if len(g):
            gemm[ours] = GridTable.from_points(
                ("m", "n", "k"), g[["m", "n", "k"]].to_numpy(), g["latency"].to_numpy() * MS
            )
    att_dir = root / gpu / "attention" / BACKEND
    heads = ["num_heads", "num_key_value_heads", "head_dim"]
    context = _attention_grids(_read_newest(att_dir, "context_attention_perf"), heads, "seq")
    attention = {layout[:3]: grid for layout, grid in context.items() if layout[3] == 2}
    generation = _attention_grids(_read_newest(att_dir, "generation_attention_perf"), heads, "kv")
    mla_dir = root / gpu / "mla" / BACKEND
    context_mla = generation_mla = {}
    if mla_dir.is_dir():
        context_mla = _attention_grids(
            _read_newest(mla_dir, "context_mla_perf"), ["num_heads"], "seq"
        )
        generation_mla = _attention_grids(
            _read_newest(mla_dir, "generation_mla_perf"), ["num_heads"], "kv"
        )
    nccl_dir = root / gpu / "comm" / "nccl"
    n = pd.read_parquet(nccl_dir / _newest(nccl_dir, "nccl_perf.parquet") / "nccl_perf.parquet")
    n = n[n["nccl_dtype"] == "half"]
    nccl = {}
    for ours, theirs in NCCL_OPS.items():
        for gpus, g in n[n["op_name"] == theirs].groupby("num_gpus"):
            nccl[ours, int(gpus)] = GridTable.from_points(
                ("bytes",),
                2.0 * g[["message_size"]].to_numpy(),
                g["latency"].to_numpy() * MS,
            )
    custom = {}
    custom_dir = root / gpu / "comm" / BACKEND
    if custom_dir.is_dir() and any(custom_dir.glob("*/custom_allreduce_perf.parquet")):
        c = _read_newest(custom_dir, "custom_allreduce_perf")
        c = c[c["allreduce_dtype"] == "bfloat16"]
        for gpus, g in c.groupby("num_gpus"):
            custom[int(gpus)] = GridTable.from_points(
                ("bytes",), 2.0 * g[["message_size"]].to_numpy(), g["latency"].to_numpy() * MS
            )
    return MeasuredTables(
        gpu,
        gemm,
        attention,
        nccl,
        version,
        context=context,
        generation=generation,
        context_mla=context_mla,
        generation_mla=generation_mla,
        custom_all_reduce=custom,
        moe=_moe_grids(root / gpu / "moe" / BACKEND),
    )


MOE_LEFT_OUT = ("moe_torch_flow_nongated",)
"""Kernel sources of ``moe_perf`` not read: non-gated experts (ReLU²; the experts here are
SwiGLU)."""
MOE_LAYOUT = [
    "moe_dtype",
    "hidden_size",
    "inter_size",
    "topk",
    "num_experts",
    "moe_tp_size",
    "moe_ep_size",
    "distribution",
]


def _moe_grids(folder: Path) -> dict[tuple, GridTable]:
    """Every collection's ``moe_perf`` under ``folder``, newest first: a layout takes the newest
    collection that measured it (module docstring)."""
    import pandas as pd
    from packaging.version import Version

    if not folder.is_dir():
        return {}
    versions = [p.name for p in folder.iterdir() if (p / "moe_perf.parquet").is_file()]
    grids: dict[tuple, GridTable] = {}
    for version in sorted(versions, key=Version, reverse=True):
        f = pd.read_parquet(folder / version / "moe_perf.parquet")
        f = f[~f["kernel_source"].isin(MOE_LEFT_OUT)]
        for values, g in f.groupby(MOE_LAYOUT):
            layout = (str(values[0]), *(int(v) for v in values[1:-1]), str(values[-1]))
            if layout in grids or g["num_tokens"].nunique() < 2:
                continue
            grids[layout] = GridTable.from_points(
                ("tokens",), g[["num_tokens"]].to_numpy(), g["latency"].to_numpy() * MS
            )
    return grids


def _read_newest(folder: Path, table: str):
    import pandas as pd

    name = f"{table}.parquet"
    return pd.read_parquet(folder / _newest(folder, name) / name)


def _attention_grids(frame, layout: list[str], length: str) -> dict[tuple[int, ...], GridTable]:
    """Grids of one attention table: 16-bit attention inputs, no sliding window, one beam;
    keyed by ``layout`` columns and the cache's bytes per element; axes (batch, ``seq``: the
    prompt, or ``kv``: the cached positions a decode step reads, ``isl + step``)."""
    keep = frame["kv_cache_dtype"].isin(list(KV_BYTES))
    for col, value in (("attn_dtype", "bfloat16"), ("mla_dtype", "bfloat16")):
        if col in frame:
            keep &= frame[col] == value
    for col, value in (("window_size", 0), ("beam_width", 1)):
        if col in frame:
            keep &= frame[col] == value
    f = frame[keep].assign(
        kv_bytes=frame.loc[keep, "kv_cache_dtype"].map(KV_BYTES),
        length=frame.loc[keep, "isl"] + (frame.loc[keep, "step"] if length == "kv" else 0),
    )
    grids = {}
    for values, g in f.groupby([*layout, "kv_bytes"]):
        if g["batch_size"].nunique() > 1 and g["length"].nunique() > 1:
            grids[tuple(int(v) for v in values)] = GridTable.from_points(
                ("batch", length),
                g[["batch_size", "length"]].to_numpy(),
                g["latency"].to_numpy() * MS,
            )
    return grids


def _newest(folder: Path, table: str) -> str:
    """The newest collection under ``folder`` that holds ``table`` (a newer collection may
    only point back at an older one's data, e.g. b200_sxm gemm 1.3.0rc23's reuse.yaml)."""
    from packaging.version import Version

    versions = (
        [p.name for p in folder.iterdir() if (p / table).is_file()] if folder.is_dir() else []
    )
    if not versions:
        raise ConfigError(f"no measured {table} under {folder}")
    return max(versions, key=Version)
