"""The sympy symbols every cost expression is written in.

Model dimensions and parallel degrees are positive integer symbols, so one derived expression
serves every model of a family and every plan; binding happens only when costs are evaluated
(vectorized, by :mod:`stage_dse.cost.compile`).
"""

from __future__ import annotations

import sympy as sp

from stage_dse.spec.plan import MeshAxis

__all__ = ["DEGREE", "HARDWARE_SYMBOLS", "S", "Symbols"]


def _sym(name: str) -> sp.Symbol:
    return sp.Symbol(name, positive=True, integer=True)


def _real(name: str) -> sp.Symbol:
    return sp.Symbol(name, positive=True)


def _count(name: str) -> sp.Symbol:
    return sp.Symbol(name, integer=True, nonnegative=True)


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
    """Positions a windowed attention layer attends to and caches (``sliding_window``)."""
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
    """Data-parallel ranks one expert-parallel group takes: ``ep``, or ``ep / tp`` when the
    group spans the tensor-parallel ranks too (``ep_over_tp``)."""
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
    recompute_share = _real("recompute_share")
    """Share of the layers full recompute covers (``plan.recompute_layers`` of each model
    chunk; 1 for every layer, and where full recompute is not chosen)."""
    # hardware (HardwareSpec), base units
    peak_flops = _real("peak_flops")
    peak_fp8_flops = sp.Symbol("peak_fp8_flops", nonnegative=True)
    peak_fp4_flops = sp.Symbol("peak_fp4_flops", nonnegative=True)
    sustained_clock = _real("sustained_clock")
    measured_efficiency = _real("measured_efficiency")
    hbm_bandwidth = _real("hbm_bandwidth")
    host_bandwidth = _real("host_bandwidth")
    """GPU-host link, bytes/s per GPU and direction (activation offload)."""
    rowwise_gemm_speed = _real("rowwise_gemm_speed")
    mxfp8_gemm_speed = sp.Symbol("mxfp8_gemm_speed", nonnegative=True)
    gemm_efficiency = _real("gemm_efficiency")
    fp8_gemm_efficiency = _real("fp8_gemm_efficiency")
    fp4_gemm_efficiency = _real("fp4_gemm_efficiency")
    gemm_half_dim = _real("gemm_half_dim")
    fp8_gemm_half_dim = _real("fp8_gemm_half_dim")
    fp4_gemm_half_dim = _real("fp4_gemm_half_dim")
    attention_efficiency = _real("attention_efficiency")
    memory_efficiency = _real("memory_efficiency")
    kernel_launch_s = _real("kernel_launch_s")
    host_op_s = sp.Symbol("host_op_s", nonnegative=True)
    """Host seconds to issue one op eagerly (framework dispatch and kernel launch)."""
    overlap_slowdown = sp.Symbol("overlap_slowdown", nonnegative=True)
    gemm_floor_s = sp.Symbol("gemm_floor_s", nonnegative=True)
    attention_floor_s = sp.Symbol("attention_floor_s", nonnegative=True)
    elementwise_floor_s = sp.Symbol("elementwise_floor_s", nonnegative=True)
    moe_layer_latency_s = sp.Symbol("moe_layer_latency_s", nonnegative=True)
    usable_memory = _real("usable_memory")
    # cluster (ClusterSpec), base units
    gpus_per_node = _sym("gpus_per_node")
    intra_bandwidth = _real("intra_bandwidth")
    inter_bandwidth = _real("inter_bandwidth")
    intra_latency = _real("intra_latency")
    inter_latency = _real("inter_latency")
    collective_base_latency = sp.Symbol("collective_base_latency", nonnegative=True)
    oneshot_latency = sp.Symbol("oneshot_latency", nonnegative=True)
    """One-shot all-reduce latency (0 where the cluster has none)."""
    ll_intra_latency = sp.Symbol("ll_intra_latency", nonnegative=True)
    """Low-latency protocol, per step inside a domain (the bandwidth protocol's where the
    cluster has none)."""
    ll_inter_latency = sp.Symbol("ll_inter_latency", nonnegative=True)
    ll_base_latency = sp.Symbol("ll_base_latency", nonnegative=True)
    intra_efficiency = _real("intra_efficiency")
    inter_efficiency = _real("inter_efficiency")
    pod_gpus = _sym("pod_gpus")
    oversubscription = _real("oversubscription")

    @classmethod
    def all(cls) -> dict[str, sp.Symbol]:
        return {k: v for k, v in vars(cls).items() if isinstance(v, sp.Symbol)}


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
    "fp4_gemm_efficiency",
    "gemm_half_dim",
    "fp8_gemm_half_dim",
    "fp4_gemm_half_dim",
    "attention_efficiency",
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

DEGREE: dict[MeshAxis, sp.Expr] = {
    # expert parallelism is carved out of the data-parallel ranks: the DP mesh axis holds the
    # dp / ep_data replicas of each expert shard, so DP x EP spans all dp data-parallel ranks
    # (ep_data = ep, or ep / tp when the expert group also spans the tensor-parallel ranks);
    # under hybrid sharding DS x EP is one sharding group and DR its dp_replicate replicas,
    # in DP's place
    MeshAxis.DP: S.dp / S.ep_data,
    MeshAxis.DS: S.dp / (S.ep_data * S.dp_replicate),
    MeshAxis.DR: S.dp_replicate,
    MeshAxis.TP: S.tp,
    MeshAxis.PP: S.pp,
    MeshAxis.CP: S.cp,
    MeshAxis.EP: S.ep_data,
}
"""Size of each mesh axis (``dp`` is the whole data-parallel degree, ``ep_data`` and
``dp_replicate`` factors of it)."""
