"""``ServingSpec``: an inference workload (prompt length, generated tokens, batch, dtypes).

A serving plan is a ``ParallelPlan`` with tensor and pipeline parallelism (a replica serves
independently, so dp = 1), or, for mixture-of-experts models, expert parallelism with attention
data-parallel over the expert-parallel ranks (dp = ep: each rank attends for its own batch, the
experts are split over them and tokens reach their experts by all-to-all, as SGLang and
DeepSeek's inference deploy it). :func:`serving_plan` builds one, :func:`validate_serving`
checks it against a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum, divides, positive_int
from stage_dse.spec.model import ModelSpec
from stage_dse.spec.plan import ParallelPlan
from stage_dse.spec.training import DType, TrainingSpec

__all__ = ["ServingSpec", "serving_plan", "validate_serving"]


@dataclass(frozen=True, kw_only=True)
class ServingSpec:
    prompt_len: int
    """Prompt tokens per sequence (prefill length)."""
    output_tokens: int = 256
    """Tokens generated per sequence; decode is costed at the mean context length
    ``prompt_len + output_tokens / 2``."""
    batch_size: int = 1
    """Sequences decoded together per pipeline stage; with pp stages, pp such batches are in
    flight (each stage works on one), so the KV cache holds pp x batch_size sequences."""
    weights_dtype: DType = DType.BF16
    kv_dtype: DType = DType.BF16

    def __post_init__(self) -> None:
        owner = "serving"
        for f in ("prompt_len", "output_tokens", "batch_size"):
            positive_int(owner, f, getattr(self, f))
        for f in ("weights_dtype", "kv_dtype"):
            object.__setattr__(self, f, coerce_enum(DType, owner, f, getattr(self, f)))

    @property
    def decode_context(self) -> float:
        return self.prompt_len + self.output_tokens / 2

    def replace(self, **changes: object) -> ServingSpec:
        return dataclasses.replace(self, **changes)

    def step_like(self, hardware=None, replicas: int = 1) -> TrainingSpec:
        """The training-step view of a serving pass that symbols are bound from: the prompt as
        the sequence, the batch of every attention replica as the global batch, the weights'
        dtype for parameters, and FP8 GEMMs when the weights are FP8 and ``hardware`` has FP8
        tensor cores (elsewhere FP8 weights are a storage format and GEMMs run in bf16)."""
        fp8 = (
            self.weights_dtype is DType.FP8 and hardware is not None and hardware.peak_fp8_flops > 0
        )
        return TrainingSpec(
            seq_len=self.prompt_len,
            global_batch_size=self.batch_size * replicas,
            params_dtype=self.weights_dtype,
            gemm_dtype=DType.FP8 if fp8 else DType.BF16,
        )


def serving_plan(model: ModelSpec, tp: int, pp: int, batch_size: int, ep: int = 1) -> ParallelPlan:
    """The plan of a serving replica: experts split over tensor-parallel ranks when tp > 1
    (expert tensor parallelism), and over ``ep`` data-parallel attention ranks."""
    return ParallelPlan(
        dp=ep,
        tp=tp,
        pp=pp,
        ep=ep,
        micro_batch_size=batch_size,
        expert_tensor_parallel=model.is_moe and tp > 1,
    )


def validate_serving(model: ModelSpec, serving: ServingSpec, plan: ParallelPlan) -> None:
    if plan.cp != 1 or plan.dp != plan.ep:
        raise ConfigError(
            f"serving plans use tp, pp and ep (attention data-parallel over the ep ranks, dp = "
            f"ep); got dp({plan.dp}) ep({plan.ep}) cp({plan.cp}) (independent replicas: count "
            "them as more GPUs)"
        )
    if plan.ep > 1:
        if not model.is_moe:
            raise ConfigError(
                f"ep({plan.ep}) > 1 needs a mixture-of-experts model; {model.name} is dense"
            )
        divides("ep", plan.ep, "experts", model.num_experts)
    divides("tp", plan.tp, "heads", model.num_heads)
    if model.num_kv_heads % plan.tp:
        raise ConfigError(f"tp({plan.tp}) does not divide kv_heads({model.num_kv_heads})")
    divides("tp", plan.tp, "vocab", model.vocab_size)
    divides("tp", plan.tp, "ffn_hidden_size", model.ffn_hidden_size)
    if plan.pp > model.num_layers:
        raise ConfigError(f"pp({plan.pp}) > layers({model.num_layers})")
    if model.is_moe and plan.tp > 1 and not plan.expert_tensor_parallel:
        raise ConfigError(
            f"serving a mixture-of-experts model on tp({plan.tp}) needs expert_tensor_parallel"
        )
    if plan.sequence_parallel or plan.schedule.value != "1f1b":
        raise ConfigError("serving plans take no sequence parallelism or interleaving")
