"""``HardwareSpec`` (one accelerator) and ``ClusterSpec`` (how accelerators are connected).

Base units only (bytes, seconds, flop/s, bytes/s); YAML presets carry human units (GiB, TB/s,
Gb/s, TFLOP/s) and are converted once by :mod:`stage_dse.config.presets`.

Efficiencies are fractions of a peak that well-tuned kernels reach; they are properties of the
hardware and its software stack, shared by every model and GPU count (no per-workload fudge):

* ``gemm_efficiency``: large bf16 GEMMs (cuBLAS) reach this fraction of peak; a GEMM whose
  smallest dimension is ``gemm_half_dim`` runs at half of that (tile and wave quantization).
  FP8 GEMMs saturate only at far larger shapes (``fp8_gemm_half_dim``): fitting
  ``E * d / (d + h)`` to AIConfigurator's measured GEMM tables (m 1024-16384, n and k
  512-16384, kernels of 20 us or more) gives h = 1,328 (H100), 1,227 (H200), 2,038 (B200),
  2,052 (GB200), 464 (L40S) and 889 (RTX PRO 6000) for FP8 against 66-280 for bf16 on the
  same GPUs: an FP8 GEMM whose weights are 2,048 wide runs at 0.61 of its large-GEMM rate on
  H100, a bf16 one at 0.94. The half-saturation holds for the weight dimensions; in the token
  dimension FP8 GEMMs saturate at twice ``gemm_half_dim`` (fitted 159-296 on H100 to GB200
  with 8,192-wide weights), and a few tokens stream the weights.
* ``fp8_gemm_efficiency``: the same for FP8 GEMMs against the FP8 peak. FP8 kernels reach a
  smaller share of their doubled peak: in NVIDIA AIConfigurator's measured tables
  (aiconfigurator-core 0.12.0, GEMMs with m, n, k >= 4096) the median FP8 efficiency is 0.79
  (H100), 0.80 (H200) and 0.81 (B200) of the bf16 one; a preset that gives none takes
  ``FP8_GEMM_RATIO`` x ``gemm_efficiency``.
* ``fp4_gemm_efficiency``: the same for FP4 (NVFP4, W4A4) GEMMs against the dense FP4 peak
  (``peak_fp4_flops``; 0: no FP4 tensor cores, Hopper, Ada and older). FP4 kernels reach a
  smaller share still: in the same tables (GEMMs with m, n, k >= 4096, medians) the NVFP4
  efficiency is 0.60 (B200), 0.62 (GB200), 0.42 (GB300) and 0.79 (RTX PRO 6000 Blackwell
  Server Edition) of the bf16 one; a preset that gives none takes ``FP4_GEMM_RATIO`` x
  ``gemm_efficiency``, the B200-class value. Like FP8 ones they saturate late in the weight
  dimensions (``fp4_gemm_half_dim``): the FP8 fit run on the NVFP4 tables gives E = 0.53 and
  h = 1,674 (B200), 0.50 and 1,674 (GB200), 0.56 and 4,003 (GB300), 0.71 and 702 (RTX PRO
  6000), the token dimension saturating at FP8's (fitted 459-884 on B200 to GB300 with
  8,192-wide weights, FP8 439-547): NVFP4 expert GEMMs 768-1,536 wide run at a third to a
  half of a large GEMM's rate.
* ``w4a16_moe_efficiency``: grouped expert GEMMs with 4-bit weights under 16-bit math
  (W4A16: MXFP4 or INT4 experts dequantized in the kernel's main loop, as Hopper and Ampere
  run gpt-oss) against the 16-bit peak. The dequantization costs the main loop its tensor-core
  rate: AIConfigurator's measured W4A16 MXFP4 MoE tables (``aiconfigurator-core`` 0.12.0, 8,192
  tokens or more, balanced routing, one GPU) saturate at 380 TFLOP/s on H100 and H200 for
  TensorRT-LLM 1.3.0rc20, 235-252 for SGLang 0.5.14 and 509-559 for vLLM 0.19-0.24, where the
  bf16 MoE tables reach 600-730. It caps the 16-bit rate (small shapes keep the latency law of
  the 16-bit kernels). Presets of GPUs with such tables take the median over the engines:
  Hopper and Ada, where every engine runs MXFP4 experts so, and Blackwell (0.234-0.240 of the
  bf16 peak; RTX PRO 6000 0.435), where it binds only under an engine that feeds them bf16
  activations (``EngineSpec.mxfp4_moe_activations``: vLLM's default; TensorRT-LLM and SGLang run
  them W4A8 on the FP8 tensor cores); the others take ``gemm_efficiency``.
* ``attention_efficiency``: fused attention kernels (FlashAttention-2 class) relative to peak,
  at head dimension 128.
* ``attention_half_dim``: how a head dimension ``d`` below 128 slows the compute-bound
  attention kernels. Per score element the tensor cores do ``4 d`` flops (QK and PV) and the
  softmax one exponential on the special-function units, whose rate does not scale with the
  tensor cores': time goes as ``d + h``, efficiency as ``d / (d + h)``, and against head
  dimension 128 the kernel runs at ``d (128 + h) / (128 (d + h))`` (1 at ``d >= 128``, where
  the tables show no consistent gain: 256 over 128 is 0.93-1.21). ``h`` is fitted to
  AIConfigurator's context-attention tables (``aiconfigurator-core`` 0.12.0, causal, no
  window, 8,192 tokens or more, bf16, medians per head dimension and engine): head dimension
  64 runs at 0.76-0.84 of 128 on H100/H200 (TensorRT-LLM, SGLang, vLLM; median 0.82, ``h`` 36),
  0.59-0.68 on B200/GB200 (median 0.64, ``h`` 165) and 0.64-0.75 on B300/GB300 (median
  0.685, ``h`` 109), the tensor cores having doubled per generation and the exponential units
  not. 0 (no slowdown) where no table measures head dimensions (A100, AMD) or the engines
  disagree (L40S, RTX PRO 6000: 0.52-1.16).
* ``memory_efficiency``: streaming kernels relative to HBM bandwidth.
* link efficiencies (in ``ClusterSpec``): achieved NCCL bus bandwidth relative to the link rate.

Latency floors (kernels' and collectives' shortest times) are measured values: the presets take
them from NVIDIA AIConfigurator's kernel tables (``aiconfigurator-core`` 0.12.0, Apache-2.0,
latencies measured under CUDA graphs), each preset naming the table it read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import (
    MAX_GPUS,
    non_negative_number,
    positive_int,
    positive_number,
)

__all__ = ["FP4_GEMM_RATIO", "FP8_GEMM_RATIO", "ClusterSpec", "HardwareSpec"]

FP8_GEMM_RATIO = 0.8
"""FP8 over bf16 GEMM efficiency where a preset does not give its own (see the module doc)."""
FP4_GEMM_RATIO = 0.6
"""FP4 over bf16 GEMM efficiency where a preset does not give its own (see the module doc)."""


def _fraction(owner: str, field: str, value: object) -> None:
    positive_number(owner, field, value)
    if value > 1:  # type: ignore[operator]
        raise ConfigError(f"{owner}.{field} must be in (0, 1], got {value}")


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One GPU: peaks, memory, and the fractions of them real kernels reach."""

    name: str
    peak_flops: float
    """Dense 16-bit (bf16/fp16) tensor-core peak, flop/s."""
    peak_fp8_flops: float = 0.0
    """Dense FP8 tensor-core peak, flop/s (0: no FP8 tensor cores)."""
    peak_fp4_flops: float = 0.0
    """Dense FP4 (NVFP4/MXFP4) tensor-core peak, flop/s (0: no FP4 tensor cores, where
    serving runs 4-bit weights weight-only, W4A16 at the 16-bit rate)."""
    sustained_clock: float = 1.0
    """Clock the tensor cores sustain under the part's power limit, as a fraction of the clock
    the datasheet peaks assume (1: no throttling). MFU stays against the datasheet peak."""
    measured_efficiency: float = 1.0
    """``timing=measured``, training: the share of a measured kernel's throughput (the tables
    time one kernel in isolation: CUDA graphs, warm caches, the clock of a short run) the same
    GEMM or attention kernel sustains inside a training step (clock under the power draw of
    seconds of back-to-back kernels, caches and HBM shared with the kernels and collectives
    around it); 1: as measured. Serving iterations are short CUDA-graph launches like the
    tables' own and keep the measured times; the roofline's efficiencies are in-step figures
    already and do not use it."""
    hbm_bytes: float
    """Device memory capacity, bytes."""
    hbm_bandwidth_bytes_per_s: float
    memory_reserve_bytes: float = 0.0
    """Capacity not usable by the framework (CUDA context, allocator fragmentation), bytes."""
    gemm_efficiency: float = 0.8
    fp8_gemm_efficiency: float = 0.0
    """Large FP8 GEMMs' fraction of the FP8 peak (0: ``FP8_GEMM_RATIO`` x gemm_efficiency)."""
    fp8_step_efficiency: float = 1.0
    """Training: the share of ``fp8_gemm_efficiency`` (and of ``fp4_gemm_efficiency``) FP8
    GEMMs (per-tensor and MXFP8) and NVFP4 GEMMs reach inside a step where the presets take
    those efficiencies from the kernels measured in isolation (the part's power limit over
    seconds of back-to-back GEMMs, collectives sharing SMs and HBM, the recipe's bookkeeping,
    a training stack's slower kernels: MI300X's 0.316 of hipBLASLt's rate under ROCm's FP8
    training of 2024); 1: as the kernels run. Serving iterations are short CUDA-graph launches
    like the tables' own and keep 1 (fitted over the training corpus:
    ``stage_dse/validation/parameters.yaml``)."""
    fp4_gemm_efficiency: float = 0.0
    """Large FP4 GEMMs' fraction of the FP4 peak (0: ``FP4_GEMM_RATIO`` x gemm_efficiency)."""
    w4a16_moe_efficiency: float = 0.0
    """Large grouped expert GEMMs with 4-bit weights under 16-bit math (W4A16): their fraction
    of the 16-bit peak (0: ``gemm_efficiency``)."""
    gemm_half_dim: float = 128.0
    """Smallest GEMM dimension at which GEMM efficiency halves."""
    fp8_gemm_half_dim: float = 0.0
    """The same for FP8 GEMMs (0: ``gemm_half_dim``)."""
    fp4_gemm_half_dim: float = 0.0
    """The same for FP4 GEMMs (0: ``fp8_gemm_half_dim``)."""
    attention_efficiency: float = 0.6
    attention_half_dim: float = 0.0
    """Head dimension at which the softmax costs attention as much as its tensor-core work
    (module docstring; 0: no head-dimension term)."""
    fp8_attention_speedup: float = 1.0
    """Prefill attention on an FP8 KV cache over the 16-bit kernel, where an engine runs it in
    FP8 (``EngineSpec.fp8_context_attention``); 1: no faster (no FP8 attention kernels)."""
    memory_efficiency: float = 0.8
    kernel_launch_s: float = 0.0
    """Fixed cost added per kernel, seconds (launch gaps; 0 under CUDA graphs)."""
    host_op_s: float = 40e-6
    """Host seconds to issue one op eagerly: the framework's dispatch (PyTorch, Transformer
    Engine) and the CUDA kernel launch. A layer whose kernels run shorter than the host takes
    to issue them waits on the host (:func:`stage_dse.cost.kernel_time.host_launches`)."""
    overlap_slowdown: float = 0.0
    """Compute time lost per second of communication running beside it (the collective's
    kernels take SMs and HBM bandwidth); 0: communication overlaps for free."""
    gemm_floor_s: float = 0.0
    """Shortest time of any GEMM kernel, seconds (a tiny GEMM still takes this long)."""
    attention_floor_s: float = 0.0
    """Shortest time of a fused attention kernel, seconds."""
    elementwise_floor_s: float = 0.0
    """Shortest time of a streaming (element-wise, norm, quantize) kernel, seconds."""
    moe_layer_latency_s: float = 0.0
    """Latency of a routed-expert layer's kernel chain (routing, sorting tokens by expert,
    permutation, the grouped GEMMs' setup, un-permutation) beyond the floors of the kernels
    the model times, seconds: a fused MoE layer with a handful of tokens takes this much
    longer than its own kernels' floors (fits of measured fused-MoE tables:
    ``conf/hardware/``)."""
    host_bandwidth_bytes_per_s: float = 64e9
    """GPU-host link per GPU and direction, bytes/s, where activation offload copies (PCIe
    Gen5 x16 by default; NVLink-C2C on Grace superchips)."""
    rowwise_gemm_speed: float = 1.0
    """Row-wise-scaled FP8 GEMM kernel's throughput over the per-tensor-scaled one on this GPU
    (``fp8_recipe=rowwise``, :class:`~stage_dse.spec.training.Fp8Recipe`)."""
    mxfp8_gemm_speed: float = 0.0
    """MXFP8 block-scaled GEMM's throughput over the per-tensor FP8 one (0: no block-scaled
    tensor cores, ``fp8_recipe=mxfp8`` is refused)."""
    measured_gpu: str = ""
    """``timing=measured``: the table set of measured kernels (``a100_sxm``, ``h100_sxm``, ...;
    empty: :data:`stage_dse.kernels.tables.GPU_TABLES` by preset name; ``none``: no tables)."""

    def __post_init__(self) -> None:
        owner = "hardware"
        for f in (
            "peak_flops",
            "hbm_bytes",
            "hbm_bandwidth_bytes_per_s",
            "gemm_half_dim",
            "host_bandwidth_bytes_per_s",
        ):
            positive_number(owner, f, getattr(self, f))
        for f in (
            "gemm_efficiency",
            "attention_efficiency",
            "memory_efficiency",
            "sustained_clock",
            "measured_efficiency",
            "fp8_step_efficiency",
            "rowwise_gemm_speed",
        ):
            _fraction(owner, f, getattr(self, f))
        if not (
            isinstance(self.fp8_attention_speedup, int | float) and self.fp8_attention_speedup >= 1
        ):
            raise ConfigError(
                f"hardware.fp8_attention_speedup must be a number >= 1 (1: no FP8 attention), "
                f"got {self.fp8_attention_speedup!r}"
            )
        if not self.fp8_gemm_efficiency:
            object.__setattr__(
                self, "fp8_gemm_efficiency", round(FP8_GEMM_RATIO * self.gemm_efficiency, 4)
            )
        _fraction(owner, "fp8_gemm_efficiency", self.fp8_gemm_efficiency)
        non_negative_number(owner, "fp8_gemm_half_dim", self.fp8_gemm_half_dim)
        if not self.fp8_gemm_half_dim:
            object.__setattr__(self, "fp8_gemm_half_dim", float(self.gemm_half_dim))
        non_negative_number(owner, "fp4_gemm_half_dim", self.fp4_gemm_half_dim)
        if not self.fp4_gemm_half_dim:
            object.__setattr__(self, "fp4_gemm_half_dim", float(self.fp8_gemm_half_dim))
        if not self.fp4_gemm_efficiency:
            object.__setattr__(
                self, "fp4_gemm_efficiency", round(FP4_GEMM_RATIO * self.gemm_efficiency, 4)
            )
        _fraction(owner, "fp4_gemm_efficiency", self.fp4_gemm_efficiency)
        if not self.w4a16_moe_efficiency:
            object.__setattr__(self, "w4a16_moe_efficiency", self.gemm_efficiency)
        _fraction(owner, "w4a16_moe_efficiency", self.w4a16_moe_efficiency)
        for f in (
            "memory_reserve_bytes",
            "kernel_launch_s",
            "host_op_s",
            "overlap_slowdown",
            "peak_fp8_flops",
            "peak_fp4_flops",
            "gemm_floor_s",
            "attention_floor_s",
            "elementwise_floor_s",
            "moe_layer_latency_s",
            "attention_half_dim",
        ):
            non_negative_number(owner, f, getattr(self, f))
        if self.mxfp8_gemm_speed:
            _fraction(owner, "mxfp8_gemm_speed", self.mxfp8_gemm_speed)
        if self.overlap_slowdown >= 1:
            raise ConfigError(f"hardware.overlap_slowdown must be < 1, got {self.overlap_slowdown}")
        if self.memory_reserve_bytes >= self.hbm_bytes:
            raise ConfigError(
                f"hardware.memory_reserve_bytes({self.memory_reserve_bytes:.3g}) >= "
                f"hbm_bytes({self.hbm_bytes:.3g})"
            )

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes - self.memory_reserve_bytes

    def replace(self, **changes: object) -> HardwareSpec:
        return dataclasses.replace(self, **changes)

    def serving(self) -> HardwareSpec:
        """The part as a serving pass binds it: engine iterations are short CUDA-graph launches
        like the kernel tables' own, so FP8 GEMMs keep the tables' efficiency
        (``fp8_step_efficiency`` 1, a training step's share)."""
        return self.replace(fp8_step_efficiency=1.0)


