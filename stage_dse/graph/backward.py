"""Backward rules: one function per forward op kind, looked up in :data:`BACKWARD_RULES`.

What lives here: :func:`derive_backward`, which walks a graph's forward ops in reverse and calls
the rule registered for each op's :class:`~stage_dse.graph.ir.OpKind`, and the rules themselves.
A rule reads the gradient of the op's outputs, records the backward kernels (through the same
builders as forward, so collectives of the backward pass follow from the same layout rules) and
adds the gradient of each input. Adding an op kind means a builder in
:mod:`stage_dse.graph.forward` and a rule here, registered under the same kind.

Conventions every rule follows:

* the gradient of a tensor has the tensor's layout and may carry a pending partial sum; a rule
  that needs it whole resolves it first (:meth:`Backward.resolved`);
* a tensor saved for backward that was produced by an all-gather is not kept: its source is
  kept and the gather is issued again (:meth:`Backward.need`), as Megatron-LM does under
  sequence parallelism and FSDP does for parameters;
* gradients reaching one tensor from several consumers are summed (:meth:`Backward.accumulate`);
  a GEMM that produces the second contribution accumulates in place (C = AB + C).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy as sp

from stage_dse.graph.ir import (
    ACCUMULATE,
    CollKind,
    Layout,
    Op,
    OpKind,
    Phase,
    Role,
    Tensor,
)
from stage_dse.spec.plan import MeshAxis

__all__ = ["BACKWARD_RULES", "Backward", "async_partners", "derive_backward"]


class Backward:
    """The state of one backward derivation over a graph: gradients and reissued gathers."""

    def __init__(self, graph, grads: dict[Tensor, Tensor]) -> None:
        self.g = graph
        self.grads = grads
        self.regathered: dict = {}

    def grad_dtype(self, t: Tensor) -> sp.Expr:
        """Bytes per element of ``t``'s gradient: a parameter's follow the gradient dtype."""
        if t.role is Role.WEIGHT and self.g.grad_bytes is not None:
            return sp.Integer(self.g.grad_bytes)
        return t.dtype_bytes

    def grad_like(self, t: Tensor, layout: Layout, partial: Iterable[MeshAxis] = ()) -> Tensor:
        return Tensor(
            name=f"d_{t.name}",
            role=Role.GRAD if t.role is Role.WEIGHT else Role.ACTIVATION_GRAD,
            axes=t.axes,
            layout=layout,
            dtype_bytes=self.grad_dtype(t),
            scope=self.g._scope,
            partial=frozenset(partial),
        )

    def resolved(self, t: Tensor) -> Tensor:
        """The gradient of ``t`` with any pending partial sum reduced."""
        g = self.grads[t]
        if g.partial:
            g = self.g.redistribute(g, t.layout, phase=Phase.BACKWARD)
            self.grads[t] = g
        return g

    def need(self, t: Tensor) -> Tensor:
        """A saved tensor as backward reads it: all-gathers that were not kept are reissued,
        once per kept tensor and layout (views of one gathered tensor share the regather)."""
        src = self.g.gathered_source(t)
        if src is t:
            return t
        key = (src, tuple(tuple(ms) for ms in t.layout))
        if key not in self.regathered:
            self.regathered[key] = self.g.redistribute(
                src, t.layout, phase=Phase.BACKWARD, regather=True
            )
        again = self.regathered[key]
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

    def accumulate(self, t: Tensor, g: Tensor) -> None:
        grads, graph = self.grads, self.g
        if t.role is Role.INPUT:
            return
        if t not in grads:
            grads[t] = g
            return
        old = grads[t]
        producer = graph.ops[-1] if graph.ops and g in graph.ops[-1].outputs else None
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
            old = graph.redistribute(old, t.layout, phase=Phase.BACKWARD)
            g = graph.redistribute(g, t.layout, phase=Phase.BACKWARD)
        assert old.layout == g.layout, (t.name, old.layout, g.layout)
        total = self.grad_like(t, old.layout, old.partial)
        graph._record(
            Op(
                kind=OpKind.ELEMENTWISE,
                name=f"accumulate:{t.name}",
                inputs=(old, g),
                outputs=(total,),
                phase=Phase.BACKWARD,
                scope=graph._scope,
                flops=old.local_numel,
                global_flops=old.numel,
                bytes=3 * old.local_bytes,
                elementwise=ACCUMULATE,
            )
        )
        grads[t] = total

    def record(self, op: Op, **fields) -> None:
        """Record the backward kernel of forward ``op`` in the current scope and region."""
        self.g._record(
            Op(
                kind=op.kind,
                name=f"d_{op.name}",
                phase=Phase.BACKWARD,
                scope=self.g._scope,
                region=self.g._region,
                **fields,
            )
        )


Rule = Callable[[Backward, Op], None]


def derive_backward(graph, seed: Tensor | None = None) -> dict[Tensor, Tensor]:
    """Append the backward ops of every forward op of ``graph`` recorded so far, in reverse order;
    returns the gradient of every forward tensor (may be partial).

    ``seed`` is the tensor whose gradient arrives from outside (the next pipeline section's
    input gradient); without it the loss is the root.
    """
    forward = [op for op in graph.ops if op.phase is Phase.FORWARD]
    bw = Backward(graph, graph.grads)
    root = seed if seed is not None else graph.loss
    assert root is not None, "no loss and no seed gradient"
    bw.grads[root] = bw.grad_like(root, root.layout)
    for op in reversed(forward):
        if not any(t in bw.grads for t in op.outputs):
            continue
        rule = BACKWARD_RULES.get(op.kind)
        if rule is None:
            raise AssertionError(f"no backward rule for {op.kind}")
        with graph.scope(op.scope), graph.region(op.region), graph.module(op.module):
            rule(bw, op)
    return bw.grads


# --------------------------------------------------------------------------- rules
def _view(bw: Backward, op: Op) -> None:
    """A view's gradient is the output gradient under the input's axes."""
    (x,), (y,) = op.inputs, op.outputs
    g = bw.grads[y]
    bw.accumulate(x, bw.grad_like(x, g.layout, g.partial))


def _permute(bw: Backward, op: Op) -> None:
    """Rows copied back (and, with a second operand, the weighted-combine gradient of it)."""
    (y,) = op.outputs
    dy = bw.resolved(y)
    x = op.inputs[0]
    dx = bw.grad_like(x, x.layout)
    outs = [dx]
    if len(op.inputs) > 1:  # the copied-in second operand (routing weights, ...)
        w = op.inputs[1]
        # ranks that split the output but hold the whole operand each add their part
        spread = {a for ms in y.layout for a in ms} - {a for ms in w.layout for a in ms}
        outs.append(bw.grad_like(w, w.layout, spread))
    bw.record(
        op,
        inputs=(dy, *(bw.need(t) for t in op.saved)),
        outputs=tuple(outs),
        flops=2 * op.flops,
        global_flops=2 * op.global_flops,
        bytes=dy.local_bytes
        + sum((t.local_bytes for t in op.saved), sp.Integer(0))
        + sum((t.local_bytes for t in outs), sp.Integer(0)),
    )
    for t, d in zip(op.inputs, outs):
        bw.accumulate(t, d)


def _collective(bw: Backward, op: Op) -> None:
    """The reverse redistribution; an all-reduce's gradient passes through whole."""
    (x,), (y,) = op.inputs, op.outputs
    g = bw.grads[y]
    if op.coll is CollKind.ALL_REDUCE:
        # d(sum of partials)/d(partial) is the incoming gradient itself, on every rank.
        if g.partial:
            g = bw.resolved(y)
        bw.accumulate(x, bw.grad_like(x, g.layout))
        return
    dx = bw.g.redistribute(g, x.layout, phase=Phase.BACKWARD)
    bw.accumulate(x, dx if dx is not g else bw.grad_like(x, dx.layout))


