"""``TrainingSpec``: what one optimizer step processes and in which number formats.

Byte sizes follow the mixed-precision Adam convention of Rajbhandari et al. (ZeRO, SC20, sec. 3.1):
16-bit parameters and gradients, fp32 master weights and two fp32 Adam moments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum, positive_int

__all__ = ["DType", "Optimizer", "TrainingSpec", "check_gemm_dtype"]


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def bytes(self) -> int:
        return {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[self.value]


class Optimizer(StrEnum):
    ADAM = "adam"
    """Adam/AdamW: two fp32 moments per parameter."""
    SGD_MOMENTUM = "sgd_momentum"
    """SGD with momentum: one fp32 state per parameter."""

    @property
    def states_per_param(self) -> int:
        return {"adam": 2, "sgd_momentum": 1}[self.value]


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
    (Transformer Engine; DeepSeek-V3 technical report sec. 3.3); attention stays 16-bit."""

    def __post_init__(self) -> None:
        owner = "training"
        if str(self.gemm_dtype) not in ("bf16", "fp16", "fp8"):
            raise ConfigError(
                f"training.gemm_dtype={str(self.gemm_dtype)!r} is not one of: bf16, fp16, fp8"
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

    @property
    def fp8_gemms(self) -> bool:
        return self.gemm_dtype is DType.FP8

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
    """FP8 GEMMs need FP8 tensor cores (``hardware.peak_fp8_flops`` > 0)."""
    if training.fp8_gemms and hardware.peak_fp8_flops <= 0:
        raise ConfigError(
            f"training.gemm_dtype=fp8 needs FP8 tensor cores; hardware {hardware.name} has none "
            "(its peak_fp8_tflops is 0): use gemm_dtype=bf16 or other hardware"
        )
