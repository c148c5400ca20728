"""``ParallelPlan``: how one model is split over GPUs, and the cross-checks against a model.

What lives here: the plan dataclass, its enums (recompute and CUDA-graph choices come from
:mod:`stage_dse.spec.execution`), the mesh axes, and :func:`validate_plan`, which checks a plan
against a model, a training step and a GPU count with messages that name the violated relation.
What does not: any cost.

Rank order follows Megatron-LM's convention: the first axis of ``rank_order`` varies fastest
over global ranks, so the default ``tp-cp-ep-dp-pp`` keeps a tensor-parallel group on adjacent
ranks (one NVLink domain) and strides pipeline stages furthest apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import (
    MAX_GPUS,
    coerce_enum,
    divides,
    non_negative_int,
    positive_int,
)
from stage_dse.spec.execution import (
    CUDA_GRAPH_MODULES,
    RECOMPUTE_MODULES,
    Recompute,
    RecomputeChoice,
    cuda_graphs_label,
    parse_cuda_graphs,
    parse_recompute,
)
from stage_dse.spec.model import ModelSpec
from stage_dse.spec.stages import normalize_stage_layers, virtual_stage_layers
from stage_dse.spec.training import TrainingSpec

__all__ = [
    "CUDA_GRAPH_MODULES",
    "DATA_PARALLEL_AXES",
    "RECOMPUTE_MODULES",
    "AttentionKernel",
    "MeshAxis",
    "ParallelPlan",
    "PipelineSchedule",
    "Recompute",
    "RecomputeChoice",
    "mesh_order",
    "parse_recompute",
    "validate_plan",
]


class MeshAxis(StrEnum):
    """Axes of the device mesh. Their product (ep excluded: it reuses dp ranks) is the GPU count."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    DS = "ds"
    """Under hybrid sharding (``plan.dp_replicate > 1``), the DP axis splits in two: DS, the
    ``dp / dp_replicate`` ranks of one sharding group (outside EP), and DR, its
    ``dp_replicate`` replicas. Neither is named in ``rank_order``: they take DP's place."""
    DR = "dr"
    PP = "pp"


DATA_PARALLEL_AXES = frozenset({MeshAxis.DP, MeshAxis.DS, MeshAxis.DR})
"""A communicator group holding one of these serves data parallelism (gradient sync, ZeRO)."""
USER_AXES = (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP, MeshAxis.PP)
"""The axes ``rank_order`` orders (hybrid sharding's DS and DR take DP's place)."""


class AttentionKernel(StrEnum):
    MATERIALIZED = "materialized"
    """Scores and probabilities are written to memory (the case of Korthikanti et al.)."""
    FLASH = "flash"
    """Fused kernel (FlashAttention): no s^2 tensors, QK^T recomputed inside backward."""
    FLASH_TRITON = "flash_triton"
    """The same fused algorithm in the 2022 Triton kernel (``flash_attn_triton``; MosaicML
    llm-foundry's ``attn_impl: triton``, its benchmarks' default until 2024-03): slower than
    FlashAttention-2 by :data:`~stage_dse.graph.ir.FLASH_TRITON_SPEED`."""

    @property
    def fused(self) -> bool:
        """Scores stay on chip (no s^2 tensors in memory)."""
        return self is not AttentionKernel.MATERIALIZED


class PipelineSchedule(StrEnum):
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    """Interleaved 1F1B with ``virtual_stages`` model chunks per GPU (Narayanan et al. SC21)."""
    ZB1P = "zb1p"
    """Zero-bubble pipeline parallelism, ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
    ICLR 2024, arXiv:2401.10241): the backward splits into the input gradient (B) and the
    weight gradient (W), and the W steps of the last micro-batches fill the 1F1B bubble, which
    shrinks to ``(pp - 1)(F + B - 2W)`` (DeepSeek-V3 report Table 2) at 1F1B's activation
    memory."""
    DUALPIPE = "dualpipe"
    """DeepSeek-V3's bidirectional schedule (DeepSeek-AI, "DeepSeek-V3 Technical Report",
    arXiv:2412.19437, sec. 3.2.1 and Table 2): micro-batches enter from both ends, so rank
    ``i`` holds stage ``i`` and stage ``pp - 1 - i`` (two copies of the parameters), a forward
    and a backward chunk of two micro-batches run as one pair whose all-to-all and pipeline
    communication hide under each other's compute, and the bubble is
    ``(pp/2 - 1)(F&B + B - 3W)`` against 1F1B's ``(pp - 1)(F + B)``; ``pp + 1`` micro-batches
    of activations in flight. Needs an even ``pp`` and an even number of micro-batches."""


