"""``EngineSpec``: what an inference engine adds to the model's kernels, and its limits.

An engine runs the serving program's kernels one iteration at a time (continuous batching,
:mod:`stage_dse.cost.batching`). Between and around the GPU work of an iteration it schedules
the next batch, prepares inputs, samples, detokenizes and streams; what of that the engine does
not hide behind the GPU (overlap or asynchronous schedulers) lengthens every step. Two costs
describe it: a fixed one per iteration and one per running request per iteration. The limits
(``max_running``, ``prefill_budget``) are the engine's documented defaults, used where a
measurement does not state its own; an engine that picks them by GPU states the rule
(``large_gpu_*``, :meth:`EngineSpec.for_hardware`). Profiles live in
``conf/engine/<name>.yaml`` with their citations; ``none`` adds nothing (the kernels alone).

**KV-cache pool.** Engines do not give the cache all the memory the weights and the working
set leave; each sizes it by its own rule (``kv_memory_rule``, with ``kv_memory_fraction``):

* ``usable`` (no engine): everything the weights and the widest step's working set leave;
* ``total_fraction`` (vLLM ``gpu_memory_utilization``, 0.9 by default: ``CacheConfig``): the
  engine may use that fraction of the GPU's memory for weights, activations and cache; the
  cache gets what the weights and the profiled peak activation leave of it;
* ``static_reserve`` (SGLang ``mem_fraction_static``): weights and cache together take a
  static fraction of the GPU's memory; unset, it is ``(gpu_mem - reserved) / gpu_mem`` with
  ``reserved`` by GPU class (``python/sglang/srt/server_args.py``, ``ServerArgs.__post_init__``
  of the 0.4.7-0.5 releases: 9.5 GiB + 0.5 GiB per tp x pp rank below 90 GiB, 12 GiB + 0.5 GiB
  per rank below 160 GiB, 32 GiB above; 4 GiB more with DP attention); a stated
  ``kv_memory_fraction`` is the static fraction itself;
* ``free_fraction`` (TensorRT-LLM ``KvCacheConfig.free_gpu_memory_fraction``, 0.9 by default;
  ``trtllm-bench --kv_cache_free_gpu_mem_fraction``): that fraction of the memory free after
  the weights and the runtime's activation buffers.

**KV-cache room per request** (``kv_reserve_ratio``). How many requests run at once when the
pool is the limit depends on what each running request holds: its prompt and the tokens it
has generated, plus what the engine keeps free for the tokens still to come:

* vLLM allocates cache blocks as tokens arrive and preempts the newest running request when
  a step's tokens find no free block (Kwon et al., "Efficient Memory Management for Large
  Language Model Serving with PagedAttention", SOSP 2023, sec. 4.5 "Scheduling and
  Preemption"; the V1 scheduler's ``kv_cache_manager.allocate_slots`` each step,
  ``vllm/v1/core/sched/scheduler.py``): ratio 0;
* SGLang admits a prompt only if the pool also holds ``new_token_ratio`` times the remaining
  ``max_new_tokens`` of every running request; the ratio starts at
  ``SGLANG_INIT_NEW_TOKEN_RATIO`` (0.7) and decays over 600 decode steps towards 0.14 of it
  (``python/sglang/srt/environ.py``): ratio 0.7, the rule a burst of requests meets;
* TensorRT-LLM's default capacity scheduler policy, ``GUARANTEED_NO_EVICT`` ("guarantee that
  a started request is never paused", performance tuning guide, "Useful Runtime Options"),
  admits a request only if its whole maximum length fits: ratio 1.

A request holds, averaged over its decode, its prompt, half its output and ``ratio`` times
the other half.

**FP8 prefill attention** (``fp8_context_attention``). TensorRT-LLM's attention op runs its
context (prefill) kernels in FP8 when the attention output feeds an FP8 or FP4 projection or
the KV cache is FP8 with paged context attention (``mFP8ContextFMHA``,
``cpp/tensorrt_llm/thop/attentionOp.cpp``, the PyTorch backend's default path since 1.0; the
older TensorRT engine flow left it to the ``use_fp8_context_fmha`` build flag, off by default).
Such a kernel runs ``HardwareSpec.fp8_attention_speedup`` times as fast as the 16-bit one,
measured per GPU (:meth:`EngineSpec.context_attention_speed`).

**Quantized token dispatch** (``quantized_dispatch``). Where attention ranks exchange tokens
with expert-parallel ranks, TensorRT-LLM quantizes the hidden states to the experts' input
format before sending them: NVFP4 values with their block scales, MXFP8, or per-tensor FP8
("post-quant" all-gather or all-to-all, ``run_post_quant_allgather`` in
``tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py``; FP8 block-scaled experts
quantize inside the MoE kernel and send 16-bit). The experts' outputs come back in 16-bit. A
dispatch then moves ``expert_gemm_bytes`` per element where 16-bit engines move 2.

**MXFP4 experts on FP4 hardware** (``mxfp4_moe_activations``). Where a checkpoint stores only
the routed experts in MXFP4 (gpt-oss: attention, router and embeddings in bf16), an engine on
a GPU with FP4 tensor cores picks the experts' activation format itself:

* TensorRT-LLM quantizes them to MXFP8 and runs W4A8 on Blackwell (its GPT-OSS deployment
  guide: MXFP8 activations, MXFP4 MoE weights on B200/GB200/B300/GB300): ``mxfp8``;
* SGLang selects its ``flashinfer_mxfp4`` MoE runner on SM100 for MXFP4 checkpoints
  (``python/sglang/srt/server_args.py``), which quantizes the input to MXFP8 first ("Based on
  profiling results, we need to quantize x to mxfp8", ``layers/quantization/mxfp4.py``):
  ``mxfp8``;
* vLLM's default on SM100 is FlashInfer's MXFP4 x BF16 kernel; MXFP8 activations need
  ``VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8`` (``get_mxfp4_backend``,
  ``vllm/model_executor/layers/quantization/mxfp4.py``): ``bf16``.

With ``mxfp8`` the grouped expert GEMMs run on the FP8 tensor cores while the other layers
stay 16-bit (:meth:`EngineSpec.expert_gemm_bytes`); GPUs without FP4 tensor cores run MXFP4
experts weight-only whatever the engine (W4A16).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from stage_dse.errors import ConfigError

__all__ = ["KV_MEMORY_RULES", "MXFP4_MOE_ACTIVATIONS", "EngineSpec", "sglang_reserved_bytes"]


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    name: str = "none"
    step_overhead_s: float = 0.0
    """Per iteration, not hidden behind the GPU: scheduling, input preparation, launch."""
    request_overhead_s: float = 0.0
    """Per running request per iteration: sampling, detokenization, output processing."""
    max_running: int = 256
    """Default running-request limit (``max_num_seqs``, ``max_batch_size``)."""
    prefill_budget: int = 8192
    """Default tokens per iteration (``max_num_batched_tokens``, ``max_num_tokens``)."""
    large_gpu_min_gib: float = 0.0
    """GPUs with at least this much memory (GiB) run the ``large_gpu_*`` limits instead (0: one
    set of limits for every GPU)."""
    large_gpu_excludes: tuple[str, ...] = ()
    """Hardware names holding one of these run the base limits whatever their memory."""
    large_gpu_max_running: int = 0
    """``max_running`` on a large GPU (0: the base value)."""
    large_gpu_prefill_budget: int = 0
    """``prefill_budget`` on a large GPU (0: the base value)."""
    cuda_graph_max_batch: int = 0
    """Largest decode batch captured in a CUDA graph (0: not stated); informational."""
    scheduling: str = ""
    """The scheduling policy in words (what runs first, what is chunked)."""
    kv_memory_rule: str = "usable"
    """How the engine sizes its KV-cache pool (module docstring): ``usable``,
    ``total_fraction``, ``static_reserve`` or ``free_fraction``."""
    fp8_context_attention: bool = False
    """Prefill attention runs on the FP8 tensor cores (queries, keys and values quantized) when
    the linear layers are FP8 or FP4 or the KV cache is FP8 (module docstring, *FP8 prefill
    attention*)."""
    quantized_dispatch: bool = False
    """Expert-parallel token dispatch sends the hidden states in the experts' GEMM input format
    (module docstring, *Quantized token dispatch*); off, in 16-bit."""
    mxfp4_moe_activations: str = "bf16"
    """The activation format of MXFP4 routed experts beside 16-bit layers on GPUs with FP4
    tensor cores: ``bf16`` (W4A16 math) or ``mxfp8`` (W4A8 on the FP8 tensor cores); module
    docstring, *MXFP4 experts on FP4 hardware*."""
    kv_reserve_ratio: float = 1.0
    """Share of a running request's remaining output tokens the engine keeps KV-cache room
    for (module docstring, *KV-cache room per request*): 1 reserves the whole request up
    front, 0 allocates blocks as tokens arrive."""
    kv_memory_fraction: float = 1.0
    """The rule's fraction (``gpu_memory_utilization``, ``mem_fraction_static`` when stated,
    ``free_gpu_memory_fraction``); unused by ``usable`` and by a default ``static_reserve``."""
    dp_attention_splits_budget: bool = False
    """With attention data-parallel, each attention rank gets the token budget divided by the
    ranks (SGLang: ``chunked_prefill_size // dp_size``); off, every rank has the whole budget."""
    dp_attention_splits_running: bool = False
    """With attention data-parallel, each attention rank runs at most the running-request limit
    divided by the ranks (SGLang: ``max_running_requests // dp_size``); off, the limit is each
    rank's own (TensorRT-LLM's ``max_batch_size``, "max batch size in each rank"; vLLM's
    ``max_num_seqs`` per data-parallel engine)."""
    running_limit_per_stage: bool = False
    """With pipeline stages, the running-request limit bounds each batch in flight, the engine
    holding ``pp`` times as many (TensorRT-LLM: ``max_num_active_requests`` is
    ``get_max_num_sequences()``, ``pp_size * max_batch_size``,
    ``tensorrt_llm/_torch/pyexecutor/model_engine.py``); off, it bounds all of them together
    (vLLM's scheduler holds ``max_num_seqs`` running over its ``pp`` concurrent batches;
    SGLang's micro-batches take ``max_running_requests // pp_size`` each,
    ``pp_max_micro_batch_size`` in ``python/sglang/srt/managers/scheduler.py``)."""
    dp_context_sync: bool = False
    """With attention data-parallel, the ranks run their prompts in the same iterations
    (TensorRT-LLM's ``attention_dp_config.enable_balance``); off (every engine's default), each
    rank admits prompts on its own and an iteration lasts as long as its slowest rank
    (:mod:`stage_dse.cost.batching`)."""

    def __post_init__(self) -> None:
        for field in ("step_overhead_s", "request_overhead_s"):
            v = getattr(self, field)
            if not (isinstance(v, int | float) and 0 <= v < 1):
                raise ConfigError(
                    f"engine.{field} must be seconds in [0, 1) (e.g. 0.0005), got {v!r}"
                )
        for field in ("max_running", "prefill_budget"):
            v = getattr(self, field)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"engine.{field} must be an integer >= 1, got {v!r}")
        if self.kv_memory_rule not in KV_MEMORY_RULES:
            raise ConfigError(
                f"engine.kv_memory_rule must be one of {', '.join(KV_MEMORY_RULES)}, "
                f"got {self.kv_memory_rule!r}"
            )
        v = self.kv_reserve_ratio
        if not (isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1):
            raise ConfigError(
                f"engine.kv_reserve_ratio must be a fraction in [0, 1] (0: blocks allocated "
                f"as tokens arrive, 1: whole request reserved), got {v!r}"
            )
        v = self.kv_memory_fraction
        if not (isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1):
            raise ConfigError(
                f"engine.kv_memory_fraction must be a fraction in (0, 1] (e.g. 0.9), got {v!r}"
            )
        for field in (
            "fp8_context_attention",
            "quantized_dispatch",
            "dp_attention_splits_budget",
            "dp_attention_splits_running",
            "running_limit_per_stage",
            "dp_context_sync",
        ):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(
                    f"engine.{field} must be true or false, got {getattr(self, field)!r}"
                )
        if self.mxfp4_moe_activations not in MXFP4_MOE_ACTIVATIONS:
            raise ConfigError(
                f"engine.mxfp4_moe_activations must be one of "
                f"{', '.join(MXFP4_MOE_ACTIVATIONS)}, got {self.mxfp4_moe_activations!r}"
            )
        for field in ("cuda_graph_max_batch", "large_gpu_max_running", "large_gpu_prefill_budget"):
            v = getattr(self, field)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ConfigError(f"engine.{field} must be an integer >= 0, got {v!r}")
        v = self.large_gpu_min_gib
        if not (isinstance(v, int | float) and not isinstance(v, bool) and v >= 0):
            raise ConfigError(
                f"engine.large_gpu_min_gib must be GiB >= 0 (0: no rule, e.g. 70), got {v!r}"
            )
        if isinstance(self.large_gpu_excludes, str) or not all(
            isinstance(x, str) for x in self.large_gpu_excludes
        ):
            raise ConfigError(
                "engine.large_gpu_excludes must be a list of hardware-name parts (e.g. [a100]), "
                f"got {self.large_gpu_excludes!r}"
            )

    def replace(self, **changes: object) -> EngineSpec:
        return dataclasses.replace(self, **changes)

    def for_hardware(self, hardware) -> EngineSpec:
        """This profile with the limits it defaults to on ``hardware`` (a ``HardwareSpec``):
        the ``large_gpu_*`` ones on a GPU of at least ``large_gpu_min_gib`` whose name holds
        none of ``large_gpu_excludes``, else the base ones."""
        if not self.large_gpu_min_gib or hardware.hbm_bytes < self.large_gpu_min_gib * 2**30:
            return self
        if any(x in hardware.name for x in self.large_gpu_excludes):
            return self
        return self.replace(
            max_running=self.large_gpu_max_running or self.max_running,
            prefill_budget=self.large_gpu_prefill_budget or self.prefill_budget,
        )

    def cost_columns(self) -> dict[str, float]:
        """The table columns of what this engine adds to each continuous-batching step
        (:func:`stage_dse.cost.batching.continuous_batching` reads them): ``step_overhead_s``,
        ``request_overhead_s``, ``dp_context_sync`` (1.0 when attention ranks run their
        prompts together) and ``kv_reserve_ratio``; and the symbol column
        ``quantized_dispatch`` (1.0 when token dispatch sends the experts' input format)."""
        return {
            "step_overhead_s": self.step_overhead_s,
            "request_overhead_s": self.request_overhead_s,
            "dp_context_sync": float(self.dp_context_sync),
            "kv_reserve_ratio": float(self.kv_reserve_ratio),
            "quantized_dispatch": float(self.quantized_dispatch),
        }

    def context_attention_speed(self, weights_dtype, kv_dtype, fp8_speedup: float) -> float:
        """How much faster this engine's prefill attention runs than the 16-bit kernel: 1, or
        with FP8 prefill attention on FP8 or FP4 linear layers or an FP8 cache, the GPU's
        ``fp8_attention_speedup``."""
        quantized = weights_dtype.value == "fp8" or weights_dtype.is_fp4 or kv_dtype.value == "fp8"
        return float(fp8_speedup) if self.fp8_context_attention and quantized else 1.0

    def expert_gemm_bytes(self, serving, hardware) -> float:
        """The routed experts' GEMM input bytes for ``serving`` on ``hardware`` (the
        ``expert_gemm_bytes`` column): 1 (FP8 tensor cores) for MXFP4 experts beside 16-bit
        layers when this engine feeds them MXFP8 activations on a GPU with FP4 tensor cores,
        else the pass's ``gemm_bytes``."""
        gemm_bytes = serving.step_like(hardware).gemm_dtype.bytes
        w4a8 = (
            self.mxfp4_moe_activations == "mxfp8"
            and hardware.peak_fp4_flops > 0
            and serving.experts_dtype.value == "mxfp4"
        )
        return min(gemm_bytes, 1.0) if w4a8 else gemm_bytes

    def kv_pool_columns(
        self,
        hbm_bytes: float,
        ranks: int,
        attention_dp: bool = False,
        fraction: float | None = None,
    ) -> dict[str, float]:
        """The table columns that bound the KV-cache pool of one GPU under this engine
        (:func:`stage_dse.cost.batching.kv_pool_bytes` reads them): ``engine_memory_bytes``
        (weights, working set and cache together at most), ``engine_static_bytes`` (weights
        and cache together at most) and ``kv_free_fraction`` (the cache's share of what is
        left). ``hbm_bytes``: the GPU's memory; ``ranks``: tp x pp of the replica;
        ``fraction``: a stated fraction in place of the profile's."""
        frac = self.kv_memory_fraction if fraction is None else float(fraction)
        if not 0 < frac <= 1:
            raise ConfigError(f"kv_memory_fraction must be in (0, 1], got {frac:g}")
        out = {
            "engine_memory_bytes": math.inf,
            "engine_static_bytes": math.inf,
            "kv_free_fraction": 1.0,
        }
        if self.kv_memory_rule == "total_fraction":
            out["engine_memory_bytes"] = frac * hbm_bytes
        elif self.kv_memory_rule == "static_reserve":
            if fraction is None:
                frac = 1.0 - sglang_reserved_bytes(hbm_bytes, ranks, attention_dp) / hbm_bytes
            out["engine_static_bytes"] = frac * hbm_bytes
        elif self.kv_memory_rule == "free_fraction":
            out["kv_free_fraction"] = frac
        return out


KV_MEMORY_RULES = ("usable", "total_fraction", "static_reserve", "free_fraction")

MXFP4_MOE_ACTIVATIONS = ("bf16", "mxfp8")

_GIB = 2.0**30


def sglang_reserved_bytes(hbm_bytes: float, ranks: int, attention_dp: bool = False) -> float:
    """Memory SGLang keeps out of its static pool (weights and KV cache) when
    ``mem_fraction_static`` is unset, for activations and CUDA-graph buffers: by GPU class
    and ``tp x pp`` (``server_args.py`` of SGLang 0.4.7-0.5, thresholds on the memory in MiB)."""
    gib = hbm_bytes / _GIB
    if gib < 35:
        reserved = 2.8 + ranks / 10
    elif gib < 90:
        reserved = 9.5 + ranks / 2
    elif gib < 160:
        reserved = 12 + ranks / 2
    else:
        reserved = 32.0
    return (reserved + (4 if attention_dp else 0)) * _GIB
