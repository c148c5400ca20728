"""The data model of the symbolic tensor graph: tensors, ops, layouts, and the op recorder.

What lives here: the typed enums an op or tensor carries (:class:`Role`, :class:`Scope`,
:class:`Phase`, :class:`OpKind`, :class:`CollKind`, ...), :class:`Axis`, :class:`Tensor` (a
global tensor with its layout over the device mesh), :class:`Op` (one kernel or collective with
its per-GPU flops and bytes as sympy expressions), the pointwise kernel catalogue
(:class:`Elementwise`), and :class:`Recorder`, the append-only op list every builder writes to.
What does not: how layouts change (:mod:`stage_dse.graph.layout`), the forward op builders
(:mod:`stage_dse.graph.forward`), backward rules (:mod:`stage_dse.graph.backward`).

A layout gives, for each tensor axis, the tuple of mesh axes it is split over; ``partial``
names the mesh axes over which the tensor still holds an unreduced sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import sympy as sp

from stage_dse.graph.symbols import DEGREE
from stage_dse.spec.plan import MeshAxis

__all__ = [
    "ACCUMULATE",
    "ADD",
    "CROSS_ENTROPY",
    "DROPOUT",
    "FLASH_TRITON_SPEED",
    "GELU",
    "LAYERNORM",
    "RMSNORM",
    "ROPE",
    "SOFTMAX",
    "SWIGLU",
    "Axis",
    "CollKind",
    "Elementwise",
    "Frequency",
    "Layout",
    "Module",
    "Op",
    "OpKind",
    "Phase",
    "Recorder",
    "Region",
    "Role",
    "Scope",
    "Tensor",
    "dedupe",
    "degree",
]


class Role(StrEnum):
    WEIGHT = "weight"
    GRAD = "grad"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    ACTIVATION_GRAD = "activation_grad"
    INPUT = "input"
    """Non-differentiable inputs (token ids, positions)."""
    KV_CACHE = "kv_cache"
    """Serving: keys and values of earlier tokens, read by attention, appended to."""


class Scope(StrEnum):
    """Where an op sits in the model: the pipeline stage follows from it."""

    EMBED = "embed"
    """First stage: embeddings."""
    BLOCK = "block"
    """One transformer layer, repeated layers/pp times per stage."""
    HEAD = "head"
    """Last stage: final norm, output projection, loss."""


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Frequency(StrEnum):
    PER_MICROBATCH = "per_microbatch"
    PER_STEP = "per_step"


class Region(StrEnum):
    NONE = "none"
    ATTENTION_CORE = "attention_core"
    """QK^T, softmax, dropout, PV: what selective recompute reruns."""


class Module(StrEnum):
    """The part of a layer an op belongs to, as frameworks capture parts of a layer in CUDA
    graphs (Megatron-Core ``--cuda-graph-scope``: ``attn``, ``mlp``, ``moe_router``)."""

    OTHER = "other"
    """Embeddings, output layer, loss."""
    ATTN = "attn"
    """Input norm, attention and its projections, the attention residual."""
    MLP = "mlp"
    """A dense layer's MLP half: post-attention norm, MLP, residual."""
    ROUTER = "router"
    """A mixture-of-experts layer's post-attention norm and router."""
    EXPERTS = "experts"
    """Token dispatch, the experts (shared ones too), combine, residual: the dynamic-shape
    part no per-layer CUDA graph captures in a dropless layer."""


class OpKind(StrEnum):
    EINSUM = "einsum"
    ATTENTION = "attention"
    """Fused attention kernel (FlashAttention)."""
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    BIAS = "bias"
    EMBEDDING = "embedding"
    LOSS = "loss"
    COLLECTIVE = "collective"
    VIEW = "view"
    """Same data under other axis names (e.g. the key-side sequence axis); free."""
    PERMUTE = "permute"
    """Rows copied into another arrangement (MoE token dispatch and combine)."""
    OPTIMIZER = "optimizer"