def even_domain_share(num_gpus: int, domain_gpus: int) -> int:
    """GPUs a job of ``num_gpus`` holds in each scale-up domain when it fills the fewest
    domains evenly (0 when no even split exists, or when whole domains already hold it).

    A job larger than one domain but not a whole number of them runs on equal parts of the
    fewest domains that hold it: 256 GPUs on 72-GPU NVL72 racks as 4 x 64. Slurm's
    topology/block plugin places jobs so on NVL72 systems (a job's nodes allocated in
    equal-sized ``--segment`` groups, each inside one rack's NVLink block; Slurm
    topology.conf(5), CoreWeave SUNK "Topology/Block Scheduling" for GB200/GB300 NVL72)."""
    if num_gpus <= domain_gpus or num_gpus % domain_gpus == 0:
        return 0
    domains = -(-num_gpus // domain_gpus)
    return num_gpus // domains if num_gpus % domains == 0 else 0


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """GPUs grouped in scale-up domains (NVLink/NVSwitch nodes) joined by a scale-out network."""

    name: str
    num_gpus: int
    gpus_per_node: int
    """Size of one scale-up (NVLink) domain: 8 for DGX/HGX, 72 for an NVL72 rack."""
    intra_bandwidth_bytes_per_s: float
    """Scale-up bandwidth per GPU, one direction."""
    inter_bandwidth_bytes_per_s: float
    """Scale-out (NIC) bandwidth per GPU, one direction."""
    intra_latency_s: float = 3e-6
    """Per-step latency of a collective inside a domain (bandwidth protocol, NCCL Simple)."""
    inter_latency_s: float = 14e-6
    """Per-step latency of a collective across domains (bandwidth protocol)."""
    collective_base_latency_s: float = 0.0
    """Fixed cost of every collective on the bandwidth protocol (launch, synchronization)."""
    ll_intra_latency_s: float = 0.0
    """Per-step latency inside a domain of the low-latency protocol (NCCL LL: flag-carrying
    8-byte stores, half the bandwidth); 0: no such protocol."""
    ll_inter_latency_s: float = 0.0
    """Per-step latency across domains of the low-latency protocol."""
    ll_base_latency_s: float = 0.0
    """Fixed cost of a collective on the low-latency protocol."""
    oneshot_latency_s: float = 0.0
    """Latency of a one-shot all-reduce inside a domain (every GPU reads every peer's buffer
    over NVLink and reduces locally; TensorRT-LLM / vLLM custom all-reduce), seconds;
    0: no one-shot algorithm, rings only."""
    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.9
    pod_gpus: int = 0
    """GPUs under one non-blocking fabric; 0 means the whole cluster is non-blocking."""
    oversubscription: float = 1.0
    """Bandwidth divisor for groups that span more than one pod."""

    def __post_init__(self) -> None:
        owner = "cluster"
        positive_int(owner, "num_gpus", self.num_gpus, MAX_GPUS)
        positive_int(owner, "gpus_per_node", self.gpus_per_node, MAX_GPUS)
        for f in ("intra_bandwidth_bytes_per_s", "inter_bandwidth_bytes_per_s", "oversubscription"):
            positive_number(owner, f, getattr(self, f))
        for f in (
            "intra_latency_s",
            "inter_latency_s",
            "collective_base_latency_s",
            "oneshot_latency_s",
            "ll_intra_latency_s",
            "ll_inter_latency_s",
            "ll_base_latency_s",
        ):
            non_negative_number(owner, f, getattr(self, f))
        for f in ("intra_efficiency", "inter_efficiency"):
            _fraction(owner, f, getattr(self, f))
        if self.pod_gpus < 0:
            raise ConfigError(f"cluster.pod_gpus must be >= 0, got {self.pod_gpus}")
        if self.oversubscription < 1:
            raise ConfigError(f"cluster.oversubscription must be >= 1, got {self.oversubscription}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            even = even_domain_share(self.num_gpus, self.gpus_per_node)
            hint = (
                f"; to spread them evenly over {self.num_gpus // even} domains set "
                f"cluster.gpus_per_node={even}"
                if even
                else ""
            )
            raise ConfigError(
                f"cluster.gpus_per_node({self.gpus_per_node}) does not divide "
                f"cluster.num_gpus({self.num_gpus}){hint}"
            )

    def replace(self, **changes: object) -> ClusterSpec:
        return dataclasses.replace(self, **changes)
