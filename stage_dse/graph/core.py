"""The symbolic tensor graph: tensors, ops, layout redistribution and automatic backward.

What lives here: the data model (``Axis``, ``Tensor``, ``Op``) and the ``Graph`` that records
forward ops, derives the collectives a layout change needs, and derives the backward pass from
the forward ops. What does not: any particular model (see :mod:`stage_dse.graph.transformer`),
any aggregation into costs (see :mod:`stage_dse.cost`), and any I/O.

Layouts work like a device-mesh tensor: each tensor axis is split over a tuple of mesh axes, and
a tensor may carry a *partial sum* over mesh axes (the result of contracting a split index).
:meth:`Graph.redistribute` turns one layout into another with the collectives that change needs:

=====================================  =================
source -> target on one mesh axis      collective
=====================================  =================
partial, target splits an axis on it   reduce-scatter
partial, target does not split on it   all-reduce
split, target does not split on it     all-gather
split, target splits another axis      all-to-all
not split, target splits               local slice (free)
=====================================  =================

An einsum whose operands split different indices over the same mesh axis is resolved by
gathering the activation operand (weights never move except through ZeRO-3), and contracting a
split index leaves a partial sum. Backward ops are derived by rule from each forward op (an einsum
yields two einsums, the backward of a redistribution is the reverse redistribution), so the
collectives of the backward pass follow from the same rules. A tensor saved for backward that was
produced by an all-gather is not kept: its source is kept and the gather is issued again in
backward, as Megatron-LM does under sequence parallelism and FSDP does for parameters.

All sizes are sympy expressions of :class:`stage_dse.graph.symbols.Symbols`; ``flops`` and
``bytes`` of an op are per GPU (local extents), ``global_flops`` over the whole mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import sympy as sp

from stage_dse.graph.symbols import DEGREE
from stage_dse.spec.plan import MeshAxis

__all__ = [
    "Axis",
    "CollKind",
    "Elementwise",
    "Frequency",
    "Graph",
    "Op",
    "OpKind",
    "Phase",
    "Region",
    "Role",
    "Scope",
    "Tensor",
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


def _degree(mesh_axes: Iterable[MeshAxis]) -> sp.Expr:
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
        return sp.Mul(*[a.extent / _degree(ms) for a, ms in zip(self.axes, self.layout)])

    @property
    def local_bytes(self) -> sp.Expr:
        return self.local_numel * self.dtype_bytes

    @property
    def shard_degree(self) -> sp.Expr:
        """Number of distinct shards the layout cuts this tensor into."""
        return _degree(m for ms in self.layout for m in ms)

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
    matmul: bool = False
    """Counts as model flops (einsum / attention)."""
    axes_iter: tuple[Axis, ...] = ()
    layout_iter: Layout = ()

    @property
    def is_comm(self) -> bool:
        return self.kind is OpKind.COLLECTIVE and self.coll is not CollKind.SLICE


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


def _dedupe(items: Iterable[Axis]) -> list[Axis]:
    seen: dict[Axis, None] = {}
    for a in items:
        seen.setdefault(a, None)
    return list(seen)


class Graph:
    """Records forward ops of one model section and derives backward and its collectives."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.producer: dict[Tensor, Op] = {}
        self.weights: list[Tensor] = []
        self._scope = Scope.BLOCK
        self._region = Region.NONE
        self.block_input: Tensor | None = None
        self.loss: Tensor | None = None
        self.weight_storage: dict[Tensor, Tensor] = {}
        """Compute-layout weight -> stored weight, when they differ (ZeRO-3)."""
        self._computed: dict[Tensor, Tensor] = {}
        """Stored weight -> compute-layout weight (the inverse of ``weight_storage``)."""
        self.grads: dict[Tensor, Tensor] = {}
        """Gradient of each forward tensor after :meth:`derive_backward` (may be partial)."""
        self.input_grad: dict[Tensor, Tensor] = {}

    # ------------------------------------------------------------------ recording
    def scope(self, scope: Scope) -> _Ctx:
        return _Ctx(self, "_scope", scope)

    def region(self, region: Region) -> _Ctx:
        return _Ctx(self, "_region", region)

    def _record(self, op: Op) -> Op:
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

    def weight(
        self,
        name: str,
        axes: Sequence[Axis],
        layout: Sequence[Sequence[MeshAxis]],
        dtype_bytes: sp.Expr | int,
        shard_states_over: Sequence[MeshAxis] = (),
        fsdp: bool = False,
    ) -> Tensor:
        """Declare a parameter. With ``fsdp`` it is stored sharded over ``shard_states_over`` and
        gathered to the compute layout before use (ZeRO-3); the gather output is not kept."""
        w = self.tensor(name, Role.WEIGHT, axes, layout, dtype_bytes)
        if not fsdp or not shard_states_over:
            self.weights.append(w)
            return w
        stored_layout = zero_layout(w, shard_states_over)
        stored = self.tensor(name, Role.WEIGHT, axes, stored_layout, dtype_bytes)
        self.weights.append(stored)
        compute = self.redistribute(stored, w.layout)
        self.weight_storage[compute] = stored
        self._computed[stored] = compute
        return compute

    def computed(self, stored: Tensor) -> Tensor:
        """A stored weight as ops use it: gathered to its compute layout under ZeRO-3."""
        return self._computed.get(stored, stored)

    # ------------------------------------------------------------------ layouts
    def redistribute(
        self,
        t: Tensor,
        target: Layout | Sequence[Sequence[MeshAxis]],
        *,
        phase: Phase = Phase.FORWARD,
        frequency: Frequency = Frequency.PER_MICROBATCH,
        regather: bool = False,
        recompute: bool = False,
    ) -> Tensor:
        """Return ``t`` in ``target`` layout (and without partial sums), recording collectives."""
        target = tuple(tuple(ms) for ms in target)
        if target == t.layout and not t.partial:
            return t
        src_owner = {m: i for i, ms in enumerate(t.layout) for m in ms}
        tgt_owner = {m: i for i, ms in enumerate(target) for m in ms}
        reduce_scatter = {m for m in t.partial if m in tgt_owner}
        all_reduce = set(t.partial) - reduce_scatter
        gather = {m for m in src_owner if m not in tgt_owner}
        all_to_all = {m for m in src_owner if m in tgt_owner and tgt_owner[m] != src_owner[m]}
        slice_ = {m for m in tgt_owner if m not in src_owner and m not in t.partial}

        def step(kind: CollKind, mesh: set[MeshAxis], layout: Layout, partial) -> None:
            nonlocal cur
            out = Tensor(
                name=t.name,
                role=t.role,
                axes=t.axes,
                layout=layout,
                dtype_bytes=t.dtype_bytes,
                scope=self._scope,
                partial=frozenset(partial),
            )
            size = {
                CollKind.ALL_REDUCE: cur.local_bytes,
                CollKind.REDUCE_SCATTER: cur.local_bytes,
                CollKind.ALL_GATHER: out.local_bytes,
                CollKind.ALL_TO_ALL: cur.local_bytes,
                CollKind.SLICE: sp.Integer(0),
            }[kind]
            self._record(
                Op(
                    kind=OpKind.COLLECTIVE,
                    name=f"{kind.value}:{t.name}",
                    inputs=(cur,),
                    outputs=(out,),
                    phase=phase,
                    scope=self._scope,
                    region=self._region,
                    frequency=frequency,
                    coll=kind,
                    group=frozenset(mesh),
                    comm_bytes=size,
                    bytes=sp.Integer(0)
                    if kind is CollKind.SLICE
                    else cur.local_bytes + out.local_bytes,
                    regather=regather,
                    recompute=recompute,
                )
            )
            cur = out

        cur = t
        keep = [tuple(m for m in ms if m not in gather | all_to_all) for ms in t.layout]
        if all_reduce:
            step(CollKind.ALL_REDUCE, all_reduce, cur.layout, cur.partial - all_reduce)
        if reduce_scatter:
            lay = [list(ms) for ms in cur.layout]
            for m in sorted(reduce_scatter, key=lambda x: target[tgt_owner[x]].index(x)):
                lay[tgt_owner[m]].append(m)
            step(CollKind.REDUCE_SCATTER, reduce_scatter, _order(lay, target), frozenset())
        if gather:
            lay = [tuple(m for m in ms if m not in gather) for ms in cur.layout]
            step(CollKind.ALL_GATHER, gather, tuple(lay), frozenset())
        if all_to_all:
            lay = [list(ms) for ms in keep]
            for m in all_to_all:
                lay[tgt_owner[m]].append(m)
            step(CollKind.ALL_TO_ALL, all_to_all, _order(lay, target), frozenset())
        if slice_:
            step(CollKind.SLICE, slice_, target, frozenset())
        assert cur.layout == target and not cur.partial, (t.name, cur.layout, target)
        return cur

    def gathered_source(self, t: Tensor) -> Tensor:
        """The tensor actually kept when ``t`` is saved: the input of the all-gathers (and views)
        that made it."""
        op = self.producer.get(t)
        while op is not None and (op.coll is CollKind.ALL_GATHER or op.kind is OpKind.VIEW):
            t = op.inputs[0]
            op = self.producer.get(t)
        return t

    def permute(
        self,
        name: str,
        x: Tensor,
        axes: Sequence[Axis],
        layout: Sequence[Sequence[MeshAxis]],
        *,
        weights: Tensor | None = None,
        flops_per_elem: int = 0,
    ) -> Tensor:
        """Copy rows of ``x`` into a tensor of other axes (token dispatch to experts, or the
        weighted combine back, with ``weights`` the routing probabilities). Local: the layout
        must keep every mesh axis on the rows' origin."""
        out = self.tensor(name, Role.ACTIVATION, axes, layout, x.dtype_bytes)
        assert not x.partial
        inputs = (x,) if weights is None else (x, weights)
        self._record(
            Op(
                kind=OpKind.PERMUTE,
                name=name,
                inputs=inputs,
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
                flops=flops_per_elem * out.local_numel,
                global_flops=flops_per_elem * out.numel,
                bytes=sum((t.local_bytes for t in inputs), sp.Integer(0)) + out.local_bytes,
                saved=(() if weights is None else (x, weights)),
            )
        )
        return out

    def view(self, x: Tensor, axes: Sequence[Axis]) -> Tensor:
        """The same data indexed by other axes of equal extents (no copy, no cost)."""
        out = Tensor(
            name=x.name,
            role=x.role,
            axes=tuple(axes),
            layout=x.layout,
            dtype_bytes=x.dtype_bytes,
            scope=self._scope,
            partial=x.partial,
        )
        self._record(
            Op(
                kind=OpKind.VIEW,
                name=f"view:{x.name}",
                inputs=(x,),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
            )
        )
        return out

    # ------------------------------------------------------------------ forward ops
    def einsum(
        self,
        name: str,
        a: Tensor,
        b: Tensor,
        out_axes: Sequence[Axis],
        *,
        role: Role = Role.ACTIVATION,
        phase: Phase = Phase.FORWARD,
        recompute: bool = False,
        save: bool = True,
    ) -> Tensor:
        """Contract ``a`` and ``b`` onto ``out_axes``; flops are 2 x the iteration-space size."""
        assert not a.partial and not b.partial, (name, a.partial, b.partial)
        idx = _dedupe([*a.axes, *b.axes])
        out_axes = tuple(out_axes)
        assert set(out_axes) <= set(idx), name
        la = dict(zip(a.axes, a.layout))
        lb = dict(zip(b.axes, b.layout))
        b_wins = b.role is Role.WEIGHT and a.role is not Role.WEIGHT
        it: dict[Axis, tuple[MeshAxis, ...]] = {}
        for ax in idx:
            if ax in la and ax in lb and la[ax] != lb[ax]:
                it[ax] = lb[ax] if b_wins else la[ax]
            else:
                it[ax] = la.get(ax, lb.get(ax, ()))
        first, second = (b, a) if b_wins else (a, b)
        used: set[MeshAxis] = set()
        for ax in _dedupe([*first.axes, *second.axes]):
            kept = tuple(m for m in it[ax] if m not in used)
            used.update(kept)
            it[ax] = kept
        a2 = self.redistribute(a, [it[ax] for ax in a.axes], phase=phase, recompute=recompute)
        b2 = self.redistribute(b, [it[ax] for ax in b.axes], phase=phase, recompute=recompute)
        contracted = [ax for ax in idx if ax not in out_axes]
        partial = frozenset(m for ax in contracted for m in it[ax])
        out = self.tensor(
            name,
            role,
            out_axes,
            [it[ax] for ax in out_axes],
            a.dtype_bytes,
            partial=partial,
        )
        local = sp.Mul(*[ax.extent / _degree(it[ax]) for ax in idx])
        self._record(
            Op(
                kind=OpKind.EINSUM,
                name=name,
                inputs=(a2, b2),
                outputs=(out,),
                phase=phase,
                scope=self._scope,
                region=self._region,
                flops=2 * local,
                global_flops=2 * sp.Mul(*[ax.extent for ax in idx]),
                bytes=a2.local_bytes + b2.local_bytes + out.local_bytes,
                saved=(a2, b2) if save else (),
                matmul=True,
                recompute=recompute,
                axes_iter=tuple(idx),
                layout_iter=tuple(it[ax] for ax in idx),
            )
        )
        return out

    def pointwise(
        self,
        kind: Elementwise,
        name: str,
        *inputs: Tensor,
        out_dtype_bytes: sp.Expr | int | None = None,
    ) -> Tensor:
        """An element-wise kernel over same-shaped inputs (the first input's layout wins)."""
        base = inputs[0]
        ins = [base] + [self.redistribute(x, base.layout) for x in inputs[1:]]
        assert all(not x.partial for x in ins), name
        out = self.tensor(
            name,
            Role.ACTIVATION,
            base.axes,
            base.layout,
            base.dtype_bytes if out_dtype_bytes is None else out_dtype_bytes,
        )
        saved: list[Tensor] = []
        if kind.saves_inputs:
            saved.extend(ins)
        if kind.saves_output:
            saved.append(out)
        if kind.mask_bytes:
            mask = self.tensor(
                f"{name}_mask", Role.ACTIVATION, base.axes, base.layout, kind.mask_bytes
            )
            saved.append(mask)
        n = base.local_numel
        self._record(
            Op(
                kind=OpKind.ELEMENTWISE,
                name=name,
                inputs=tuple(ins),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
                flops=kind.fwd_flops_per_elem * n,
                global_flops=kind.fwd_flops_per_elem * base.numel,
                bytes=sum((x.local_bytes for x in ins), sp.Integer(0))
                + out.local_bytes
                + (saved[-1].local_bytes if kind.mask_bytes else 0),
                saved=tuple(saved),
                elementwise=kind,
            )
        )
        return out

    def norm(self, kind: Elementwise, name: str, x: Tensor, *params: Tensor) -> Tensor:
        """LayerNorm/RMSNorm over the last axis of ``x`` with per-channel ``params``."""
        assert not x.partial and not x.layout[-1], f"{name}: normalized axis must be whole"
        out = self.tensor(name, Role.ACTIVATION, x.axes, x.layout, x.dtype_bytes)
        n = x.local_numel
        self._record(
            Op(
                kind=OpKind.NORM,
                name=name,
                inputs=(x, *params),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
                flops=kind.fwd_flops_per_elem * n,
                global_flops=kind.fwd_flops_per_elem * x.numel,
                bytes=2 * x.local_bytes + sum((p.local_bytes for p in params), sp.Integer(0)),
                saved=(x, *params),
                elementwise=kind,
            )
        )
        return out

    def bias(self, name: str, x: Tensor, b: Tensor) -> Tensor:
        """Broadcast-add a parameter along the trailing axes of ``x``."""
        assert not x.partial
        out = self.tensor(name, Role.ACTIVATION, x.axes, x.layout, x.dtype_bytes)
        self._record(
            Op(
                kind=OpKind.BIAS,
                name=name,
                inputs=(x, b),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
                flops=x.local_numel,
                global_flops=x.numel,
                bytes=2 * x.local_bytes + b.local_bytes,
                elementwise=ADD,
            )
        )
        return out

    def embedding(
        self, name: str, ids: Tensor, table: Tensor, row_axis: Axis, out_axes: Sequence[Axis]
    ) -> Tensor:
        """Row lookup; a table split over rows gives a partial sum (vocab-parallel embedding)."""
        row_split = table.split_of(row_axis)
        col_axes = [ax for ax in table.axes if ax is not row_axis]
        layout = list(ids.layout) + [table.split_of(ax) for ax in col_axes]
        out = self.tensor(
            name, Role.ACTIVATION, out_axes, layout, table.dtype_bytes, partial=row_split
        )
        self._record(
            Op(
                kind=OpKind.EMBEDDING,
                name=name,
                inputs=(ids, table),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                flops=sp.Integer(0),
                bytes=ids.local_bytes + 2 * out.local_bytes,
                saved=(ids,),
            )
        )
        return out

    def attention(
        self,
        name: str,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_q: Axis,
        seq_k: Axis,
        out_axes: Sequence[Axis],
        stat_axes: Sequence[Axis],
    ) -> Tensor:
        """Fused attention kernel: o = softmax(q k^T) v without materializing scores.

        Keys and values are needed whole along the key sequence (context parallel ring exchange
        gathers them). Saves q, k, v, o and the fp32 log-sum-exp; backward reruns q k^T.
        """
        k_layout = [() if ax == seq_k else ms for ax, ms in zip(k.axes, k.layout)]
        v_layout = [() if ax == seq_k else ms for ax, ms in zip(v.axes, v.layout)]
        k2 = self.redistribute(k, k_layout)
        v2 = self.redistribute(v, v_layout)
        layout_q = dict(zip(q.axes, q.layout))
        lay = {**dict(zip(v2.axes, v2.layout)), **dict(zip(k2.axes, k2.layout)), **layout_q}
        out = self.tensor(
            name, Role.ACTIVATION, out_axes, [lay[ax] for ax in out_axes], q.dtype_bytes
        )
        lse = self.tensor(
            f"{name}_lse", Role.ACTIVATION, stat_axes, [layout_q[ax] for ax in stat_axes], 4
        )
        # two GEMM-like contractions: q k^T over (q ∪ k) and p v over (out ∪ key sequence)
        idx = _dedupe([*q.axes, *k2.axes])
        idx_av = _dedupe([*out_axes, seq_k])
        local_qk = 2 * sp.Mul(*[ax.extent / _degree(lay[ax]) for ax in idx])
        global_qk = 2 * sp.Mul(*[ax.extent for ax in idx])
        local_av = 2 * sp.Mul(*[ax.extent / _degree(lay[ax]) for ax in idx_av])
        global_av = 2 * sp.Mul(*[ax.extent for ax in idx_av])
        self._record(
            Op(
                kind=OpKind.ATTENTION,
                name=name,
                inputs=(q, k2, v2),
                outputs=(out, lse),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
                flops=local_qk + local_av,
                global_flops=global_qk + global_av,
                bytes=q.local_bytes
                + k2.local_bytes
                + v2.local_bytes
                + out.local_bytes
                + lse.local_bytes,
                saved=(q, k2, v2, out, lse),
                matmul=True,
                axes_iter=tuple(idx),
                layout_iter=tuple(lay[ax] for ax in idx),
            )
        )
        return out

    def cross_entropy(
        self, name: str, logits: Tensor, class_axis: Axis, out_axes: Sequence[Axis]
    ) -> Tensor:
        """Vocab-parallel cross-entropy: three fp32 all-reduces of per-token scalars (max, target
        logit, sum of exponentials) over the mesh axes splitting the class axis; keeps the fp32
        softmax of the local logits for backward."""
        split = logits.split_of(class_axis)
        tok_layout = [ms for ax, ms in zip(logits.axes, logits.layout) if ax is not class_axis]
        stats = self.tensor(f"{name}_stats", Role.ACTIVATION, out_axes, tok_layout, 4)
        for i in range(3):
            partial_stat = Tensor(
                name=f"{name}_stat{i}",
                role=Role.ACTIVATION,
                axes=stats.axes,
                layout=stats.layout,
                dtype_bytes=sp.Integer(4),
                scope=self._scope,
                partial=frozenset(split),
            )
            self.redistribute(partial_stat, stats.layout)
        probs = self.tensor(f"{name}_probs", Role.ACTIVATION, logits.axes, logits.layout, 4)
        loss = self.tensor(name, Role.ACTIVATION, out_axes, tok_layout, 4)
        n = logits.local_numel
        self._record(
            Op(
                kind=OpKind.LOSS,
                name=name,
                inputs=(logits,),
                outputs=(loss,),
                phase=Phase.FORWARD,
                scope=self._scope,
                flops=CROSS_ENTROPY.fwd_flops_per_elem * n,
                global_flops=CROSS_ENTROPY.fwd_flops_per_elem * logits.numel,
                bytes=logits.local_bytes + probs.local_bytes,
                saved=(probs,),
                elementwise=CROSS_ENTROPY,
            )
        )
        self.loss = loss
        return loss

    # ------------------------------------------------------------------ backward
    def derive_backward(self, seed: Tensor | None = None) -> None:
        """Append the backward ops of every forward op recorded so far, in reverse order.

        ``seed`` is the tensor whose gradient arrives from outside (the next pipeline section's
        input gradient); without it the loss is the root.
        """
        forward = [op for op in self.ops if op.phase is Phase.FORWARD]
        grads = self.grads
        root = seed if seed is not None else self.loss
        assert root is not None, "no loss and no seed gradient"
        grads[root] = self._grad_like(root, root.layout)
        regathered: dict = {}
        for op in reversed(forward):
            outs = [t for t in op.outputs if t in grads]
            if not outs:
                continue
            with self.scope(op.scope), self.region(op.region):
                self._backward_of(op, grads, regathered)
        self.input_grad = {t: g for t, g in grads.items() if self.producer.get(t) is None}

    def _grad_like(self, t: Tensor, layout: Layout, partial: Iterable[MeshAxis] = ()) -> Tensor:
        return Tensor(
            name=f"d_{t.name}",
            role=Role.GRAD if t.role is Role.WEIGHT else Role.ACTIVATION_GRAD,
            axes=t.axes,
            layout=layout,
            dtype_bytes=t.dtype_bytes,
            scope=self._scope,
            partial=frozenset(partial),
        )

    def _resolved(self, grads: dict[Tensor, Tensor], t: Tensor) -> Tensor:
        g = grads[t]
        if g.partial:
            g = self.redistribute(g, t.layout, phase=Phase.BACKWARD)
            grads[t] = g
        return g

    def _need(self, t: Tensor, regathered: dict) -> Tensor:
        """A saved tensor as backward reads it: all-gathers that were not kept are reissued,
        once per kept tensor and layout (views of one gathered tensor share the regather)."""
        src = self.gathered_source(t)
        if src is t:
            return t
        key = (src, tuple(tuple(ms) for ms in t.layout))
        if key not in regathered:
            regathered[key] = self.redistribute(src, t.layout, phase=Phase.BACKWARD, regather=True)
        again = regathered[key]
        if again.axes != t.axes:  # the same data indexed like the saved view
            again = Tensor(
                name=t.name,
                role=t.role,
                axes=t.axes,
                layout=t.layout,
                dtype_bytes=t.dtype_bytes,
                scope=t.scope,
            )
        return again

    def _accumulate(self, grads: dict[Tensor, Tensor], t: Tensor, g: Tensor) -> None:
        if t.role is Role.INPUT:
            return
        if t not in grads:
            grads[t] = g
            return
        old = grads[t]
        producer = self.ops[-1] if self.ops and g in self.ops[-1].outputs else None
        if (
            producer is not None
            and producer.kind is OpKind.EINSUM
            and old.partial == g.partial
            and old.layout == g.layout
        ):
            # the GEMM accumulates into the existing gradient (C = AB + C): no extra kernel,
            # one more read of C
            producer.bytes = producer.bytes + old.local_bytes
            producer.outputs = (g,)
            grads[t] = g
            return
        if old.partial != g.partial:
            old = self.redistribute(old, t.layout, phase=Phase.BACKWARD)
            g = self.redistribute(g, t.layout, phase=Phase.BACKWARD)
        assert old.layout == g.layout, (t.name, old.layout, g.layout)
        total = self._grad_like(t, old.layout, old.partial)
        self._record(
            Op(
                kind=OpKind.ELEMENTWISE,
                name=f"accumulate:{t.name}",
                inputs=(old, g),
                outputs=(total,),
                phase=Phase.BACKWARD,
                scope=self._scope,
                flops=old.local_numel,
                global_flops=old.numel,
                bytes=3 * old.local_bytes,
                elementwise=ACCUMULATE,
            )
        )
        grads[t] = total

    def _backward_of(self, op: Op, grads: dict[Tensor, Tensor], regathered: dict) -> None:
        kind = op.kind
        if kind is OpKind.VIEW:
            (x,), (y,) = op.inputs, op.outputs
            g = grads[y]
            self._accumulate(grads, x, self._grad_like(x, g.layout, g.partial))
            return
        if kind is OpKind.PERMUTE:
            (y,) = op.outputs
            dy = self._resolved(grads, y)
            x = op.inputs[0]
            dx = self._grad_like(x, x.layout)
            outs = [dx]
            if len(op.inputs) > 1:  # the copied-in second operand (routing weights, ...)
                w = op.inputs[1]
                # ranks that split the output but hold the whole operand each add their part
                spread = {a for ms in y.layout for a in ms} - {a for ms in w.layout for a in ms}
                outs.append(self._grad_like(w, w.layout, spread))
            self._record(
                Op(
                    kind=OpKind.PERMUTE,
                    name=f"d_{op.name}",
                    inputs=(dy, *(self._need(t, regathered) for t in op.saved)),
                    outputs=tuple(outs),
                    phase=Phase.BACKWARD,
                    scope=self._scope,
                    region=self._region,
                    flops=2 * op.flops,
                    global_flops=2 * op.global_flops,
                    bytes=dy.local_bytes
                    + sum((t.local_bytes for t in op.saved), sp.Integer(0))
                    + sum((t.local_bytes for t in outs), sp.Integer(0)),
                )
            )
            for t, d in zip(op.inputs, outs):
                self._accumulate(grads, t, d)
            return
        if kind is OpKind.COLLECTIVE:
            (x,), (y,) = op.inputs, op.outputs
            g = grads[y]
            if op.coll is CollKind.ALL_REDUCE:
                # d(sum of partials)/d(partial) is the incoming gradient itself, on every rank.
                if g.partial:
                    g = self._resolved(grads, y)
                self._accumulate(grads, x, self._grad_like(x, g.layout))
                return
            dx = self.redistribute(g, x.layout, phase=Phase.BACKWARD)
            self._accumulate(grads, x, dx if dx is not g else self._grad_like(x, dx.layout))
            return
        if kind is OpKind.EINSUM:
            (y,) = op.outputs
            dy = self._resolved(grads, y)
            a, b = op.inputs
            for this, other in ((a, b), (b, a)):
                if this.role is Role.INPUT:
                    continue
                other_now = self._need(other, regathered)
                d = self.einsum(
                    f"d_{this.name}<-{op.name}",
                    dy,
                    other_now,
                    this.axes,
                    role=Role.GRAD if this.role is Role.WEIGHT else Role.ACTIVATION_GRAD,
                    phase=Phase.BACKWARD,
                    save=False,
                )
                # operands already share one iteration layout, so the gradient lands in the
                # primal's layout with any partial sum still pending
                assert d.layout == this.layout, (op.name, d.layout, this.layout)
                self._accumulate(grads, this, d)
            return
        if kind is OpKind.ATTENTION:
            out = op.outputs[0]
            dy = self._resolved(grads, out)
            q, k, v = op.inputs
            k_now, v_now = self._need(k, regathered), self._need(v, regathered)
            q_split = {m for ms in q.layout for m in ms}
            k_split = {m for ms in k.layout for m in ms}
            over = frozenset(q_split - k_split)
            dq = self._grad_like(q, q.layout)
            dk = self._grad_like(k, k.layout, over)
            dv = self._grad_like(v, v.layout, over)
            self._record(
                Op(
                    kind=OpKind.ATTENTION,
                    name=f"d_{op.name}",
                    inputs=(dy, q, k_now, v_now, *op.outputs),
                    outputs=(dq, dk, dv),
                    phase=Phase.BACKWARD,
                    scope=self._scope,
                    region=self._region,
                    # 4 GEMMs of backward (2x forward) + QK^T rerun inside the kernel (0.5x)
                    flops=sp.Rational(5, 2) * op.flops,
                    global_flops=sp.Rational(5, 2) * op.global_flops,
                    bytes=2 * (q.local_bytes + k.local_bytes + v.local_bytes) + 2 * out.local_bytes,
                    matmul=True,
                    axes_iter=op.axes_iter,
                    layout_iter=op.layout_iter,
                )
            )
            self._accumulate(grads, q, dq)
            self._accumulate(grads, k, dk)
            self._accumulate(grads, v, dv)
            return
        if kind in (OpKind.ELEMENTWISE, OpKind.NORM, OpKind.BIAS, OpKind.LOSS):
            y = op.outputs[0]
            dy = self._resolved(grads, y)
            ew = op.elementwise
            assert ew is not None
            x = op.inputs[0]
            if kind is OpKind.ELEMENTWISE and ew.linear:
                for inp in op.inputs:
                    self._accumulate(grads, inp, self._grad_like(inp, dy.layout))
                return
            dxs = [self._grad_like(x, x.layout)]
            if kind is OpKind.BIAS:
                # d(x + b)/dx is the identity: the gradient passes on without a copy
                dxs = []
                self._accumulate(grads, x, self._grad_like(x, dy.layout, dy.partial))
            if kind is OpKind.ELEMENTWISE:
                dxs = [self._grad_like(inp, inp.layout) for inp in op.inputs]
            wgrads: list[tuple[Tensor, Tensor]] = []
            if kind in (OpKind.NORM, OpKind.BIAS):
                for p in op.inputs[1:]:
                    # reduce over the leading (token) axes: partial over the axes splitting them
                    lead = x.axes[: len(x.axes) - len(p.axes)]
                    over = {m for ax in lead for m in x.split_of(ax)}
                    wgrads.append((p, self._grad_like(p, p.layout, over)))
            n = x.local_numel
            flops = (ew.bwd_flops_per_elem if kind is not OpKind.BIAS else 0) * n + sum(
                (n for _ in wgrads), sp.Integer(0)
            )
            self._record(
                Op(
                    kind=kind,
                    name=f"d_{op.name}",
                    inputs=(dy, *(self._need(t, regathered) for t in op.saved)),
                    outputs=(*dxs, *(g for _, g in wgrads)),
                    phase=Phase.BACKWARD,
                    scope=self._scope,
                    region=self._region,
                    flops=flops,
                    global_flops=flops / n * x.numel,
                    bytes=dy.local_bytes
                    + sum((t.local_bytes for t in op.saved), sp.Integer(0))
                    + sum((d.local_bytes for d in dxs), sp.Integer(0)),
                    elementwise=ew,
                )
            )
            targets = op.inputs if kind is OpKind.ELEMENTWISE else (x,)
            for t, d in zip(targets, dxs):
                self._accumulate(grads, t, d)
            for p, g in wgrads:
                self._accumulate(grads, p, g)
            return
        if kind is OpKind.EMBEDDING:
            (y,) = op.outputs
            dy = self._resolved(grads, y)
            ids, table = op.inputs
            lead = ids.axes
            over = {m for ax in lead for m in ids.split_of(ax)}
            dtable = self._grad_like(table, table.layout, over)
            self._record(
                Op(
                    kind=OpKind.EMBEDDING,
                    name=f"d_{op.name}",
                    inputs=(dy, ids),
                    outputs=(dtable,),
                    phase=Phase.BACKWARD,
                    scope=self._scope,
                    flops=dy.local_numel,
                    global_flops=dy.numel,
                    bytes=2 * dy.local_bytes + ids.local_bytes,
                )
            )
            self._accumulate(grads, table, dtable)
            return
        raise AssertionError(f"no backward rule for {kind}")

    # ------------------------------------------------------------------ optimizer
    def sync_and_step(
        self,
        zero_stage: int,
        data_axes: Sequence[MeshAxis],
        *,
        param_bytes: int,
        grad_bytes: int,
        optimizer_bytes_per_param: int,
    ) -> None:
        """Gradient synchronization and the optimizer step for every stored weight.

        Gradients accumulate over micro-batches and are synchronized once per step (as
        Megatron-LM and DeepSpeed do) unless gradients are sharded: ZeRO-2 reduce-scatters every
        micro-batch, ZeRO-3 already did so in backward. ZeRO-1/2 all-gather the updated
        parameter shards after the step (Rajbhandari et al. SC20, sec. 7: same volume as an
        all-reduce). Remaining partial sums over non-data axes (norm weights under sequence
        parallelism) are all-reduced.
        """
        for w in self.weights:
            g = self.grads.get(w)
            if g is None:
                continue
            with self.scope(w.scope):
                if zero_stage == 0 or zero_stage == 3:
                    shard = self.redistribute(
                        g, w.layout, phase=Phase.BACKWARD, frequency=Frequency.PER_STEP
                    )
                else:
                    freq = Frequency.PER_STEP if zero_stage == 1 else Frequency.PER_MICROBATCH
                    shard = self.redistribute(
                        g, zero_layout(w, data_axes), phase=Phase.BACKWARD, frequency=freq
                    )
                n = shard.local_numel
                upd = self.tensor(w.name, Role.WEIGHT, w.axes, shard.layout, w.dtype_bytes)
                self._record(
                    Op(
                        kind=OpKind.OPTIMIZER,
                        name=f"step:{w.name}",
                        inputs=(shard,),
                        outputs=(upd,),
                        phase=Phase.OPTIMIZER,
                        scope=w.scope,
                        frequency=Frequency.PER_STEP,
                        flops=12 * n,
                        global_flops=12 * w.numel,
                        # read grad + master + states, write master + states + 16-bit weights
                        bytes=n * (grad_bytes + 2 * optimizer_bytes_per_param + param_bytes),
                    )
                )
                if zero_stage in (1, 2) and upd.layout != w.layout:
                    self.redistribute(
                        upd, w.layout, phase=Phase.OPTIMIZER, frequency=Frequency.PER_STEP
                    )


class _Ctx:
    def __init__(self, graph: Graph, attr: str, value: object) -> None:
        self.graph, self.attr, self.value = graph, attr, value

    def __enter__(self) -> None:
        self.old = getattr(self.graph, self.attr)
        setattr(self.graph, self.attr, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(self.graph, self.attr, self.old)


def _order(layout: list[list[MeshAxis]], target: Layout) -> Layout:
    """Order the mesh axes of each tensor axis as the target lists them."""
    out = []
    for ms, tgt in zip(layout, target):
        rank = {m: i for i, m in enumerate(tgt)}
        out.append(tuple(sorted(ms, key=lambda m: rank.get(m, -1))))
    return tuple(out)


def zero_layout(w: Tensor, over: Sequence[MeshAxis]) -> Layout:
    """Layout of a parameter's state shard under ZeRO: the first axis gains the data axes."""
    over = tuple(m for m in over if m not in w.split_mesh_axes)
    lay = [list(ms) for ms in w.layout]
    i = next((j for j, ms in enumerate(w.layout) if not ms), 0)
    lay[i] = [*lay[i], *over]
    return tuple(tuple(ms) for ms in lay)