ONE_CHUNK_SCHEDULES: tuple[str, ...] = tuple(
    s.value for s in PipelineSchedule if s is not PipelineSchedule.INTERLEAVED
)
"""Schedules with one model chunk per stage (``virtual_stages`` 1): the names a sweep's
``plan.schedule`` lists (interleaved is 1F1B with ``virtual_stages > 1``)."""

DEFAULT_RANK_ORDER: tuple[MeshAxis, ...] = (
    MeshAxis.TP,
    MeshAxis.CP,
    MeshAxis.EP,
    MeshAxis.DP,
    MeshAxis.PP,
)


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Degrees of parallelism and the execution choices of one training plan."""

    dp: int = 1
    """Data-parallel replicas."""
    dp_replicate: int = 1
    """Hybrid sharding: ZeRO states (and FSDP parameters) are sharded over groups of
    ``dp / dp_replicate`` data-parallel ranks, adjacent in rank order, and replicated over
    ``dp_replicate`` such groups. Gradients are reduce-scattered inside a group, then the shard
    is all-reduced across the replicas (PyTorch FSDP ``ShardingStrategy.HYBRID_SHARD``, FSDP2
    on a 2-D mesh, torchtitan's ``data_parallel_replicate_degree``; Megatron-LM's
    ``--num-distributed-optimizer-instances``); 1: one group of all ``dp`` ranks. Needs
    ``zero_stage >= 1``."""
    tp: int = 1
    """Tensor (Megatron intra-layer) parallel size."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel size: the sequence is split, K/V exchanged in a ring."""
    ep: int = 1
    """Expert-parallel size (MoE models only): experts are split over ``ep`` of the ``dp``
    data-parallel ranks (ep divides dp), as Megatron-LM and DeepSpeed-MoE do; with
    ``ep_over_tp`` over ``ep / tp`` data-parallel ranks times the tensor-parallel group. With
    context parallelism (``cp > 1``) an expert group of ``ep > 1`` holds whole context-parallel
    groups (:attr:`ep_over_cp`): ``ep / cp`` data-parallel ranks (``ep / (tp * cp)`` with
    ``ep_over_tp``)."""
    expert_tensor_parallel: bool = False
    """Experts split over the tensor-parallel group too (ETP = tp); off, each tensor-parallel
    rank runs whole experts on its own tokens (ETP = 1)."""
    ep_over_tp: bool = False
    """Expert parallelism spans the tensor-parallel ranks too (ETP = 1): each rank of a
    tensor-parallel group holds other experts, and the expert-parallel group is the ``tp``
    ranks of ``ep / tp`` data-parallel replicas, so ``ep`` may exceed ``dp``. Megatron-Core
    builds its expert groups so when expert_tensor_parallel_size is 1 ("MoE parallel
    folding": the expert ranks are laid over the flattened tp x cp x dp ranks; Liu et al.,
    arXiv:2504.14960), as do torchtitan's expert groups when ETP is 1."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms/dropout split over the sequence on the TP group."""
    zero_stage: int = 0
    """0: replicated states; 1: optimizer states sharded; 2: + gradients; 3: + parameters (FSDP)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    recompute: Recompute = Recompute.NONE
    recompute_modules: tuple[str, ...] = ()
    """Under ``recompute=selective``, the Megatron-Core modules recomputed
    (:data:`RECOMPUTE_MODULES`); empty: the attention core alone (Megatron-Core's default).
    ``recompute`` may name them itself: ``"selective:mla_up_proj+moe_act"``."""
    recompute_layers: int = 0
    """Under ``recompute=full``, the layers of each model chunk recomputed (Megatron-Core's
    ``recompute_method="block"`` with ``recompute_num_layers``: the first ones of each chunk
    keep only their input, the others keep every activation); 0: every layer.
    ``recompute="full:5"`` says the same."""
    attention: AttentionKernel = AttentionKernel.FLASH
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule only)."""
    stage_layers: str = "balanced"
    """How layers spread over (virtual) pipeline stages: ``balanced``, ``ceil`` or an explicit
    list of layers per virtual stage (:mod:`stage_dse.spec.stages`)."""
    rank_order: tuple[MeshAxis, ...] = DEFAULT_RANK_ORDER
    """Mesh axes from fastest- to slowest-varying over global ranks."""
    overlap_grad_reduce: bool = True
    """Data-parallel gradient reduction runs during the last micro-batch's backward
    (Megatron-LM ``--overlap-grad-reduce``, DeepSpeed/FSDP bucketed hooks)."""
    overlap_param_gather: bool = True
    """ZeRO-1/2 parameter all-gather after the step runs under the next forward
    (Megatron-LM ``--overlap-param-gather``)."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives are pipelined with the GEMMs that produce/consume them
    (Transformer Engine userbuffers); off, they sit on the critical path."""
    tp_dgrad_overlap: bool = True
    """In backward, a linear layer's input-gradient reduction runs under its weight-gradient
    GEMM and the re-gather of its input under its input-gradient GEMM (Megatron-LM's
    asynchronous tensor-parallel reduction, on by default since September 2021); off, every
    tensor-parallel collective sits on the critical path (Megatron-LM as in Narayanan et al.)."""
    ep_comm_overlap: bool = False
    """Expert-parallel all-to-alls run under another micro-batch's compute (DeepSeek-V3's
    DualPipe, sec. 3.2.1); off, they sit on the critical path."""
    zero_sync_per_tensor: bool = False
    """ZeRO-3 as DeepSpeed ran it in 2021 (0.3.x): every parameter tensor is gathered and its
    gradient reduce-scattered by its own list-form collective (``torch.distributed.all_gather``
    and ``reduce_scatter`` over per-rank tensors: one copy per rank around each), and fetching a
    module's parameters synchronizes the device, so none of it overlaps compute; off, each
    layer's parameters move as one flat buffer under the neighbouring layer's compute."""
    ep_dispatch_dedup: bool = False
    """Expert-parallel token dispatch deduplicated per node: a token crosses the network once
    for each other node holding one of its experts, is forwarded to them over NVLink, and
    their outputs are summed inside that node before the combine crosses back (DeepEP's
    internode kernels, DeepSeek-V3 report sec. 3.2.2); off, each of its ``top_k`` copies
    crosses on its own (NCCL all-to-all, Megatron-Core's ``alltoall`` dispatcher)."""
    grad_sync_per_step: bool = False
    """ZeRO-2: gradients accumulate unsharded (full gradient memory) over the step's
    micro-batches and are reduce-scattered once, under the last micro-batch's backward as
    ZeRO-1's are (PyTorch FSDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``; Meta's Llama 3
    trainer, which accumulates fp32 gradients over micro-batches, "The Llama 3 Herd of Models"
    sec. 3.3.2); off, each micro-batch reduce-scatters them (DeepSpeed ZeRO-2). Other stages
    are unaffected (ZeRO-3 reduce-scatters in every backward)."""
    offload_layers: int = 0
    """Layers whose saved activations go to host memory in forward and come back for their
    backward (Transformer Engine's CPU offload: Megatron-Core ``--cpu-offloading-num-layers``
    with activations offloaded). The first ``offload_layers`` layers are copied out on a side
    stream while later layers compute, so activation memory is that of the other layers
    (``transformer_engine/pytorch/cpu_offload.py``); Megatron-Core allows it with one pipeline
    stage and no activation recompute only (``TransformerConfig.__post_init__``)."""
    cuda_graphs: tuple[str, ...] = ()
    """The parts of the step captured in CUDA graphs (:data:`CUDA_GRAPH_MODULES`; ``"none"``,
    ``"attn+moe_router+moe_preprocess"``, ``"full_iteration"``); empty: every op is issued
    from the host, whose time per op bounds a step whose kernels are shorter."""
    expert_gemm_loop: bool = False
    """A grouped expert GEMM is issued as one GEMM per local expert (Transformer Engine's
    ``GroupedLinear``: a loop of cuBLAS GEMMs over streams); off, as one grouped kernel."""
    fsdp_master_shards: bool = False
    """Under ZeRO-3 a parameter shard is stored only in the master precision (PyTorch FSDP's
    mixed precision: the fp32 shard is the master, cast to 16 bits as it is gathered); off, a
    16-bit shard is kept beside the optimizer's master. Other ZeRO stages ignore it."""
    moe_weighted_activation: bool = False
    """Mixture-of-experts layers apply the routing probabilities inside the experts'
    activation and combine their outputs unweighted, so the outputs are not kept for
    backward (Megatron-Core's memory-efficient permutation, 2025-04); off, the combine weights
    the experts' outputs and keeps them."""
    fused_projections: bool = True
    """The query, key and value projections are one GEMM, and so are a gated MLP's gate and
    up projections (:class:`~stage_dse.spec.framework.FrameworkSpec`); each projection's
    flops then run at the wider GEMM's shape efficiency. Off, one GEMM per projection: a
    grouped-query attention's key and value GEMMs are as narrow as their heads."""
    fused_activation: bool = True
    """With ``fused_elementwise``, the gated MLP's activation is fused too; off, it alone runs
    eagerly (:class:`~stage_dse.spec.framework.FrameworkSpec`, nanotron)."""
    fused_elementwise: bool = True
    """Element-wise ops (norms, rotary embedding, gated activation) run as fused kernels
    (``torch.compile``, Transformer Engine or Apex kernels); off, as eager PyTorch runs its
    reference code, one kernel per op and each reading and writing device memory
    (:mod:`stage_dse.graph.eager`: torchtitan without ``training.compile``)."""

    def __post_init__(self) -> None:
        owner = "plan"
        for field in (
            "dp",
            "dp_replicate",
            "tp",
            "pp",
            "cp",
            "ep",
            "micro_batch_size",
            "virtual_stages",
        ):
            positive_int(owner, field, getattr(self, field), MAX_GPUS)
        non_negative_int(owner, "offload_layers", self.offload_layers)
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"plan.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for flag in _BOOL_FIELDS:
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"plan.{flag} must be true or false, got {getattr(self, flag)!r}")
        object.__setattr__(self, "cuda_graphs", parse_cuda_graphs(self.cuda_graphs))
        choice = parse_recompute(self.recompute, self.recompute_modules, self.recompute_layers)
        object.__setattr__(self, "recompute", choice.mode)
        object.__setattr__(self, "recompute_modules", choice.modules)
        object.__setattr__(self, "recompute_layers", choice.layers)
        object.__setattr__(
            self, "attention", coerce_enum(AttentionKernel, owner, "attention", self.attention)
        )
        object.__setattr__(
            self, "schedule", coerce_enum(PipelineSchedule, owner, "schedule", self.schedule)
        )
        object.__setattr__(self, "stage_layers", normalize_stage_layers(self.stage_layers))
        order = self.rank_order
        if isinstance(order, str):
            order = tuple(order.split("-"))
        order = tuple(coerce_enum(MeshAxis, owner, "rank_order", a) for a in order)
        if {MeshAxis.DS, MeshAxis.DR} & set(order):
            raise ConfigError(
                "plan.rank_order names ds or dr: hybrid sharding splits dp in place (the "
                "sharding group, then its replicas); set dp_replicate and order tp, cp, ep, dp, pp"
            )
        if sorted(order) != sorted(USER_AXES):
            valid = "-".join(a.value for a in DEFAULT_RANK_ORDER)
            raise ConfigError(
                f"plan.rank_order={'-'.join(a.value for a in order)} must name each of "
                f"tp, cp, ep, dp, pp exactly once (e.g. {valid})"
            )
        object.__setattr__(self, "rank_order", order)
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("plan.sequence_parallel=true needs tp > 1, got tp(1)")
        if self.dp_replicate > 1:
            if self.dp % self.dp_replicate:
                raise ConfigError(
                    f"plan.dp_replicate({self.dp_replicate}) does not divide dp({self.dp}) "
                    "(hybrid sharding: dp = sharding group x replicas)"
                )
            if self.zero_stage == 0:
                raise ConfigError(
                    f"plan.dp_replicate({self.dp_replicate}) > 1 needs zero_stage >= 1 "
                    "(replicas of a sharded group; without ZeRO every rank is a replica)"
                )
        if self.expert_tensor_parallel and self.tp == 1:
            raise ConfigError("plan.expert_tensor_parallel=true needs tp > 1, got tp(1)")
        if self.ep_over_tp and self.tp == 1:
            raise ConfigError("plan.ep_over_tp=true needs tp > 1, got tp(1)")
        if self.ep_over_tp and self.expert_tensor_parallel:
            raise ConfigError(
                "plan.ep_over_tp=true splits experts over the tensor-parallel ranks by expert; "
                "set expert_tensor_parallel=false (one of the two)"
            )
        if self.schedule is PipelineSchedule.INTERLEAVED:
            if self.pp == 1:
                raise ConfigError("plan.schedule=interleaved needs pp > 1, got pp(1)")
            if self.virtual_stages < 2:
                raise ConfigError(
                    f"plan.schedule=interleaved needs virtual_stages >= 2, "
                    f"got virtual_stages({self.virtual_stages})"
                )
        elif self.schedule is PipelineSchedule.DUALPIPE and self.pp % 2:
            raise ConfigError(
                f"plan.schedule=dualpipe needs an even pp (stage i pairs with pp - 1 - i), "
                f"got pp({self.pp})"
            )
        if self.schedule is not PipelineSchedule.INTERLEAVED and self.virtual_stages != 1:
            raise ConfigError(
                f"plan.virtual_stages({self.virtual_stages}) > 1 needs schedule=interleaved"
            )

    @property
    def recompute_label(self) -> str:
        """``recompute`` as result rows and sweeps name it (:attr:`RecomputeChoice.label`)."""
        return RecomputeChoice(self.recompute, self.recompute_modules, self.recompute_layers).label

    @property
    def cuda_graphs_label(self) -> str:
        """``cuda_graphs`` as result rows and sweeps name it (``none``, ``attn+moe_router``)."""
        return cuda_graphs_label(self.cuda_graphs)

    @property
    def model_parallel_size(self) -> int:
        """GPUs holding one replica of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def hybrid_shard(self) -> bool:
        """ZeRO states are sharded over part of the data-parallel ranks (``dp_replicate > 1``)."""
        return self.dp_replicate > 1

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks one sharding group spans: ``dp / dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def mesh_order(self) -> tuple[MeshAxis, ...]:
        """The mesh axes, fastest-varying first (:func:`mesh_order`)."""
        return mesh_order(self.rank_order, self.hybrid_shard)

    @property
    def mesh_degrees(self) -> dict[MeshAxis, int]:
        """Ranks along each mesh axis (DP counts the data-parallel ranks outside EP, DS those
        of one sharding group)."""
        return {
            MeshAxis.TP: self.tp,
            MeshAxis.CP: self.cp,
            MeshAxis.EP: self.ep_data,
            MeshAxis.DP: self.dp // self.ep_data,
            MeshAxis.DS: self.dp // (self.ep_data * self.dp_replicate),
            MeshAxis.DR: self.dp_replicate,
            MeshAxis.PP: self.pp,
        }

    @property
    def ep_data(self) -> int:
        """Data-parallel ranks an expert-parallel group takes: ``ep``, divided by ``tp`` when it
        spans the tensor-parallel ranks too and by ``cp`` when it spans the context-parallel
        ones (:attr:`ep_over_cp`)."""
        return self.ep // (self.tp if self.ep_over_tp else 1) // (self.cp if self.ep_over_cp else 1)

    @property
    def ep_over_cp(self) -> bool:
        """The expert-parallel group spans the context-parallel ranks (``ep > 1`` and
        ``cp > 1``). Both frameworks that combine the two lay expert groups so: Megatron-Core
        builds them over the flattened tp x cp x dp ranks of a stage, ``cp`` ranks before
        ``dp`` ones (megatron/core/parallel_state.py, the expert rank generator); torchtitan's
        expert mesh borrows every context-parallel rank and part of ``dp_shard``
        (torchtitan/distributed/parallel_dims.py). The context-parallel ranks then hold other
        experts, not replicas: expert states are replicated over ``dp / ep_data`` ranks only."""
        return self.ep > 1 and self.cp > 1

    @property
    def num_gpus(self) -> int:
        """World size: dp * tp * pp * cp (expert parallelism reuses data-parallel ranks)."""
        return self.dp * self.tp * self.pp * self.cp

    def num_microbatches(self, training: TrainingSpec) -> int:
        return training.global_batch_size // (self.dp * self.micro_batch_size)

    def replace(self, **changes: object) -> ParallelPlan:
        return dataclasses.replace(self, **changes)


_BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelPlan) if f.type == "bool")
"""The plan's true/false fields, each checked to be a bool (read from the annotations, so a
new flag is checked without being listed)."""


def mesh_order(rank_order: tuple[MeshAxis, ...], hybrid: bool = False) -> tuple[MeshAxis, ...]:
    """The mesh axes, fastest-varying first: ``rank_order``, and under hybrid sharding DP
    replaced by the sharding group (DS) and its replicas (DR) right after it (FSDP2's and
    torchtitan's ``(dp_replicate, dp_shard)`` mesh, Megatron-LM's contiguous optimizer
    instances)."""
    if not hybrid or MeshAxis.DP not in rank_order:
        return rank_order
    i = rank_order.index(MeshAxis.DP)
    return (*rank_order[:i], MeshAxis.DS, MeshAxis.DR, *rank_order[i + 1 :])


def ep_fits_over_tp(ep: int, tp: int, dp: int, cp: int = 1) -> bool:
    """Whether ``ep`` expert ranks can span the tensor-parallel group (``ep_over_tp``): whole
    groups of ``tp`` (of ``tp * cp`` when ``ep > 1`` and ``cp > 1``,
    :attr:`ParallelPlan.ep_over_cp`), taking the rest of the ``dp`` data-parallel ranks."""
    inner = tp * (cp if ep > 1 else 1)
    return tp > 1 and ep % inner == 0 and dp % (ep // inner) == 0


def check_recompute_modules(model: ModelSpec, modules: tuple[str, ...]) -> None:
    """Each recompute module names a part this model has."""
    has = {
        "mla_up_proj": (model.is_mla, "a latent-attention (MLA) model"),
        "moe": (model.is_moe, "a mixture-of-experts model"),
        "moe_act": (model.is_moe, "a mixture-of-experts model"),
        "shared_experts": (model.num_shared_experts > 0, "shared experts"),
        "mlp": (not model.is_moe or model.has_dense_layers, "dense-MLP layers"),
    }
    for name in modules:
        present, what = has.get(name, (True, ""))
        if not present:
            raise ConfigError(
                f"plan.recompute_modules: {name} needs {what}; {model.name} has none (drop {name})"
            )


def validate_plan(
    model: ModelSpec,
    training: TrainingSpec,
    plan: ParallelPlan,
    num_gpus: int | None = None,
) -> None:
    """Raise ``ConfigError`` naming the first relation the plan violates for this model."""
    divides("tp", plan.tp, "heads", model.num_heads)
    if model.num_kv_heads % plan.tp:
        raise ConfigError(
            f"tp({plan.tp}) does not divide kv_heads({model.num_kv_heads}) "
            "(replicating key/value heads across tensor-parallel ranks is not modelled)"
        )
    divides("tp", plan.tp, "ffn_hidden_size", model.ffn_hidden_size)
    divides("tp", plan.tp, "vocab", model.vocab_size)
    if plan.pp > model.num_layers:
        raise ConfigError(f"pp({plan.pp}) > layers({model.num_layers})")
    if plan.offload_layers:
        if plan.offload_layers >= model.num_layers:
            raise ConfigError(
                f"offload_layers({plan.offload_layers}) must be below layers({model.num_layers})"
            )
        if plan.pp > 1:
            raise ConfigError(
                f"offload_layers({plan.offload_layers}) needs pp=1, got pp({plan.pp}) "
                "(activation offload is not combined with pipeline parallelism)"
            )
        if plan.recompute is not Recompute.NONE:
            raise ConfigError(
                f"offload_layers({plan.offload_layers}) needs recompute=none, got "
                f"recompute={plan.recompute.value} (offloaded activations are kept, not recomputed)"
            )
    check_recompute_modules(model, plan.recompute_modules)
    virtual_stage_layers(model.num_layers, plan.pp, plan.virtual_stages, plan.stage_layers)
    divides("cp", plan.cp, "seq", training.seq_len)
    if plan.sequence_parallel and training.seq_len % (plan.tp * plan.cp):
        raise ConfigError(
            f"tp({plan.tp})*cp({plan.cp})={plan.tp * plan.cp} does not divide "
            f"seq({training.seq_len}) (sequence parallelism splits the sequence over tp)"
        )
    if not model.is_moe:
        if plan.ep != 1:
            raise ConfigError(
                f"ep({plan.ep}) > 1 needs a mixture-of-experts model; {model.name} is dense"
            )
        if plan.expert_tensor_parallel:
            raise ConfigError("plan.expert_tensor_parallel needs a mixture-of-experts model")
        if plan.ep_over_tp:
            raise ConfigError("plan.ep_over_tp needs a mixture-of-experts model")
    else:
        divides("ep", plan.ep, "experts", model.num_experts)
        if plan.ep_over_cp and plan.ep % (plan.cp * (plan.tp if plan.ep_over_tp else 1)):
            inner = f"cp({plan.cp})*tp({plan.tp})" if plan.ep_over_tp else f"cp({plan.cp})"
            raise ConfigError(
                f"ep({plan.ep}) is not a multiple of {inner} (an expert group holds whole "
                "context-parallel groups, as Megatron-Core and torchtitan lay them out; "
                "set ep=1 or a multiple)"
            )
        if plan.ep_over_tp:
            if plan.ep % plan.tp:
                raise ConfigError(
                    f"ep({plan.ep}) is not a multiple of tp({plan.tp}) (ep_over_tp: the "
                    "expert-parallel group holds whole tensor-parallel groups)"
                )
            if plan.dp % plan.ep_data:
                over = f"tp({plan.tp})*cp({plan.cp})" if plan.ep_over_cp else f"tp({plan.tp})"
                raise ConfigError(
                    f"ep({plan.ep})/{over}={plan.ep_data} does not divide dp({plan.dp}) "
                    "(ep_over_tp: the expert-parallel group takes that many data-parallel ranks)"
                )
        elif plan.dp % plan.ep_data:  # ep_data: ep, or ep / cp with ep_over_cp
            hint = (
                "; set ep_over_tp=true to span the tensor-parallel ranks too"
                if not plan.expert_tensor_parallel
                and ep_fits_over_tp(plan.ep, plan.tp, plan.dp, plan.cp)
                else ""
            )
            if plan.ep_over_cp:
                raise ConfigError(
                    f"ep({plan.ep})/cp({plan.cp})={plan.ep_data} does not divide dp({plan.dp}) "
                    f"(the expert-parallel group takes that many data-parallel ranks){hint}"
                )
            raise ConfigError(f"ep({plan.ep}) does not divide dp({plan.dp}){hint}")
        if plan.tp > 1 and not plan.sequence_parallel:
            raise ConfigError(
                f"tp({plan.tp}) > 1 with experts needs sequence_parallel=true "
                "(tokens are split over the tensor-parallel group before routing)"
            )
        if plan.expert_tensor_parallel and model.moe_ffn_hidden_size % plan.tp:
            raise ConfigError(
                f"tp({plan.tp}) does not divide moe_ffn_hidden_size({model.moe_ffn_hidden_size})"
            )
    if plan.hybrid_shard and plan.dp_shard % plan.ep_data:
        raise ConfigError(
            f"ep({plan.ep}) does not fit a sharding group of dp({plan.dp})/dp_replicate"
            f"({plan.dp_replicate})={plan.dp_shard} ranks (hybrid sharding: the expert-parallel "
            f"group lies inside one; {plan.ep_data} data-parallel ranks must divide it)"
        )
    per_step = plan.dp * plan.micro_batch_size
    if training.global_batch_size % per_step:
        raise ConfigError(
            f"global_batch({training.global_batch_size}) not divisible by "
            f"dp({plan.dp})*micro_batch({plan.micro_batch_size})={per_step}"
        )
    if plan.schedule is PipelineSchedule.DUALPIPE and plan.num_microbatches(training) % 2:
        raise ConfigError(
            f"num_microbatches({plan.num_microbatches(training)}) is odd: plan.schedule="
            "dualpipe feeds half the micro-batches from each end of the pipeline"
        )
    if plan.schedule is PipelineSchedule.INTERLEAVED:
        m = plan.num_microbatches(training)
        if m % plan.pp:
            raise ConfigError(
                f"num_microbatches({m}) not divisible by pp({plan.pp}) "
                "(required by the interleaved schedule)"
            )
    if num_gpus is not None:
        positive_int("cluster", "num_gpus", num_gpus, MAX_GPUS)
        if plan.num_gpus != num_gpus:
            raise ConfigError(
                f"dp({plan.dp})*tp({plan.tp})*pp({plan.pp})*cp({plan.cp})"
                f"={plan.num_gpus} != num_gpus({num_gpus})"
            )
