"""The sympy symbols every cost expression is written in.

Model dimensions and parallel degrees are positive integer symbols, so one derived expression
serves every model of a family and every plan; binding happens only when costs are evaluated
(vectorized, by :mod:`stage_dse.cost.compile`).

The symbols are declared here without importing sympy: an attribute of :class:`Symbols`
becomes its sympy symbol on first use, and :meth:`Symbols.names` lists them without sympy, so
a process that only evaluates families compiled earlier (names, no expressions) never imports
it (sympy is about a third of a fresh process's import time).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from stage_dse.spec.plan import MeshAxis

if TYPE_CHECKING:
    import sympy as sp

__all__ = ["DEGREE", "HARDWARE_SYMBOLS", "S", "Symbols"]


class _Declared:
    """A symbol's name and assumptions; read through the class, the sympy symbol (made once)."""

    __slots__ = ("assumptions", "name", "symbol")

    def __init__(self, name: str, **assumptions: bool) -> None:
        self.name = name
        self.assumptions = assumptions
        self.symbol = None

    def __get__(self, obj: object, owner: type) -> sp.Symbol:
        symbol = self.symbol
        if symbol is None:
            import sympy

            symbol = self.symbol = sympy.Symbol(self.name, **self.assumptions)
        return symbol


def _sym(name: str) -> _Declared:
    return _Declared(name, positive=True, integer=True)


def _real(name: str) -> _Declared:
    return _Declared(name, positive=True)


def _count(name: str) -> _Declared:
    return _Declared(name, integer=True, nonnegative=True)


def _nonneg(name: str) -> _Declared:
    return _Declared(name, nonnegative=True)


