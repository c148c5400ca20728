"""Forward op builders: each records one kernel of a model's forward pass.

What lives here: :class:`ForwardOps` with one builder per forward op kind (einsum, attention,
pointwise, norm, bias, embedding, cross-entropy, permute), each computing its per-GPU flops and
bytes from local extents and saying which tensors it keeps for backward. Operands in
incompatible layouts are redistributed first (:mod:`stage_dse.graph.layout`): an einsum whose
operands split different indices over one mesh axis gathers the activation operand (weights
never move except through ZeRO-3), and contracting a split index leaves a partial sum. The
backward of each op kind is in :mod:`stage_dse.graph.backward`, keyed by the same
:class:`~stage_dse.graph.ir.OpKind`.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp

from stage_dse.graph.dims import chunked_keys
from stage_dse.graph.ir import (
    ADD,
    CROSS_ENTROPY,
    Axis,
    Elementwise,
    Op,
    OpKind,
    Phase,
    Role,
    Tensor,
    dedupe,
    degree,
)
from stage_dse.graph.layout import LayoutOps
from stage_dse.spec.plan import MeshAxis

__all__ = [
    "ATTENTION_TILE",
    "ForwardOps",
    "banded_fraction",
    "causal_fraction",
    "chunked_fraction",
]

ATTENTION_TILE = 128
"""Query/key block of fused attention kernels: FlashAttention-2 uses 128 x 128 tiles for
head dimension 128 (Dao, "FlashAttention-2", 2023, sec. 3.3; FlashAttention-3 likewise)."""


def causal_fraction(seq: sp.Expr, tile: int = ATTENTION_TILE) -> sp.Expr:
    """Share of the full ``seq x seq`` score tiles a causal kernel computes: of ``T = seq/tile``
    tile rows, row ``i`` computes ``i + 1`` tiles (the diagonal tile whole), ``(T + 1) / 2T``
    = ``1/2 + tile / (2 seq)``; 1 when the sequence fits in one tile."""
    return sp.Min(1, sp.Rational(1, 2) + sp.Rational(tile, 2) / seq, evaluate=False)


def banded_fraction(seq: sp.Expr, window: sp.Expr, tile: int = ATTENTION_TILE) -> sp.Expr:
    """Share of the ``seq x seq`` score tiles a causal kernel with a sliding window of
    ``window`` positions computes: a tile row reaches back over the window, ``window / tile +
    1`` tiles with the diagonal one (FlashAttention-2's ``window_size`` skips the tiles left
    of the band, as it skips those above the diagonal), so ``(window + tile) / seq``, never
    more than the causal share (:func:`causal_fraction`)."""
    return sp.Min(causal_fraction(seq, tile), (window + tile) / seq, evaluate=False)


def chunked_fraction(seq: sp.Expr, chunk: sp.Expr, tile: int = ATTENTION_TILE) -> sp.Expr:
    """Share of the ``seq x seq`` score tiles a causal kernel with chunked attention computes:
    a query reaches back to the start of its aligned chunk (:func:`stage_dse.graph.dims.
    chunked_keys` keys in all), a band of that mean reach plus the diagonal tile
    (:func:`banded_fraction`); the causal share while ``seq <= chunk``."""
    return banded_fraction(seq, chunked_keys(seq, chunk) / seq, tile)


class ForwardOps(LayoutOps):
    """A recorder with the forward op builders."""

    def view(self, x: Tensor, axes: Sequence[Axis]) -> Tensor:
        """The same data indexed by other axes of equal extents (no copy, no cost)."""
        return self._alias(x, axes, x.name, x.role, f"view:{x.name}")

    def select(self, name: str, x: Tensor, axes: Sequence[Axis], role: Role) -> Tensor:
        """Some rows of ``x`` (a top-k selection) that the op reading the result gathers in
        place: no copy, no cost of its own; the result aliases ``x``."""
        return self._alias(x, axes, name, role, f"select:{x.name}")

    def _alias(self, x: Tensor, axes, name: str, role: Role, op_name: str) -> Tensor:
        """A view op: ``x``'s data under other axes, name and role."""
        out = Tensor(
            name=name,
            role=role,
            axes=tuple(axes),
            layout=x.layout,
            dtype_bytes=x.dtype_bytes,
            scope=self._scope,
            partial=x.partial,
        )
        self._record(
            Op(
                kind=OpKind.VIEW,
                name=op_name,
                inputs=(x,),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
            )
        )
        return out

    def permute(
        self,
        name: str,
        x: Tensor,
        axes: Sequence[Axis],
        layout: Sequence[Sequence[MeshAxis]],
        *,
        weights: Tensor | None = None,
        flops_per_elem: int = 0,
        keep_rows: bool = True,
    ) -> Tensor:
        """Copy rows of ``x`` into a tensor of other axes (token dispatch to experts, or the
        weighted combine back, with ``weights`` the routing probabilities). Local: the layout
        must keep every mesh axis on the rows' origin. A weighted copy keeps ``x`` and the
        weights for backward; ``keep_rows=False`` keeps the weights only (the weights'
        gradient is then formed where ``x`` was made)."""
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
                saved=(() if weights is None else (x, weights) if keep_rows else (weights,)),
            )
        )
        return out

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
        out_dtype_bytes: sp.Expr | int | None = None,
        fused_width: sp.Expr | int = 1,
    ) -> Tensor:
        """Contract ``a`` and ``b`` onto ``out_axes``; flops are 2 x the iteration-space size.
        The output has ``a``'s element size unless ``out_dtype_bytes`` says otherwise (a weight
        gradient accumulated in fp32); ``fused_width``: :attr:`Op.fused_width`."""
        assert not a.partial and not b.partial, (name, a.partial, b.partial)
        idx = dedupe([*a.axes, *b.axes])
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
        for ax in dedupe([*first.axes, *second.axes]):
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
            a.dtype_bytes if out_dtype_bytes is None else out_dtype_bytes,
            partial=partial,
        )
        local = sp.Mul(*[ax.extent / degree(it[ax]) for ax in idx])
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
                fused_width=sp.sympify(fused_width),
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
        """An element-wise kernel over same-shaped inputs (the first input's layout wins). A
        linear kernel may add pending partial sums of one layout: the result is one pending sum
        (the parallel block's two branches, reduced once)."""
        base = inputs[0]
        if base.partial:
            assert kind.linear, name
            assert all(x.layout == base.layout and x.partial == base.partial for x in inputs), name
            ins = list(inputs)
        else:
            ins = [base] + [self.redistribute(x, base.layout) for x in inputs[1:]]
            assert all(not x.partial for x in ins), name
        out = self.tensor(
            name,
            Role.ACTIVATION,
            base.axes,
            base.layout,
            base.dtype_bytes if out_dtype_bytes is None else out_dtype_bytes,
            partial=base.partial,
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
        self,
        name: str,
        ids: Tensor,
        table: Tensor,
        row_axis: Axis,
        out_axes: Sequence[Axis],
        out_dtype_bytes: sp.Expr | int | None = None,
    ) -> Tensor:
        """Row lookup; a table split over rows gives a partial sum (vocab-parallel embedding).
        The rows come out in the table's element size unless ``out_dtype_bytes`` says otherwise
        (a 4-bit table is dequantized to the activations' format)."""
        row_split = table.split_of(row_axis)
        col_axes = [ax for ax in table.axes if ax is not row_axis]
        layout = list(ids.layout) + [table.split_of(ax) for ax in col_axes]
        dtype = table.dtype_bytes if out_dtype_bytes is None else out_dtype_bytes
        out = self.tensor(name, Role.ACTIVATION, out_axes, layout, dtype, partial=row_split)
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
        *,
        causal: bool = False,
        window: sp.Expr | None = None,
        chunk: sp.Expr | None = None,
    ) -> Tensor:
        """Fused attention kernel: o = softmax(q k^T) v without materializing scores.

        Keys and values are needed whole along the key sequence (context parallel ring exchange
        gathers them). Saves q, k, v, o and the fp32 log-sum-exp; backward reruns q k^T.
        ``causal``: the kernel skips key tiles above the diagonal (:func:`causal_fraction`);
        with a sliding ``window`` also those left of the band (:func:`banded_fraction`); with
        chunked attention (``chunk``) those before each query's chunk
        (:func:`chunked_fraction`).
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
        idx = dedupe([*q.axes, *k2.axes])
        idx_av = dedupe([*out_axes, seq_k])
        local_qk = 2 * sp.Mul(*[ax.extent / degree(lay[ax]) for ax in idx])
        global_qk = 2 * sp.Mul(*[ax.extent for ax in idx])
        local_av = 2 * sp.Mul(*[ax.extent / degree(lay[ax]) for ax in idx_av])
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
                executed_fraction=(
                    sp.Integer(1)
                    if not causal
                    else chunked_fraction(seq_q.extent, chunk)
                    if chunk is not None
                    else causal_fraction(seq_q.extent)
                    if window is None
                    else banded_fraction(seq_q.extent, window)
                ),
                axes_iter=tuple(idx),
                layout_iter=tuple(lay[ax] for ax in idx),
            )
        )
        return out

    def index_scores(
        self, name: str, q: Tensor, keys: Tensor, out_axes: Sequence[Axis], *, causal: bool
    ) -> Tensor:
        """A fused scoring kernel, every query against every key, contracting all axes but
        ``out_axes`` (DeepSeek Sparse Attention's indexer: heads and head width): one
        attention-class kernel, as the sparse-attention kernels run it, that skips the tiles
        above the diagonal when ``causal``. Serving only (no backward rule)."""
        out = self.tensor(
            name, Role.ACTIVATION, out_axes, [dict(zip(q.axes, q.layout)).get(ax, ())
                                              if ax in q.axes else ()
                                              for ax in out_axes], 4,
        )  # fmt: skip
        lay = {**dict(zip(keys.axes, keys.layout)), **dict(zip(q.axes, q.layout))}
        idx = dedupe([*q.axes, *keys.axes])
        local = 2 * sp.Mul(*[ax.extent / degree(lay[ax]) for ax in idx])
        seq_q = next(ax for ax in out_axes if ax in q.axes and ax not in keys.axes)
        self._record(
            Op(
                kind=OpKind.ATTENTION,
                name=name,
                inputs=(q, keys),
                outputs=(out,),
                phase=Phase.FORWARD,
                scope=self._scope,
                region=self._region,
                flops=local,
                global_flops=2 * sp.Mul(*[ax.extent for ax in idx]),
                bytes=q.local_bytes + keys.local_bytes + out.local_bytes,
                matmul=True,
                executed_fraction=causal_fraction(seq_q.extent) if causal else sp.Integer(1),
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