def _einsum(bw: Backward, op: Op) -> None:
    """Two einsums: each operand's gradient contracts the output gradient with the other."""
    (y,) = op.outputs
    dy = bw.resolved(y)
    a, b = op.inputs
    for this, other in ((a, b), (b, a)):
        if this.role is Role.INPUT:
            continue
        other_now = bw.need(other)
        d = bw.g.einsum(
            f"d_{this.name}<-{op.name}",
            dy,
            other_now,
            this.axes,
            role=Role.GRAD if this.role is Role.WEIGHT else Role.ACTIVATION_GRAD,
            phase=Phase.BACKWARD,
            save=False,
            out_dtype_bytes=bw.grad_dtype(this),
            fused_width=op.fused_width,
        )
        # operands already share one iteration layout, so the gradient lands in the
        # primal's layout with any partial sum still pending
        assert d.layout == this.layout, (op.name, d.layout, this.layout)
        bw.accumulate(this, d)


def _attention(bw: Backward, op: Op) -> None:
    """One fused backward kernel; key/value gradients are partial over the mesh axes that split
    queries but not keys (context-parallel ranks each add their part)."""
    out = op.outputs[0]
    dy = bw.resolved(out)
    q, k, v = op.inputs
    k_now, v_now = bw.need(k), bw.need(v)
    q_split = {m for ms in q.layout for m in ms}
    k_split = {m for ms in k.layout for m in ms}
    over = frozenset(q_split - k_split)
    dq = bw.grad_like(q, q.layout)
    dk = bw.grad_like(k, k.layout, over)
    dv = bw.grad_like(v, v.layout, over)
    bw.record(
        op,
        inputs=(dy, q, k_now, v_now, *op.outputs),
        outputs=(dq, dk, dv),
        # 4 GEMMs of backward (2x forward) + QK^T rerun inside the kernel (0.5x)
        flops=sp.Rational(5, 2) * op.flops,
        global_flops=sp.Rational(5, 2) * op.global_flops,
        bytes=2 * (q.local_bytes + k.local_bytes + v.local_bytes) + 2 * out.local_bytes,
        matmul=True,
        executed_fraction=op.executed_fraction,
        axes_iter=op.axes_iter,
        layout_iter=op.layout_iter,
    )
    bw.accumulate(q, dq)
    bw.accumulate(k, dk)
    bw.accumulate(v, dv)