class Symbols:
    """Namespace of the symbols (attribute names are the column names used for binding)."""

    # model dimensions
    micro_batch = _sym("micro_batch")
    seq = _sym("seq")
    hidden = _sym("hidden")
    ffn = _sym("ffn")
    heads = _sym("heads")
    kv_heads = _sym("kv_heads")
    head_dim = _sym("head_dim")
    vocab = _sym("vocab")
    layers = _sym("layers")
    positions = _sym("positions")
    # mixture of experts (bound to neutral values for dense models, where they do not appear)
    experts = _sym("experts")
    top_k = _sym("top_k")
    moe_ffn = _sym("moe_ffn")
    shared_experts = _count("shared_experts")
    capacity_factor = _real("capacity_factor")
    dense_layers = _count("dense_layers")
    """Leading dense-MLP layers of a mixture-of-experts model (``first_dense_layers``)."""
    mtp_layers = _count("mtp_layers")
    """Multi-token prediction modules on the last pipeline stage (``model.mtp_layers``)."""
    moe_interval = _sym("moe_interval")
    """After them, every ``moe_interval``-th layer is MoE (``moe_layer_interval``; 1 otherwise)."""
    # DeepSeek Sparse Attention (bound to 1 for other models, where they do not appear)
    topk_tokens = _sym("topk_tokens")
    """Tokens a query's sparse attention reads (``sparse_attention_topk``)."""
    index_heads = _sym("index_heads")
    index_dim = _sym("index_dim")
    """The lightning indexer's heads and head width (``indexer_heads``, ``indexer_head_dim``)."""
    # sliding-window attention (bound to 1 for other models, where they do not appear)
    window = _sym("window")
    """Positions a windowed attention layer attends to and caches (``sliding_window``), or
    the chunk a chunked-attention layer attends within (``attention_chunk_size``)."""
    full_interval = _sym("full_interval")
    """Every ``full_interval``-th layer attends over the whole context, the others over the
    window (``full_attention_interval``; ``layers + 1`` when every layer is windowed)."""
    # multi-head latent attention (bound to 1 for other models, where they do not appear)
    q_lora = _sym("q_lora")
    kv_lora = _sym("kv_lora")
    rope_dim = _sym("rope_dim")
    v_head_dim = _sym("v_head_dim")
    # step
    global_batch = _sym("global_batch")
    context = _sym("context")
    """Serving: key/value length a query attends to (prompt, plus tokens generated so far)."""
    prompt = _sym("prompt")
    """Serving: prompt tokens per sequence (the prefill length)."""
    output_tokens = _sym("output_tokens")
    """Serving: tokens generated per sequence."""
    gemm_bytes = _real("gemm_bytes")
    """Bytes per element of the linear layers' GEMM inputs: 2 (bf16/fp16), 1 (fp8) or 0.5625
    (NVFP4, its block scales included); below 0.75 they run on the FP4 tensor cores."""
    expert_gemm_bytes = _real("expert_gemm_bytes")
    """The same for the routed experts' grouped GEMMs: ``gemm_bytes``, but 1 where an engine runs
    MXFP4 experts with MXFP8 activations on FP4 hardware beside 16-bit layers (W4A8,
    ``EngineSpec.mxfp4_moe_activations``)."""
    quantized_dispatch = _nonneg("quantized_dispatch")
    """Serving: 1 where expert-parallel token dispatch sends ``expert_gemm_bytes`` per element
    (an engine that quantizes before sending, ``EngineSpec.quantized_dispatch``), 0 where it
    sends the 16-bit hidden states."""
    master_bytes = _real("master_bytes")
    """Bytes per value of the optimizer's master weights (``training.master_dtype``)."""
    # the FP8 scaling recipe (stage_dse.spec.training.Fp8Recipe), 0/1 each, 0 for tensorwise
    fp8_rowwise = _count("fp8_rowwise")
    """Row-wise scales (``rowwise``, ``rowwise_gw_hp``)."""
    fp8_wgrad_hp = _count("fp8_wgrad_hp")
    """Weight-gradient GEMMs in 16-bit (``rowwise_gw_hp``)."""
    fp8_mx = _count("fp8_mx")
    """MX block scales (``mxfp8``)."""
    # parallel degrees
    dp = _sym("dp")
    tp = _sym("tp")
    pp = _sym("pp")
    cp = _sym("cp")
    ep = _sym("ep")
    dp_replicate = _sym("dp_replicate")
    """Replicas of a hybrid-sharded data-parallel group (``plan.dp_replicate``; 1 otherwise)."""
    ep_data = _sym("ep_data")
    """Data-parallel ranks one expert-parallel group takes: ``ep``, divided by ``tp`` when the
    group spans the tensor-parallel ranks too (``ep_over_tp``) and by ``cp`` when it spans the
    context-parallel ones (``ep_over_cp``)."""
    virtual_stages = _sym("virtual_stages")
    # the layer split over pipeline stages (stage_dse.spec.stages.stage_values)
    first_layers = _sym("first_layers")
    """Layers on the first pipeline stage (all chunks)."""
    last_layers = _sym("last_layers")
    """Layers on the last pipeline stage (all chunks)."""
    mid_layers = _count("mid_layers")
    """Most layers on a middle stage (0 without middle stages)."""
    mid_stage = _count("mid_stage")
    """Index of the first middle stage with ``mid_layers``."""
    act_layers = _count("act_layers")
    """Layers on the middle stage with the most layer-micro-batches in flight."""
    act_stage = _count("act_stage")
    """Its index."""
    offload_layers = _count("offload_layers")
    """Layers whose saved activations are offloaded to host memory (``plan.offload_layers``)."""
    graph_attn = _count("graph_attn")
    """1 where the plan captures each layer's attention half in a CUDA graph, else 0
    (``plan.cuda_graphs``; so are ``graph_mlp``, ``graph_router`` and ``graph_full``)."""
    graph_mlp = _count("graph_mlp")
    graph_router = _count("graph_router")
    graph_full = _count("graph_full")
    expert_gemm_loop = _count("expert_gemm_loop")
    """1 where a grouped expert GEMM is issued one GEMM per local expert."""
    fsdp_master_shards = _count("fsdp_master_shards")
    """1 where ZeRO-3 stores each parameter shard only as the optimizer's master."""
    recompute_share = _real("recompute_share")
    """Share of the layers full recompute covers (``plan.recompute_layers`` of each model
    chunk; 1 for every layer, and where full recompute is not chosen)."""
    # hardware (HardwareSpec), base units
    peak_flops = _real("peak_flops")
    peak_fp8_flops = _nonneg("peak_fp8_flops")
    peak_fp4_flops = _nonneg("peak_fp4_flops")
    sustained_clock = _real("sustained_clock")
    measured_efficiency = _real("measured_efficiency")
    hbm_bandwidth = _real("hbm_bandwidth")
    host_bandwidth = _real("host_bandwidth")
    """GPU-host link, bytes/s per GPU and direction (activation offload)."""
    rowwise_gemm_speed = _real("rowwise_gemm_speed")
    mxfp8_gemm_speed = _nonneg("mxfp8_gemm_speed")
    gemm_efficiency = _real("gemm_efficiency")
    fp8_gemm_efficiency = _real("fp8_gemm_efficiency")
    fp8_step_efficiency = _real("fp8_step_efficiency")
    """Training: share of ``fp8_gemm_efficiency`` FP8 GEMMs reach in a step (serving: 1)."""
    fp4_gemm_efficiency = _real("fp4_gemm_efficiency")
    w4a16_moe_efficiency = _real("w4a16_moe_efficiency")
    """Grouped expert GEMMs with 4-bit weights under 16-bit math: share of the 16-bit peak."""
    gemm_half_dim = _real("gemm_half_dim")
    fp8_gemm_half_dim = _real("fp8_gemm_half_dim")
    fp4_gemm_half_dim = _real("fp4_gemm_half_dim")
    attention_efficiency = _real("attention_efficiency")
    attention_half_dim = _nonneg("attention_half_dim")
    """Head dimension at which the softmax costs attention as much as its tensor-core work."""
    context_attention_speed = _real("context_attention_speed")
    """Serving: prefill attention's speed over the 16-bit kernel's (an engine's FP8 attention,
    ``EngineSpec.context_attention_speed``; 1 otherwise)."""
    memory_efficiency = _real("memory_efficiency")
    kernel_launch_s = _real("kernel_launch_s")
    host_op_s = _nonneg("host_op_s")
    """Host seconds to issue one op eagerly (framework dispatch and kernel launch)."""
    overlap_slowdown = _nonneg("overlap_slowdown")
    gemm_floor_s = _nonneg("gemm_floor_s")
    attention_floor_s = _nonneg("attention_floor_s")
    elementwise_floor_s = _nonneg("elementwise_floor_s")
    moe_layer_latency_s = _nonneg("moe_layer_latency_s")
    usable_memory = _real("usable_memory")
    # cluster (ClusterSpec), base units
    gpus_per_node = _sym("gpus_per_node")
    intra_bandwidth = _real("intra_bandwidth")
    inter_bandwidth = _real("inter_bandwidth")
    intra_latency = _real("intra_latency")
    inter_latency = _real("inter_latency")
    collective_base_latency = _nonneg("collective_base_latency")
    oneshot_latency = _nonneg("oneshot_latency")
    """One-shot all-reduce latency (0 where the cluster has none)."""
    ll_intra_latency = _nonneg("ll_intra_latency")
    """Low-latency protocol, per step inside a domain (the bandwidth protocol's where the
    cluster has none)."""
    ll_inter_latency = _nonneg("ll_inter_latency")
    ll_base_latency = _nonneg("ll_base_latency")
    intra_efficiency = _real("intra_efficiency")
    inter_efficiency = _real("inter_efficiency")
    pod_gpus = _sym("pod_gpus")
    oversubscription = _real("oversubscription")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every symbol's name, in declaration order (no sympy needed)."""
        return tuple(k for k, v in vars(cls).items() if isinstance(v, _Declared))

    @classmethod
    def all(cls) -> dict[str, sp.Symbol]:
        return {k: getattr(cls, k) for k in cls.names()}


