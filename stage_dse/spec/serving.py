"""``ServingSpec``: an inference workload (prompt length, generated tokens, batch, dtypes).

A serving plan is a ``ParallelPlan`` with tensor and pipeline parallelism (a replica serves
independently, so dp = 1), or, for mixture-of-experts models, expert parallelism with attention
data-parallel over the expert-parallel ranks (dp = ep: each rank attends for its own batch, the
experts are split over them and tokens reach their experts by all-to-all, as SGLang and
DeepSeek's inference deploy it). :func:`serving_plan` builds one, :func:`validate_serving`
checks it against a model.

Number formats. Weights are ``bf16``/``fp16``, ``fp8`` or a 4-bit block-scaled format,
``nvfp4`` or ``mxfp4`` (sizes with their scales in :mod:`stage_dse.spec.training`); ``fp4``
means ``nvfp4``, the format of NVIDIA's FP4 checkpoints (TensorRT-LLM / ModelOpt "FP4").
What the linear layers' GEMMs then run in:

* ``fp8`` weights: FP8 GEMMs where the hardware has FP8 tensor cores (W8A8), else the weights
  are a storage format and GEMMs run in bf16;
* ``nvfp4``: W4A4 on the FP4 tensor cores, each GEMM quantizing its activation operand to
  NVFP4 first (TensorRT-LLM's FP4 recipe; vLLM / llm-compressor's W4A4 NVFP4 on Blackwell);
* ``mxfp4``: W4A8, MXFP4 weights times MXFP8 activations at the FP8 tensor-core rate, as
  TensorRT-LLM runs MXFP4 checkpoints on Blackwell (its GPT-OSS deployment guide: MXFP8
  activations, MXFP4 MoE weights on B200/GB200/B300/GB300).

Both run so on a GPU with FP4 tensor cores (``hardware.peak_fp4_flops`` > 0, Blackwell).
Elsewhere (Hopper, Ada, Ampere) 4-bit weights are weight-only (W4A16): stored at their 4.5 or
4.25 bits with the scales, dequantized inside the GEMM, the math on the 16-bit tensor cores at
the bf16 rate, as engines run them there (vLLM's MXFP4 MoE backends on SM90/SM80: FlashInfer's
MXFP4 x BF16, Triton's and Marlin's, all with bf16 activations,
``vllm/model_executor/layers/quantization/mxfp4.py``; Marlin's NVFP4 likewise). A serving
row states it: ``param_bytes`` below 1 with ``gemm_bytes`` 2 (:func:`weight_only`).
Activations between kernels are 16-bit under 4-bit weights (only the GEMMs' inputs are
quantized).

``int4`` (AWQ, GPTQ checkpoints) is weight-only on every GPU: 4-bit integers with a 16-bit
scale and a 4-bit zero per group of 128 (:data:`~stage_dse.spec.training.BYTES_PER_VALUE`),
dequantized inside the GEMM and multiplied on the 16-bit tensor cores, as engines run them
(vLLM's AWQ and GPTQ Marlin kernels: ``vllm/model_executor/layers/quantization/awq_marlin.py``,
``gptq_marlin.py``, bf16 or fp16 activations).

``expert_weights_dtype`` gives the routed experts of a mixture-of-experts model their own
format, the rest keeping ``weights_dtype``: gpt-oss checkpoints store the expert weights in
MXFP4 and attention, router and embeddings in bf16. The GEMMs run in the format of
``weights_dtype``, but on FP4 hardware the engine decides the experts' own
(``EngineSpec.mxfp4_moe_activations``: MXFP8 activations, W4A8 on the FP8 tensor cores, under
TensorRT-LLM and SGLang; bf16 under vLLM), carried by the ``expert_gemm_bytes`` column; on
other GPUs such experts are W4A16 beside the bf16 layers.

The KV cache is ``bf16``/``fp16`` or ``fp8``: a 4-bit cache (TensorRT-LLM's NVFP4 KV cache,
dequantized to FP8 for attention) is not modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum, divides, positive_int
from stage_dse.spec.model import ModelSpec
from stage_dse.spec.plan import ParallelPlan
from stage_dse.spec.training import DType, TrainingSpec

__all__ = [
    "FP4_ALIAS",
    "MOE_DISPATCHES",
    "MOE_ROUTINGS",
    "ROUTING_SKEW",
    "ServingSpec",
    "replicated_kv_heads",
    "serving_plan",
    "validate_serving",
    "weight_only",
]


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
    """``bf16``, ``fp16``, ``fp8``, ``nvfp4``, ``mxfp4`` (``fp4``: ``nvfp4``) or ``int4``."""
    kv_dtype: DType = DType.BF16
    expert_weights_dtype: DType | None = None
    """The routed experts' weights (mixture-of-experts models), in the same formats; None:
    ``weights_dtype``."""
    moe_routing: str = "power_law_1.01"
    """How a mixture-of-experts model's tokens spread over its experts: one of
    :data:`MOE_ROUTINGS`. Real routers load experts unevenly; the busiest expert sets a
    grouped kernel's time (the measured tables' spread, the roofline's :data:`ROUTING_SKEW`)."""
    moe_dispatch: str = "allgather"
    """How expert-parallel attention ranks exchange tokens: one of :data:`MOE_DISPATCHES`."""

    def __post_init__(self) -> None:
        owner = "serving"
        for f in ("prompt_len", "output_tokens", "batch_size"):
            positive_int(owner, f, getattr(self, f))
        for f in ("weights_dtype", "kv_dtype", "expert_weights_dtype"):
            value = getattr(self, f)
            if value is None and f == "expert_weights_dtype":
                continue
            value = FP4_ALIAS if isinstance(value, str) and value.lower() == "fp4" else value
            object.__setattr__(self, f, coerce_enum(DType, owner, f, value))
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ConfigError(
                f"serving.moe_dispatch={self.moe_dispatch!r} is not one of: "
                + ", ".join(MOE_DISPATCHES)
            )
        if self.moe_routing not in MOE_ROUTINGS:
            raise ConfigError(
                f"serving.moe_routing={self.moe_routing!r} is not one of: "
                + ", ".join(MOE_ROUTINGS)
            )
        if self.kv_dtype.is_4bit:
            raise ConfigError(
                f"serving.kv_dtype={self.kv_dtype.value}: a 4-bit KV cache is not modelled; "
                "use fp8 or bf16"
            )

    @property
    def experts_dtype(self) -> DType:
        """The routed experts' weight format."""
        return self.expert_weights_dtype or self.weights_dtype

    @property
    def decode_context(self) -> float:
        return self.prompt_len + self.output_tokens / 2

    def replace(self, **changes: object) -> ServingSpec:
        return dataclasses.replace(self, **changes)

    def step_like(self, hardware=None, replicas: int = 1) -> TrainingSpec:
        """The training-step view of a serving pass that symbols are bound from: the prompt as
        the sequence, the batch of every attention replica as the global batch, the weights'
        dtype for parameters, and the GEMM format the weights run in on ``hardware`` (module
        doc): FP8 when the weights are FP8 or MXFP4 (W4A8) and the hardware has FP8 tensor
        cores (elsewhere FP8 weights are a storage format and GEMMs run in bf16), NVFP4 for
        NVFP4 weights; 4-bit weights on ``hardware`` without FP4 tensor cores run weight-only,
        the GEMMs in bf16 (:func:`weight_only`). Without ``hardware``, as on FP4 hardware."""
        w = self.weights_dtype
        fp4_cores = hardware is None or hardware.peak_fp4_flops > 0
        if w is DType.NVFP4 and fp4_cores:
            gemm = DType.NVFP4
        elif (w is DType.MXFP4 and fp4_cores) or (
            w is DType.FP8 and hardware is not None and hardware.peak_fp8_flops > 0
        ):
            gemm = DType.FP8
        else:
            gemm = DType.BF16
        return TrainingSpec(
            seq_len=self.prompt_len,
            global_batch_size=self.batch_size * replicas,
            params_dtype=self.weights_dtype,
            gemm_dtype=gemm,
            serving_view=True,
        )


