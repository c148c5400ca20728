"""Collectives derived from layout changes: the one place that maps a change of layout to a
collective.

:meth:`LayoutOps.redistribute` turns one layout into another and records the collectives that
change needs, per mesh axis:

=====================================  =================
source -> target on one mesh axis      collective
=====================================  =================
partial, target splits an axis on it   reduce-scatter
partial, target does not split on it   all-reduce
split, target does not split on it     all-gather
split, target splits another axis      all-to-all
not split, target splits               local slice (free)
=====================================  =================

All-reduces run before the reduce-scatter, except over :data:`REDUCED_AFTER_SCATTER` (the
replicas of hybrid sharding), which sum the scattered shard after it.

A collective's ``comm_bytes`` is its per-GPU buffer: the input for all-reduce, reduce-scatter
and all-to-all, the gathered output for all-gather. :meth:`LayoutOps.gathered_source` walks back
through all-gathers and views to the tensor actually kept when a gathered value is saved for
backward (the gather is then issued again in backward). :func:`zero_layout` is the layout of a
parameter's state shard under ZeRO.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp

from stage_dse.graph.ir import (
    CollKind,
    Frequency,
    Layout,
    Op,
    OpKind,
    Phase,
    Recorder,
    Tensor,
)
from stage_dse.spec.plan import MeshAxis

__all__ = ["REDUCED_AFTER_SCATTER", "LayoutOps", "zero_layout"]

REDUCED_AFTER_SCATTER = frozenset({MeshAxis.DR})
"""Axes whose partial sums are all-reduced after the reduce-scatter over the other axes, on the
scattered shard: hybrid sharding's replicas (PyTorch FSDP ``HYBRID_SHARD`` reduce-scatters in
the shard group, then all-reduces the shard across the replicate group; Megatron-LM's partial
distributed optimizer all-reduces the reduce-scattered shard across its instances). Other
partial sums are all-reduced first (Megatron-LM sums sequence-parallel norm gradients over the
tensor-parallel group before the data-parallel sync)."""


class LayoutOps(Recorder):
    """A recorder that can change the layout of a tensor, recording the collectives it takes."""

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
        # the replicas' sum waits for the scatter and moves the shard only
        late = all_reduce & REDUCED_AFTER_SCATTER if reduce_scatter else set()
        if all_reduce - late:
            early = all_reduce - late
            step(CollKind.ALL_REDUCE, early, cur.layout, cur.partial - early)
        if reduce_scatter:
            lay = [list(ms) for ms in cur.layout]
            for m in sorted(reduce_scatter, key=lambda x: target[tgt_owner[x]].index(x)):
                lay[tgt_owner[m]].append(m)
            step(CollKind.REDUCE_SCATTER, reduce_scatter, _order(lay, target), frozenset(late))
        if late:
            step(CollKind.ALL_REDUCE, late, cur.layout, frozenset())
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