S = Symbols

HARDWARE_SYMBOLS = (
    "peak_flops",
    "peak_fp8_flops",
    "peak_fp4_flops",
    "sustained_clock",
    "measured_efficiency",
    "hbm_bandwidth",
    "host_bandwidth",
    "rowwise_gemm_speed",
    "mxfp8_gemm_speed",
    "gemm_efficiency",
    "fp8_gemm_efficiency",
    "fp8_step_efficiency",
    "fp4_gemm_efficiency",
    "w4a16_moe_efficiency",
    "gemm_half_dim",
    "fp8_gemm_half_dim",
    "fp4_gemm_half_dim",
    "attention_efficiency",
    "attention_half_dim",
    "memory_efficiency",
    "kernel_launch_s",
    "host_op_s",
    "overlap_slowdown",
    "gemm_floor_s",
    "attention_floor_s",
    "elementwise_floor_s",
    "moe_layer_latency_s",
    "usable_memory",
    "gpus_per_node",
    "intra_bandwidth",
    "inter_bandwidth",
    "intra_latency",
    "inter_latency",
    "collective_base_latency",
    "oneshot_latency",
    "ll_intra_latency",
    "ll_inter_latency",
    "ll_base_latency",
    "intra_efficiency",
    "inter_efficiency",
    "pod_gpus",
    "oversubscription",
)
"""Symbols bound from ``HardwareSpec`` and ``ClusterSpec`` (all others come from the model,
training step and plan)."""


class _Degrees(Mapping):
    """The size of each mesh axis (``dp`` is the whole data-parallel degree, ``ep_data`` and
    ``dp_replicate`` factors of it): sympy expressions, built on first use."""

    def __init__(self) -> None:
        self._sizes: dict[MeshAxis, sp.Expr] | None = None

    def _built(self) -> dict[MeshAxis, sp.Expr]:
        if self._sizes is None:
            # expert parallelism is carved out of the data-parallel ranks: the DP mesh axis
            # holds the dp / ep_data replicas of each expert shard, so DP x EP spans all dp
            # data-parallel ranks (ep_data = ep, divided by tp and cp when the expert group also
            # spans those ranks); under hybrid sharding DS x EP is one sharding group
            # and DR its dp_replicate replicas, in DP's place
            self._sizes = {
                MeshAxis.DP: S.dp / S.ep_data,
                MeshAxis.DS: S.dp / (S.ep_data * S.dp_replicate),
                MeshAxis.DR: S.dp_replicate,
                MeshAxis.TP: S.tp,
                MeshAxis.PP: S.pp,
                MeshAxis.CP: S.cp,
                MeshAxis.EP: S.ep_data,
            }
        return self._sizes

    def __getitem__(self, axis: MeshAxis) -> sp.Expr:
        return self._built()[axis]

    def __iter__(self) -> Iterator[MeshAxis]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())


DEGREE: Mapping[MeshAxis, sp.Expr] = _Degrees()
"""Size of each mesh axis (``dp`` is the whole data-parallel degree, ``ep_data`` and
``dp_replicate`` factors of it)."""