MOE_ROUTINGS = ("balanced", "power_law_1.01", "power_law_1.2")
"""Token spreads over experts that measured MoE kernels are collected under
(:mod:`stage_dse.kernels.tables`): even, or expert loads following a power law of exponent
1.01 or 1.2."""

ROUTING_SKEW = {"balanced": 0.0, "power_law_1.01": 0.238, "power_law_1.2": 0.379}
"""How much more routed work the busiest expert-parallel rank gets under each spread: its
rows are ``1 + a ln(ep)`` times the mean (the largest of ``ep`` rank loads whose tail falls
off exponentially grows with ``ln ep``; 0 on one GPU, where the grouped GEMM runs every
expert's rows in one launch). ``a`` is fitted to the busiest rank's cost in NVIDIA
AIConfigurator's measured fused-MoE tables (aiconfigurator-core 0.12.0, TensorRT-LLM
collections on A100 to GB300, every expert format): the time under each power law over the
balanced time of the same layout, 12,544 layouts with ep 2-256 and at least 256 routed rows
per expert (compute-bound), in log space: 0.238 and 0.379 (mean |ln error| 0.52 -> 0.24 and
0.70 -> 0.28)."""

MOE_DISPATCHES = ("allgather", "alltoall")
"""How an engine moves tokens between expert-parallel attention ranks. ``allgather``: every
rank gathers all ranks' tokens, runs its experts on them and reduce-scatters the outputs, each
token crossing to every other rank once; the default of engines without an all-to-all kernel
(TensorRT-LLM's ``AllGatherReduceScatter``, its fallback where no NVLink all-to-all or DeepEP
is available, ``tensorrt_llm/_torch/modules/fused_moe/communication/communication_factory.py``;
vLLM's default all2all backend, ``VLLM_ALL2ALL_BACKEND=allgather_reducescatter`` in
``vllm/envs.py``; SGLang's data-parallel attention gather).
``alltoall``: a token goes once to each rank holding any of its experts (DeepEP's dispatch,
TensorRT-LLM's NVLink all-to-all on multi-node NVLink)."""

