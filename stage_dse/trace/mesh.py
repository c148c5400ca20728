"""The device mesh of one plan: ranks, coordinates, communicator groups, in closed form.

What lives here: :class:`Mesh`, mapping a global rank to its coordinates on the mesh axes and
back (the first axis of the rank order varies fastest, as in the cost model), and the
communicator groups of each *group kind* (a set of mesh axes, or :data:`EMBEDDING`). Group ids
are dense from 1 and computed from coordinates (mixed radix over the axes outside the group),
so finding a rank's group, its members or its pipeline peers is O(1) per rank: linear in ranks
overall.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from stage_dse.spec import MeshAxis, ParallelPlan

__all__ = ["ASTRA_SIM_MAX_GROUP_ID", "EMBEDDING", "Mesh"]

EMBEDDING = "embedding"
"""Group kind of Megatron-LM's embedding groups: the first and last stage of each pipeline
(the ranks of a pipeline group at its two ends). Every other kind is a set of mesh axes."""

ASTRA_SIM_MAX_GROUP_ID = 2147
"""A known simulator multiplies group ids by 10^6 in a 32-bit int: ids above this overflow."""


@dataclass
class Mesh:
    plan: ParallelPlan
    kinds: list[frozenset[MeshAxis]] = field(default_factory=list)
    """Group kinds in the order their ids were assigned."""

    def __post_init__(self) -> None:
        p = self.plan
        # EP is carved out of the data-parallel ranks (ep / tp of them with ep_over_tp), DR
        # holds the replicas of a hybrid-sharded group
        self.degree = p.mesh_degrees
        self.order = p.mesh_order
        self.stride: dict[MeshAxis, int] = {}
        acc = 1
        for axis in self.order:
            self.stride[axis] = acc
            acc *= self.degree[axis]
        self.world = acc
        self._base: dict[frozenset[MeshAxis], int] = {}
        self._next_id = 1

    def coords(self, rank: int) -> dict[MeshAxis, int]:
        return {a: (rank // self.stride[a]) % self.degree[a] for a in self.order}

    def rank_of(self, coords: dict[MeshAxis, int]) -> int:
        return sum(coords[a] * self.stride[a] for a in self.order)

    def ranks_of_stage(self, stage: int) -> np.ndarray:
        ranks = np.arange(self.world)
        return ranks[(ranks // self.stride[MeshAxis.PP]) % self.degree[MeshAxis.PP] == stage]

    # ------------------------------------------------------------------ groups
    def register(self, kinds: Iterable[frozenset[MeshAxis]]) -> None:
        """Assign dense ids to every group of these kinds (in a fixed, deterministic order)."""

        def order_key(kind) -> list[str]:
            if kind == EMBEDDING:
                return ["~"]  # after every axis-set kind
            return [a.value for a in self.order if a in kind]

        for kind in sorted(set(kinds), key=order_key):
            if kind in self._base or self.group_size(kind) == 1:
                continue
            self._base[kind] = self._next_id
            self.kinds.append(kind)
            self._next_id += self.num_groups(kind)

    def _axes(self, kind) -> frozenset[MeshAxis]:
        """The mesh axes a kind's groups vary along (an embedding group: the pipeline axis)."""
        return frozenset({MeshAxis.PP}) if kind == EMBEDDING else kind

    def _offsets(self, kind) -> np.ndarray:
        """Rank offsets of a group's members from its first rank, sorted."""
        if kind == EMBEDDING:
            last = (self.degree[MeshAxis.PP] - 1) * self.stride[MeshAxis.PP]
            return np.unique(np.array([0, last], dtype=np.int64))
        offsets = np.zeros(1, dtype=np.int64)
        for a in self.order:
            if a in kind:
                step = np.arange(self.degree[a], dtype=np.int64) * self.stride[a]
                offsets = (offsets[None, :] + step[:, None]).ravel()
        return np.sort(offsets)

    def group_size(self, kind) -> int:
        if kind == EMBEDDING:
            return len(self._offsets(kind))
        return int(np.prod([self.degree[a] for a in kind])) if kind else 1

    def num_groups(self, kind) -> int:
        return self.world // int(np.prod([self.degree[a] for a in self._axes(kind)]))

    @property
    def num_group_ids(self) -> int:
        return self._next_id - 1

    def group_id(self, kind: frozenset[MeshAxis], rank: int) -> int:
        """Id of the group of ``kind`` holding ``rank`` (0 when the group is the rank alone)."""
        if kind not in self._base:
            return 0
        c = self.coords(rank)
        axes = self._axes(kind)
        index, radix = 0, 1
        for a in self.order:
            if a in axes:
                continue
            index += c[a] * radix
            radix *= self.degree[a]
        return self._base[kind] + index

    def members(self, kind, rank: int) -> list[int]:
        c = self.coords(rank)
        axes = self._axes(kind)
        base = self.rank_of({a: (0 if a in axes else c[a]) for a in self.order})
        return (base + self._offsets(kind)).tolist()

    def groups_json(self) -> dict[str, list[int]]:
        """``{"<id>": [ranks]}`` for every registered group, built per kind in closed form."""
        out: dict[str, list[int]] = {}
        for kind in self.kinds:
            others = [a for a in self.order if a not in self._axes(kind)]
            offsets = self._offsets(kind)
            base = self._base[kind]
            for i, start in enumerate(self._group_starts(others)):
                out[str(base + i)] = (start + offsets).tolist()
        return out

    def _group_starts(self, others: list[MeshAxis]) -> list[int]:
        """First rank of each group, in id order (first 'other' axis varies fastest)."""
        starts = [0]
        for a in others:
            starts = [s + k * self.stride[a] for k in range(self.degree[a]) for s in starts]
        return starts

    def pp_peer(self, rank: int, delta: int) -> int:
        c = self.coords(rank)
        c[MeshAxis.PP] += delta
        return self.rank_of(c)
