"""``TrainingSpec``: what one optimizer step processes and in which number formats.

Byte sizes follow the mixed-precision Adam convention of Rajbhandari et al. (ZeRO, SC20, sec. 3.1):
16-bit parameters and gradients, fp32 master weights and two fp32 Adam moments.

The 4-bit block-scaled formats are weight formats of serving (:class:`ServingSpec`); ``nvfp4``
is a training GEMM format too (``gemm_dtype``). Their sizes count the block scales:

* ``nvfp4`` (NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference",
  2025): 4-bit E2M1 values, one FP8 E4M3 scale per block of 16 values (and one FP32 scale per
  tensor, negligible): 4 + 8/16 = 4.5 bits, 0.5625 bytes per value;
* ``mxfp4`` (OCP Microscaling Formats (MX) Specification v1.0, 2023, sec. 5: MXFP4): 4-bit
  E2M1 values, one E8M0 (power-of-two) scale per block of 32: 4 + 8/32 = 4.25 bits, 0.53125
  bytes per value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum, positive_int

__all__ = ["DType", "Fp8Recipe", "Optimizer", "TrainingSpec", "check_gemm_dtype"]


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    INT4 = "int4"

    @property
    def bytes(self) -> float:
        """Bytes per value, block scales included (0.5625 for NVFP4, 0.53125 for MXFP4)."""
        return BYTES_PER_VALUE[self.value]

    @property
    def is_fp4(self) -> bool:
        """A 4-bit block-scaled format (NVFP4, MXFP4)."""
        return self.value in ("nvfp4", "mxfp4")

    @property
    def is_4bit(self) -> bool:
        """Any 4-bit weight format: NVFP4, MXFP4 or INT4 (a serving weight format only)."""
        return self.is_fp4 or self is DType.INT4


BYTES_PER_VALUE = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "nvfp4": (4 + 8 / 16) / 8,
    "mxfp4": (4 + 8 / 32) / 8,
    "int4": (4 + (16 + 4) / 128) / 8,
}
"""Bytes per value of each format: element bits plus the block scale's share, over 8. INT4 is
the 4-bit integer weights of AWQ and GPTQ checkpoints: a 16-bit scale and a 4-bit zero point
per group of 128 values along the input dimension (AutoAWQ's and GPTQ's default
``group_size: 128``, the zeros packed eight to an int32 ``qzeros``)."""


class Optimizer(StrEnum):
    ADAM = "adam"
    """Adam/AdamW: two fp32 moments per parameter."""
    SGD_MOMENTUM = "sgd_momentum"
    """SGD with momentum: one fp32 state per parameter."""

    @property
    def states_per_param(self) -> int:
        return {"adam": 2, "sgd_momentum": 1}[self.value]


class Fp8Recipe(StrEnum):
    """How FP8 GEMM inputs are scaled (only with ``gemm_dtype=fp8``).

    * ``tensorwise``: one scale per tensor (Transformer Engine's delayed and current scaling,
      torchao's ``tensorwise``); the GEMMs are cuBLAS's per-tensor-scaled kernels and the
      weight gradient reuses the FP8 copies made for the forward and input-gradient GEMMs.
    * ``rowwise``: one scale per row of each operand (torchao ``rowwise``). The forward GEMM
      is PyTorch's CUTLASS row-wise kernel (fast accumulation), at ``rowwise_gemm_speed`` of
      the per-tensor kernel on the same GPU ("most shapes within 90-100% of tensor-wise
      efficiency, ... a long tail going down to 50%", pytorch/pytorch#147971). The backward
      GEMMs accumulate in full precision, which torchao runs as the per-tensor cuBLAS kernel
      followed by a rescale kernel over the output ("The rowwise CUTLASS-based kernel is so
      slow without fast-accum that we'd rather use the tensorwise cuBLAS-based kernel and do
      the scaling manually afterwards", ``torchao/float8/float8_ops.py``, pytorch/ao#1377,
      2024-12; one extra kernel per GEMM, pytorch/ao#2184). Scales run along the token axis in
      the weight gradient, so its operands are quantized again from the 16-bit tensors, which
      are kept for backward instead of FP8 copies; the input gradient re-quantizes the weight
      along its other axis.
    * ``rowwise_gw_hp``: as ``rowwise`` with the weight-gradient GEMM in 16-bit (torchao
      ``rowwise_with_gw_hp``).
    * ``mxfp8``: OCP MX block scaling, one E8M0 scale per 32 values (Transformer Engine
      ``MXFP8BlockScaling``, torchao ``mxfp8``), on tensor cores with block-scaled MMA
      (Blackwell) at ``mxfp8_gemm_speed`` of the per-tensor kernel; each quantize kernel
      writes a row-wise and a column-wise copy (blocks run along the reduction axis of the
      GEMM that consumes them); backward keeps the column-wise one.
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_GW_HP = "rowwise_gw_hp"
    MXFP8 = "mxfp8"

    @property
    def rowwise(self) -> bool:
        return self in (Fp8Recipe.ROWWISE, Fp8Recipe.ROWWISE_GW_HP)


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """One training step: ``global_batch_size`` sequences of ``seq_len`` tokens."""

    seq_len: int
    """Tokens per sequence s."""
    global_batch_size: int
    """Sequences per optimizer step B (summed over data-parallel ranks and micro-batches)."""
    params_dtype: DType = DType.BF16
    """Working copy of weights and the activations."""
    grads_dtype: DType = DType.BF16
    """Gradient buffers (ZeRO's 2-byte convention; set fp32 for Megatron-style fp32 main grads)."""
    master_dtype: DType = DType.FP32
    """Optimizer's master copy of the weights."""
    optimizer: Optimizer = Optimizer.ADAM
    optimizer_state_dtype: DType = DType.FP32
    gemm_dtype: DType = DType.BF16
    """Inputs of the linear layers' GEMMs (forward, input and weight gradients). ``fp8`` runs
    them on FP8 tensor cores and caches the activations they keep for backward in FP8
    (Transformer Engine; DeepSeek-V3 technical report sec. 3.3); attention stays 16-bit.
    ``nvfp4`` runs them on FP4 tensor cores with NVFP4 block scaling as Transformer Engine's
    ``NVFP4BlockScaling`` recipe does for training (NVIDIA, "Pretraining Large Language Models
    with NVFP4", arXiv 2509.25149, sec. 4: 16-value blocks with E4M3 scales, 16x16 blocks for
    weights, random Hadamard transforms on the weight gradient's inputs, stochastic rounding of
    gradients): like MXFP8, each quantize kernel writes a row-wise and a column-wise copy and
    backward keeps the column-wise one; the Hadamard transform and the rounding run inside the
    quantize kernels, which stay memory-bound. Every linear layer runs in NVFP4 (recipes that
    keep a few layers in 16-bit for stability are not told apart)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    """How FP8 GEMM inputs are scaled (:class:`Fp8Recipe`); only ``tensorwise`` with 16-bit
    GEMMs."""
    serving_view: bool = False
    """The step a serving pass binds its symbols from (:meth:`ServingSpec.step_like`): forward
    only, so weights and GEMMs may take the 4-bit formats; a training step may not."""

    def __post_init__(self) -> None:
        owner = "training"
        gemm_formats = ("bf16", "fp16", "fp8", "nvfp4")
        if str(self.gemm_dtype) not in gemm_formats:
            raise ConfigError(
                f"training.gemm_dtype={str(self.gemm_dtype)!r} is not one of: "
                + ", ".join(gemm_formats)
            )
        positive_int(owner, "seq_len", self.seq_len)
        positive_int(owner, "global_batch_size", self.global_batch_size)
        for field in (
            "params_dtype",
            "grads_dtype",
            "master_dtype",
            "optimizer_state_dtype",
            "gemm_dtype",
        ):
            object.__setattr__(self, field, coerce_enum(DType, owner, field, getattr(self, field)))
        object.__setattr__(
            self, "optimizer", coerce_enum(Optimizer, owner, "optimizer", self.optimizer)
        )
        object.__setattr__(
            self, "fp8_recipe", coerce_enum(Fp8Recipe, owner, "fp8_recipe", self.fp8_recipe)
        )
        if self.fp8_recipe is not Fp8Recipe.TENSORWISE and not self.fp8_gemms:
            raise ConfigError(
                f"training.fp8_recipe={self.fp8_recipe.value} scales FP8 GEMMs, but "
                f"gemm_dtype={self.gemm_dtype.value}: set gemm_dtype=fp8 or fp8_recipe=tensorwise"
            )
        if not self.serving_view:
            for field in ("params_dtype", "grads_dtype", "master_dtype", "optimizer_state_dtype"):
                value = getattr(self, field)
                if value.is_4bit:
                    raise ConfigError(
                        f"training.{field}={value.value} is a serving weight format (4-bit): "
                        "use bf16 or fp8 for training"
                    )

    @property
    def fp8_gemms(self) -> bool:
        return self.gemm_dtype is DType.FP8

    @property
    def block_scaled(self) -> bool:
        """GEMM inputs quantized in blocks along each operand's reduction axis (MXFP8, or NVFP4
        in a training step): every quantize kernel writes a column-wise copy beside the
        row-wise one."""
        return self.fp8_recipe is Fp8Recipe.MXFP8 or (
            self.gemm_dtype is DType.NVFP4 and not self.serving_view
        )

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Master weights plus optimizer states, bytes per parameter (12 for fp32 Adam)."""
        return (
            self.master_dtype.bytes
            + self.optimizer.states_per_param * self.optimizer_state_dtype.bytes
        )

    def replace(self, **changes: object) -> TrainingSpec:
        return dataclasses.replace(self, **changes)


def check_gemm_dtype(training: TrainingSpec, hardware) -> None:
    """FP8 GEMMs need FP8 tensor cores (``hardware.peak_fp8_flops`` > 0), FP4 GEMMs FP4 ones."""
    if training.gemm_dtype.is_fp4 and hardware.peak_fp4_flops <= 0:
        raise ConfigError(
            f"training.gemm_dtype={training.gemm_dtype.value} needs FP4 tensor cores; hardware "
            f"{hardware.name} has none (peak_fp4_tflops unset): use fp8"
        )
    if training.fp8_gemms and hardware.peak_fp8_flops <= 0:
        raise ConfigError(
            f"training.gemm_dtype=fp8 needs FP8 tensor cores; hardware {hardware.name} has none "
            "(its peak_fp8_tflops is 0): use gemm_dtype=bf16 or other hardware"
        )
    if training.fp8_recipe is Fp8Recipe.MXFP8 and hardware.mxfp8_gemm_speed <= 0:
        raise ConfigError(
            f"training.fp8_recipe=mxfp8 needs block-scaled (MX) tensor cores; hardware "
            f"{hardware.name} has none (its mxfp8_gemm_speed is 0): use fp8_recipe=tensorwise "
            "or rowwise"
        )