FP4_ALIAS = DType.NVFP4
"""What ``fp4`` means: NVFP4, the format of NVIDIA's FP4 checkpoints (ModelOpt, TensorRT-LLM)."""


def weight_only(serving: ServingSpec, hardware) -> bool:
    """Some weights are a storage format only on ``hardware``, their GEMMs running on the
    16-bit tensor cores: 4-bit weights (or experts) without FP4 tensor cores (W4A16), FP8
    weights without FP8 ones (W8A16)."""
    formats = {serving.weights_dtype, serving.experts_dtype}
    no_fp4 = hardware.peak_fp4_flops <= 0 and any(d.is_fp4 for d in formats)
    return (
        no_fp4 or DType.INT4 in formats or (DType.FP8 in formats and hardware.peak_fp8_flops <= 0)
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


def replicated_kv_heads(model: ModelSpec, tp: int) -> ModelSpec:
    """The model as ``tp`` ranks serve it when ``tp`` exceeds its KV heads: each rank holds a
    copy of the KV head its query heads read (vLLM's ``num_kv_head_replicas = tp /
    num_kv_heads``, TensorRT-LLM likewise), so every per-GPU cost (KV projection weights,
    KV cache, attention) is that of a model with ``tp`` KV heads, one per rank. Parameter
    counts of the returned model include the copies. Unchanged when ``tp`` divides the KV
    heads, is not a multiple of them, or the model caches a latent (MLA)."""
    kv = model.num_kv_heads
    if tp <= kv or tp % kv or model.num_heads % tp or model.is_mla:
        return model
    return dataclasses.replace(model, num_kv_heads=tp)


def validate_serving(model: ModelSpec, serving: ServingSpec, plan: ParallelPlan) -> None:
    if serving.expert_weights_dtype is not None and not model.is_moe:
        raise ConfigError(
            f"serving.expert_weights_dtype={serving.expert_weights_dtype.value} needs a "
            f"mixture-of-experts model; {model.name} has no experts (use weights_dtype)"
        )
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
        raise ConfigError(
            f"tp({plan.tp}) is neither a divisor nor a multiple of kv_heads({model.num_kv_heads})"
            if plan.tp % model.num_kv_heads
            else f"tp({plan.tp}) does not divide kv_heads({model.num_kv_heads}) (serve the model "
            "through replicated_kv_heads)"
        )
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
