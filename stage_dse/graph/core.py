"""The symbolic tensor graph of one model section: parameters, forward, backward, optimizer.

What lives here: :class:`Graph`, which declares parameters (stored sharded and gathered before
use under ZeRO-3), records forward ops through the builders of :mod:`stage_dse.graph.forward`,
derives backward by the per-op-kind rules of :mod:`stage_dse.graph.backward`, and appends the
gradient synchronization and optimizer step. What does not: the data model
(:mod:`stage_dse.graph.ir`), layout-to-collective rules (:mod:`stage_dse.graph.layout`), any
particular model (:mod:`stage_dse.graph.transformer`), any aggregation into costs
(:mod:`stage_dse.cost`), and any I/O.

All sizes are sympy expressions of :class:`stage_dse.graph.symbols.Symbols`; ``flops`` and
``bytes`` of an op are per GPU (local extents), ``global_flops`` over the whole mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp

from stage_dse.graph.backward import derive_backward
from stage_dse.graph.forward import ForwardOps
from stage_dse.graph.ir import Axis, Frequency, Op, OpKind, Phase, Role, Tensor
from stage_dse.graph.layout import zero_layout
from stage_dse.spec.plan import MeshAxis

__all__ = ["Graph"]


class Graph(ForwardOps):
    """Records forward ops of one model section and derives backward and its collectives."""

    def __init__(self, grad_bytes: int | None = None) -> None:
        super().__init__()
        self.grad_bytes = grad_bytes
        """Bytes per element of parameter gradients (fp32 main grads: 4), which the weight-
        gradient GEMMs write and the data-parallel collectives move; None: the parameter's."""
        self.weights: list[Tensor] = []
        self.block_input: Tensor | None = None
        self.loss: Tensor | None = None
        self.weight_storage: dict[Tensor, Tensor] = {}
        """Compute-layout weight -> stored weight, when they differ (ZeRO-3)."""
        self._computed: dict[Tensor, Tensor] = {}
        """Stored weight -> compute-layout weight (the inverse of ``weight_storage``)."""
        self.grads: dict[Tensor, Tensor] = {}
        """Gradient of each forward tensor after :meth:`derive_backward` (may be partial)."""
        self.input_grad: dict[Tensor, Tensor] = {}
        self.fused_elementwise = True
        """Element-wise ops run fused (off: eagerly, :func:`stage_dse.graph.eager.run_eagerly`)."""

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

    def derive_backward(self, seed: Tensor | None = None) -> None:
        """Append the backward ops of every forward op recorded so far, in reverse order (rules
        in :mod:`stage_dse.graph.backward`).

        ``seed`` is the tensor whose gradient arrives from outside (the next pipeline section's
        input gradient); without it the loss is the root.
        """
        grads = derive_backward(self, seed)
        self.input_grad = {t: g for t, g in grads.items() if self.producer.get(t) is None}

    def sync_and_step(
        self,
        zero_stage: int,
        data_axes: Sequence[MeshAxis],
        *,
        param_bytes: int,
        grad_bytes: int,
        optimizer_bytes_per_param: int,
        grad_sync_per_step: bool = False,
    ) -> None:
        """Gradient synchronization and the optimizer step for every stored weight.

        Gradients accumulate over micro-batches and are synchronized once per step (as
        Megatron-LM and DeepSpeed do) unless gradients are sharded: ZeRO-2 reduce-scatters every
        micro-batch (once per step with ``grad_sync_per_step``: FSDP's ``no_sync``), ZeRO-3
        already did so in backward. ZeRO-1/2 all-gather the updated
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
                    once = zero_stage == 1 or grad_sync_per_step
                    freq = Frequency.PER_STEP if once else Frequency.PER_MICROBATCH
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