def _param_grads(bw: Backward, op: Op) -> list[tuple[Tensor, Tensor]]:
    """Per-channel parameter gradients of a norm or bias: reduced over the leading (token) axes,
    so partial over the mesh axes splitting them."""
    x = op.inputs[0]
    out = []
    for p in op.inputs[1:]:
        lead = x.axes[: len(x.axes) - len(p.axes)]
        over = {m for ax in lead for m in x.split_of(ax)}
        out.append((p, bw.grad_like(p, p.layout, over)))
    return out


def _pointwise_kernel(
    bw: Backward,
    op: Op,
    dy: Tensor,
    dxs: list[Tensor],
    wgrads: list[tuple[Tensor, Tensor]],
    per_elem_flops: int,
) -> None:
    """Record the backward kernel of a pointwise op: ``per_elem_flops`` per input element plus
    one per element for each parameter gradient reduction."""
    x = op.inputs[0]
    n = x.local_numel
    flops = per_elem_flops * n + sum((n for _ in wgrads), sp.Integer(0))
    bw.record(
        op,
        inputs=(dy, *(bw.need(t) for t in op.saved)),
        outputs=(*dxs, *(g for _, g in wgrads)),
        flops=flops,
        global_flops=flops / n * x.numel,
        bytes=dy.local_bytes
        + sum((t.local_bytes for t in op.saved), sp.Integer(0))
        + sum((d.local_bytes for d in dxs), sp.Integer(0)),
        elementwise=op.elementwise,
    )


def _elementwise(bw: Backward, op: Op) -> None:
    """A linear kernel (residual add) passes the gradient to every input unchanged; any other
    kernel reads its saved values and writes one gradient per input."""
    dy = bw.resolved(op.outputs[0])
    ew = op.elementwise
    assert ew is not None
    if ew.linear:
        for inp in op.inputs:
            bw.accumulate(inp, bw.grad_like(inp, dy.layout))
        return
    dxs = [bw.grad_like(inp, inp.layout) for inp in op.inputs]
    _pointwise_kernel(bw, op, dy, dxs, [], ew.bwd_flops_per_elem)
    for t, d in zip(op.inputs, dxs):
        bw.accumulate(t, d)


