"""``FrameworkSpec``: what a training framework does with a plan, apart from the plan itself.

The same parallel plan runs differently under Megatron-Core, torchtitan's FSDP2 or DeepSpeed:
which collectives overlap which compute, whether a module's parameters move one tensor at a
time, in which precision gradients are accumulated and reduced. Those are properties of the
framework (profiles in ``conf/framework/``, each citing where its behaviour is documented),
not choices a user makes per plan, so a sweep ranges over frameworks as one axis and every
result row names the framework it was evaluated under.

What lives here: the profile dataclass and its validation. What does not: the profiles
themselves (YAML, read by :mod:`stage_dse.config.presets`), any cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum
from stage_dse.spec.plan import AttentionKernel
from stage_dse.spec.training import DType, TrainingSpec

__all__ = ["GRAD_DTYPES", "PLAN_FLAGS", "FrameworkSpec"]

PLAN_FLAGS = (
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_dgrad_overlap",
    "tp_comm_overlap",
    "ep_comm_overlap",
    "zero_sync_per_tensor",
    "grad_sync_per_step",
    "ep_dispatch_dedup",
    "expert_gemm_loop",
    "fsdp_master_shards",
    "fused_elementwise",
    "fused_activation",
    "fused_projections",
    "moe_weighted_activation",
)
"""The :class:`~stage_dse.spec.plan.ParallelPlan` flags a framework decides."""

GRAD_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


@dataclass(frozen=True, kw_only=True)
class FrameworkSpec:
    """A training framework's behaviours. The defaults (``default``) overlap as Megatron-Core
    does (distributed optimizer with overlapped gradient reduce-scatter and parameter
    all-gather, asynchronous backward tensor-parallel reductions, no userbuffer GEMM overlap)
    and leave the gradient precision to the training step; the ``megatron_core`` profile adds
    Megatron-LM's fp32 gradients."""

    name: str = "default"
    attention: AttentionKernel = AttentionKernel.FLASH
    """The attention kernel the framework runs (the corpus's default for its records; sweeps
    take the kernel from ``plan.attention``)."""
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_dgrad_overlap: bool = True
    tp_comm_overlap: bool = False
    ep_comm_overlap: bool = False
    zero_sync_per_tensor: bool = False
    ep_dispatch_dedup: bool = False
    """Expert-parallel dispatch sends a token once to each node that holds one of its experts
    and forwards it over NVLink; combine sums inside the node first (DeepEP); off, every
    (token, expert) copy crosses the network (NCCL all-to-all)."""
    expert_gemm_loop: bool = False
    """A grouped expert GEMM is issued one GEMM per local expert: Transformer Engine's
    ``GroupedLinear`` (Megatron-Core's ``--moe-grouped-gemm`` with TE) loops over the experts
    calling cuBLAS on several streams (``general_grouped_gemm``); off, one grouped kernel
    (torchtitan's ``torch._grouped_mm``, the CUTLASS grouped GEMM)."""
    fsdp_master_shards: bool = False
    """Under ZeRO-3 each parameter shard is stored once, in the optimizer's master precision,
    and cast to the 16-bit compute precision as it is gathered: PyTorch FSDP's mixed precision
    keeps the sharded parameters in their original fp32 ("The sharded parameters are kept in
    their original dtype", ``MixedPrecisionPolicy.param_dtype`` of FSDP2; FSDP1's
    ``MixedPrecision`` likewise casts a low-precision shard only for the all-gather), so they
    are the master weights; off, a 16-bit shard is kept beside the optimizer's fp32 master
    (DeepSpeed ZeRO-3, Megatron-FSDP)."""
    fused_elementwise: bool = True
    """Element-wise ops run as fused kernels (Megatron-Core's Transformer Engine and Apex
    kernels, ``torch.compile``); off, eagerly (:mod:`stage_dse.graph.eager`)."""
    fused_activation: bool = True
    """With ``fused_elementwise``, a gated MLP's activation runs fused too (Megatron-Core's
    ``bias_swiglu_impl``, Transformer Engine, ``torch.compile``); off, it alone runs eagerly, a
    SiLU kernel and a product kernel over the split projection output while norms and rotary
    embedding keep their fused kernels (nanotron e24d2483a4, ``models/llama.py``:
    ``GLUActivation`` returns ``self.act(gate_states) * up_states`` beside ``TritonRMSNorm`` and
    flash-attn's rotary kernel)."""
    fused_projections: bool = True
    """The query, key and value projections run as one GEMM, and so do a gated MLP's gate and
    up projections (Megatron-Core's ``linear_qkv`` in ``transformer/attention.py`` and
    ``linear_fc1`` of twice the FFN width in ``transformer/mlp.py`` and ``moe/experts.py``;
    nanotron's ``qkv_proj`` and ``gate_up_proj``); off, one GEMM each (torchtitan's ``wq``,
    ``wk``, ``wv``, ``w1``, ``w3``; Hugging Face models' ``q_proj``, ``k_proj``, ``v_proj``,
    ``gate_proj``, ``up_proj``)."""
    moe_weighted_activation: bool = False
    """The routing probabilities scale the experts' activation output (a weighted SwiGLU) and
    the combine sums the experts' outputs unweighted, so those outputs are not kept for
    backward (Megatron-Core since NVIDIA/Megatron-LM 2659630721, 2025-04, "Memory efficient
    token permutation": ``weighted_bias_swiglu_impl`` in ``TEGroupedMLP``); off, the combine
    weights them and keeps them to differentiate the probabilities."""
    compile_fuses_elementwise: bool = False
    """The framework's element-wise kernels come from ``torch.compile`` (torchtitan compiles each
    transformer block when ``training.compile`` is set): a run without it executes them
    eagerly. False for frameworks with hand-fused kernels, which fuse with or without it."""
    grad_sync_per_step: bool = False
    """ZeRO-2 gradients accumulate unsharded over a step's micro-batches and are
    reduce-scattered once (PyTorch FSDP's ``no_sync`` / FSDP2's
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch); off, every
    micro-batch reduce-scatters them (DeepSpeed ZeRO-2)."""
    block_recompute: bool = False
    """Full recompute can cover part of a model chunk's layers: Megatron-LM's block method
    (``--activations-checkpoint-method block`` since NVIDIA/Megatron-LM c1e0689d92, 2021-08,
    ``--recompute-method block --recompute-num-layers N`` since 2022; Megatron-Core, NeMo and
    Megatron-Bridge keep it), which recomputes the first ``N`` layers of each chunk and
    stores the others' activations.
    A run whose recompute is unstated is then also tried with block recompute of a quarter,
    half or three quarters of each chunk (the fastest plan that fits wins); off, full
    recompute covers every layer (DeepSpeed's and torch's checkpointing of every block)."""
    grads_dtype: DType | None = None
    """Precision of the gradient buffers and of their data-parallel reduction when the framework
    fixes it (Composer's FSDP ``DEFAULT`` mixed precision and torchtitan's FSDP2 reduce in fp32);
    None: the training step's ``grads_dtype``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"framework.name must be a non-empty text, got {self.name!r}")
        for flag in (*PLAN_FLAGS, "compile_fuses_elementwise", "block_recompute"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    f"framework.{flag} must be true or false, got {getattr(self, flag)!r}"
                )
        object.__setattr__(
            self,
            "attention",
            coerce_enum(AttentionKernel, "framework", "attention", self.attention),
        )
        if self.grads_dtype is not None:
            dtype = coerce_enum(DType, "framework", "grads_dtype", self.grads_dtype)
            if dtype not in GRAD_DTYPES:
                raise ConfigError(
                    f"framework.grads_dtype={dtype.value} is not one of: "
                    + ", ".join(d.value for d in GRAD_DTYPES)
                )
            object.__setattr__(self, "grads_dtype", dtype)

    def plan_flags(self) -> dict[str, bool]:
        """The plan fields this framework sets (:data:`PLAN_FLAGS`)."""
        return {flag: getattr(self, flag) for flag in PLAN_FLAGS}

    def with_flags(self, **flags: bool | None) -> FrameworkSpec:
        """This framework with some plan flags forced (None leaves a flag as it is); the name
        records what was changed (``megatron_core[tp_comm_overlap=true]``)."""
        unknown = sorted(set(flags) - set(PLAN_FLAGS))
        if unknown:
            raise ConfigError(
                f"framework.{unknown[0]} is not a plan flag a framework sets "
                f"({', '.join(PLAN_FLAGS)})"
            )
        changed = {k: v for k, v in flags.items() if v is not None and getattr(self, k) != v}
        if not changed:
            return self
        label = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(changed.items()))
        return dataclasses.replace(self, name=f"{self.name}[{label}]", **changed)

    def grads(self, training_grads: DType) -> DType:
        """The gradient dtype of a step under this framework."""
        return training_grads if self.grads_dtype is None else self.grads_dtype

    def step(self, training: TrainingSpec) -> TrainingSpec:
        """``training`` as this framework runs it (its gradient precision)."""
        return dataclasses.replace(training, grads_dtype=self.grads(training.grads_dtype))