class CollKind(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"
    """Local slice of a replicated tensor: no communication, kept for backward derivation."""
    SEND_RECV = "send_recv"


@dataclass(frozen=True)
class Elementwise:
    """A pointwise kernel: flops per output element and what backward needs."""

    name: str
    fwd_flops_per_elem: int
    bwd_flops_per_elem: int
    saves_inputs: bool
    saves_output: bool = False
    mask_bytes: int = 0
    """Bytes per element of a saved mask (dropout); 0 for none."""
    linear: bool = False
    """Gradient passes through unchanged to every input (residual add)."""


@dataclass(frozen=True)
class Axis:
    """A named tensor dimension with a global extent; the name only identifies einsum indices."""

    name: str
    extent: sp.Expr

    def __repr__(self) -> str:
        return f"{self.name}={self.extent}"


Layout = tuple[tuple[MeshAxis, ...], ...]


def degree(mesh_axes: Iterable[MeshAxis]) -> sp.Expr:
    return sp.Mul(*[DEGREE[m] for m in mesh_axes])


@dataclass(frozen=True, eq=False)
class Tensor:
    """A global tensor with its layout over the mesh. Identity is object identity."""

    name: str
    role: Role
    axes: tuple[Axis, ...]
    layout: Layout
    dtype_bytes: sp.Expr
    scope: Scope
    partial: frozenset[MeshAxis] = frozenset()

    def __post_init__(self) -> None:
        assert len(self.layout) == len(self.axes), (self.name, self.axes, self.layout)
        used = [m for ms in self.layout for m in ms]
        assert len(used) == len(set(used)), f"{self.name}: a mesh axis splits two axes"
        assert not (set(used) & self.partial), f"{self.name}: split and partial on one mesh axis"

    @property
    def numel(self) -> sp.Expr:
        return sp.Mul(*[a.extent for a in self.axes])

    @property
    def local_numel(self) -> sp.Expr:
        return sp.Mul(*[a.extent / degree(ms) for a, ms in zip(self.axes, self.layout)])

    @property
    def local_bytes(self) -> sp.Expr:
        return self.local_numel * self.dtype_bytes

    @property
    def shard_degree(self) -> sp.Expr:
        """Number of distinct shards the layout cuts this tensor into."""
        return degree(m for ms in self.layout for m in ms)

    @property
    def split_mesh_axes(self) -> frozenset[MeshAxis]:
        return frozenset(m for ms in self.layout for m in ms)

    def split_of(self, axis: Axis) -> tuple[MeshAxis, ...]:
        return self.layout[self.axes.index(axis)]

    def __repr__(self) -> str:
        return f"Tensor({self.name})"


@dataclass(eq=False)
class Op:
    """One kernel or collective, per micro-batch unless ``frequency`` says per step."""

    kind: OpKind
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    phase: Phase
    scope: Scope
    flops: sp.Expr = sp.Integer(0)
    """Per-GPU floating point operations."""
    global_flops: sp.Expr = sp.Integer(0)
    """Operations over the whole mesh (the op's full iteration space)."""
    bytes: sp.Expr = sp.Integer(0)
    """Per-GPU bytes read and written in device memory."""
    saved: tuple[Tensor, ...] = ()
    """Tensors this forward op keeps for its backward."""
    region: Region = Region.NONE
    module: Module = Module.OTHER
    frequency: Frequency = Frequency.PER_MICROBATCH
    coll: CollKind | None = None
    group: frozenset[MeshAxis] = frozenset()
    comm_bytes: sp.Expr = sp.Integer(0)
    """Per-GPU buffer size of a collective (AR: the buffer; AG: gathered output; RS: input)."""
    regather: bool = False
    """An all-gather reissued in backward because its output was not kept."""
    recompute: bool = False
    """Work that exists only because a value was not kept (counts in HFU, not MFU)."""
    elementwise: Elementwise | None = None
    kernels: int = 1
    """Kernels the op launches (an element-wise op run eagerly, :mod:`stage_dse.graph.eager`,
    launches one per op of its reference implementation)."""
    speed: sp.Expr = sp.Integer(1)
    """Throughput of the op's kernel relative to the hardware's reference kernel of its class
    (``attention_efficiency`` is FlashAttention-2's class; the 2022 Triton kernel runs at
    :data:`FLASH_TRITON_SPEED` of it)."""
    matmul: bool = False
    """Counts as model flops (einsum / attention)."""
    executed_fraction: sp.Expr = sp.Integer(1)
    """Share of ``flops`` the kernel executes: a fused causal attention kernel skips the tiles
    above the diagonal. Counted flops (``flops``, MFU by Narayanan et al.'s convention) keep
    the full work; time and the causal MFU use the executed share."""
    axes_iter: tuple[Axis, ...] = ()
    layout_iter: Layout = ()
    fused_width: sp.Expr = sp.Integer(1)
    """How many times wider the GEMM that runs this einsum is than its own output features
    (forward; the same features are the contraction of its input gradient and the rows of its
    weight gradient): a projection fused with others into one GEMM (the query, key and value
    projections, a gated MLP's gate and up projections) runs its flops at the fused GEMM's
    shape (:func:`stage_dse.cost.kernel_time.gemm_mnk`, ``fused=True``)."""

    @property
    def is_comm(self) -> bool:
        return self.kind is OpKind.COLLECTIVE and self.coll is not CollKind.SLICE


FLASH_TRITON_SPEED = sp.Rational(1, 2)
"""Throughput of FlashAttention in Triton (``flash_attn_triton.py``, the 2022 kernel for the
pre-MLIR Triton) relative to FlashAttention-2, forward plus backward. Its header: "Overall
Triton forward + backward is slightly slower than CUDA forward + backward" (the CUDA
FlashAttention of 2022, Dao-AILab/flash-attention ``flash_attn/flash_attn_triton.py``), and
FlashAttention-2 runs about twice that CUDA kernel's speed (Dao, "FlashAttention-2",
arXiv:2307.08691, abstract: "around 2x speedup compared to FlashAttention"); so half, or a
little less. A cited constant, not fitted."""


ADD = Elementwise("add", 1, 0, saves_inputs=False, linear=True)
SOFTMAX = Elementwise("softmax", 5, 4, saves_inputs=False, saves_output=True)
DROPOUT = Elementwise("dropout", 2, 2, saves_inputs=False, mask_bytes=1)
GELU = Elementwise("gelu", 8, 16, saves_inputs=True)
SWIGLU = Elementwise("swiglu", 6, 12, saves_inputs=True)
ROPE = Elementwise("rope", 3, 3, saves_inputs=False)
LAYERNORM = Elementwise("layernorm", 8, 16, saves_inputs=True)
RMSNORM = Elementwise("rmsnorm", 5, 10, saves_inputs=True)
CROSS_ENTROPY = Elementwise("cross_entropy", 6, 3, saves_inputs=False)
ACCUMULATE = Elementwise("accumulate", 1, 0, saves_inputs=False, linear=True)


def dedupe(items: Iterable[Axis]) -> list[Axis]:
    seen: dict[Axis, None] = {}
    for a in items:
        seen.setdefault(a, None)
    return list(seen)


class Recorder:
    """An append-only list of ops with the scope and region new ops are recorded in."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.producer: dict[Tensor, Op] = {}
        self._scope = Scope.BLOCK
        self._region = Region.NONE
        self._module = Module.OTHER

    def scope(self, scope: Scope) -> _Ctx:
        return _Ctx(self, "_scope", scope)

    def region(self, region: Region) -> _Ctx:
        return _Ctx(self, "_region", region)

    def module(self, module: Module) -> _Ctx:
        return _Ctx(self, "_module", module)

    def enter_module(self, module: Module) -> None:
        """Record the ops that follow in ``module`` (a layer's parts in sequence)."""
        self._module = module

    def _record(self, op: Op) -> Op:
        op.module = self._module
        self.ops.append(op)
        for t in op.outputs:
            self.producer[t] = op
        return op

    def tensor(
        self,
        name: str,
        role: Role,
        axes: Sequence[Axis],
        layout: Sequence[Sequence[MeshAxis]],
        dtype_bytes: sp.Expr | int,
        partial: Iterable[MeshAxis] = (),
    ) -> Tensor:
        return Tensor(
            name=name,
            role=role,
            axes=tuple(axes),
            layout=tuple(tuple(ms) for ms in layout),
            dtype_bytes=sp.sympify(dtype_bytes),
            scope=self._scope,
            partial=frozenset(partial),
        )


class _Ctx:
    def __init__(self, graph: Recorder, attr: str, value: object) -> None:
        self.graph, self.attr, self.value = graph, attr, value

    def __enter__(self) -> None:
        self.old = getattr(self.graph, self.attr)
        setattr(self.graph, self.attr, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(self.graph, self.attr, self.old)