def _norm(bw: Backward, op: Op) -> None:
    """Input gradient and the per-channel parameter gradients in one kernel (a loss has no
    parameters: softmax minus one-hot, from the kept fp32 probabilities)."""
    dy = bw.resolved(op.outputs[0])
    ew = op.elementwise
    assert ew is not None
    x = op.inputs[0]
    dxs = [bw.grad_like(x, x.layout)]
    wgrads = _param_grads(bw, op)
    _pointwise_kernel(bw, op, dy, dxs, wgrads, ew.bwd_flops_per_elem)
    bw.accumulate(x, dxs[0])
    for p, g in wgrads:
        bw.accumulate(p, g)


def _bias(bw: Backward, op: Op) -> None:
    """d(x + b)/dx is the identity: the gradient passes on without a copy; the kernel only
    reduces the bias gradient."""
    dy = bw.resolved(op.outputs[0])
    x = op.inputs[0]
    bw.accumulate(x, bw.grad_like(x, dy.layout, dy.partial))
    wgrads = _param_grads(bw, op)
    _pointwise_kernel(bw, op, dy, [], wgrads, 0)
    for p, g in wgrads:
        bw.accumulate(p, g)


def _embedding(bw: Backward, op: Op) -> None:
    """Scatter-add of the output gradient into the table's rows: partial over the mesh axes
    splitting the tokens."""
    (y,) = op.outputs
    dy = bw.resolved(y)
    ids, table = op.inputs
    over = {m for ax in ids.axes for m in ids.split_of(ax)}
    dtable = bw.grad_like(table, table.layout, over)
    bw.record(
        op,
        inputs=(dy, ids),
        outputs=(dtable,),
        flops=dy.local_numel,
        global_flops=dy.numel,
        bytes=2 * dy.local_bytes + ids.local_bytes,
    )
    bw.accumulate(table, dtable)


BACKWARD_RULES: dict[OpKind, Rule] = {
    OpKind.VIEW: _view,
    OpKind.PERMUTE: _permute,
    OpKind.COLLECTIVE: _collective,
    OpKind.EINSUM: _einsum,
    OpKind.ATTENTION: _attention,
    OpKind.ELEMENTWISE: _elementwise,
    OpKind.NORM: _norm,
    OpKind.BIAS: _bias,
    OpKind.LOSS: _norm,
    OpKind.EMBEDDING: _embedding,
}
"""The backward rule of each forward op kind (an optimizer step has none)."""


def async_partners(graph) -> dict[Op, Op]:
    """The GEMM each backward tensor-parallel collective runs under, as Megatron-LM issues them
    (``LinearWithGradAccumulationAndAsyncCommunication`` in ``megatron/core/tensor_parallel/
    layers.py``): the reduction (all-reduce, or reduce-scatter under sequence parallelism) of a
    linear layer's input gradient is launched before that layer's weight-gradient GEMM and runs
    under it; the all-gather of its input reissued for the weight gradient runs under the
    input-gradient GEMM. Chakra traces encode the same: neither GEMM depends on the other's
    collective. Keys are the collectives, values the GEMM each runs under; a collective is
    issued just before its GEMM, which does not wait for it."""
    backward = [op for op in graph.ops if op.phase is Phase.BACKWARD]
    dgrad: dict[str, Op] = {}
    wgrad: dict[str, Op] = {}
    producer: dict[object, Op] = {}
    for op in backward:
        for t in op.outputs:
            producer[t] = op
        if op.kind is OpKind.EINSUM and "<-" in op.name:
            source = op.name.split("<-", 1)[1]
            if op.outputs[0].role is Role.GRAD:
                wgrad[source] = op
            elif op.outputs[0].role is Role.ACTIVATION_GRAD:
                dgrad[source] = op
    partners: dict[Op, Op] = {}
    for op in backward:
        if not op.is_comm or op.group != {MeshAxis.TP}:
            continue
        if op.coll in (CollKind.ALL_REDUCE, CollKind.REDUCE_SCATTER):
            src = producer.get(op.inputs[0])
            if src is None or src.kind is not OpKind.EINSUM or "<-" not in src.name:
                continue
            source = src.name.split("<-", 1)[1]
            if dgrad.get(source) is src and source in wgrad:
                partners[op] = wgrad[source]
        elif op.coll is CollKind.ALL_GATHER and op.regather:
            for source, w in wgrad.items():
                if op.outputs[0] in w.inputs and source in dgrad:
                    partners[op] = dgrad[source]
                    break
    return partners
