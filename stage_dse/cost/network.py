"""Collective and point-to-point times on a hierarchical network (the alpha-beta part of
:mod:`stage_dse.cost.time`, whose module docstring describes the model and its sources)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import sympy as sp

from stage_dse.cost.derive import CostKey
from stage_dse.cost.expr import _max, _min
from stage_dse.cost.kernel_time import Kernel, KernelSet
from stage_dse.graph.ir import CollKind, Op
from stage_dse.graph.symbols import DEGREE, S
from stage_dse.spec import MeshAxis

__all__ = [
    "collective_time",
    "domain_collective_time",
    "embedding_sync_time",
    "group_tiers",
    "pipeline_hop_time",
]


def group_tiers(
    group: Iterable[MeshAxis], rank_order: tuple[MeshAxis, ...]
) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """(members per scale-up domain, domains spanned, span of global ranks) of a group.

    With the first axis of ``rank_order`` varying fastest, axis ``a`` has stride ``s_a`` (product
    of the degrees before it); a node of ``N`` consecutive ranks holds ``min(d_a, N / s_a)``
    values of it (at least one). Exact when degrees and ``N`` are powers of two.
    """
    group = set(group)
    stride = _strides(rank_order)
    n: sp.Expr = sp.Integer(1)
    span: sp.Expr = sp.Integer(1)
    for axis in rank_order:
        if axis in group:
            n *= DEGREE[axis]
            span += stride[axis] * (DEGREE[axis] - 1)
    n_in = members_within(group, rank_order, S.gpus_per_node)
    return n_in, n / n_in, span


def _strides(rank_order: tuple[MeshAxis, ...]) -> dict[MeshAxis, sp.Expr]:
    """Each mesh axis's stride over global ranks (the product of the degrees before it)."""
    stride: dict[MeshAxis, sp.Expr] = {}
    acc: sp.Expr = sp.Integer(1)
    for axis in rank_order:
        stride[axis] = acc
        acc = acc * DEGREE[axis]
    return stride


def members_within(
    group: Iterable[MeshAxis], rank_order: tuple[MeshAxis, ...], block: sp.Expr
) -> sp.Expr:
    """Members of a group among ``block`` consecutive ranks (at least one): axis ``a`` of
    stride ``s_a`` has ``min(d_a, block / s_a)`` values there. ``block`` is a scale-up domain
    (``gpus_per_node``, :func:`group_tiers`) or a pod (``pod_gpus``)."""
    group = set(group)
    stride = _strides(rank_order)
    members: sp.Expr = sp.Integer(1)
    for axis in rank_order:
        if axis in group:
            members *= _max(1, _min(DEGREE[axis], block / stride[axis]))
    return members


def _ring(
    kind: CollKind,
    n_in: sp.Expr,
    n_out: sp.Expr,
    size_bytes: sp.Expr,
    bw_in: sp.Expr,
    bw_out: sp.Expr,
    a_in: sp.Expr,
    a_out: sp.Expr,
    base: sp.Expr,
    remote: sp.Expr | int = 1,
) -> sp.Expr:
    """Hierarchical ring (tree across domains for all-reduce) on one protocol; an all-to-all
    sends ``remote`` of its network bytes (1, or the node-deduplicated share)."""
    if kind is CollKind.ALL_REDUCE:
        return (
            2 * (n_in - 1) / n_in * size_bytes / bw_in
            + 2 * (n_out - 1) / n_out * size_bytes / (n_in * bw_out)
            + 2 * (n_in - 1) * a_in
            + 2 * sp.log(n_out, 2) * a_out
            + base
        )
    if kind in (CollKind.ALL_GATHER, CollKind.REDUCE_SCATTER):
        # a ring through every rank: n - 1 steps, n_out - 1 of them cross the network (NCCL's
        # latency model, src/graph/tuning.cc); all-reduce takes a tree across domains instead
        return (
            (n_in - 1) / n_in * size_bytes / bw_in
            + (n_out - 1) / n_out * size_bytes / (n_in * bw_out)
            + (n_in * n_out - n_out) * a_in
            + (n_out - 1) * a_out
            + base
        )
    n = n_in * n_out  # all-to-all
    return (
        (n_in - 1) / n * size_bytes / bw_in
        + (n - n_in) / n * size_bytes * remote / bw_out
        + (n_in - 1) * a_in
        + (n - n_in) * a_out
        + base
    )


def collective_time(
    kind: CollKind,
    group: Iterable[MeshAxis],
    size_bytes: sp.Expr,
    rank_order: tuple[MeshAxis, ...],
    copies: sp.Expr | None = None,
) -> sp.Expr:
    """Seconds for one collective with a buffer of ``size_bytes`` per GPU (see module doc).
    ``copies``: an all-to-all that carries ``copies`` copies of each row (a token dispatched
    to its ``top_k`` experts) sent once per destination node (:func:`node_dedup_share`)."""
    return _collective_time(
        kind, frozenset(group), sp.sympify(size_bytes), tuple(rank_order), copies
    )


def node_dedup_share(copies: sp.Expr, nodes: sp.Expr) -> sp.Expr:
    """The share of an all-to-all's network bytes left when each row goes once to every other
    node holding one of its ``copies`` destinations (spread evenly over ``nodes`` nodes): a
    node is hit with probability ``1 - (1 - 1/nodes)^copies``, against ``copies / nodes``
    rows per node without deduplication."""
    return nodes * (1 - (1 - 1 / nodes) ** copies) / copies


@lru_cache(maxsize=4096)
def _collective_time(
    kind: CollKind,
    group: frozenset,
    size_bytes: sp.Expr,
    rank_order: tuple[MeshAxis, ...],
    copies: sp.Expr | None = None,
) -> sp.Expr:
    # memoized: plan families share most of their collectives (same graph, other ZeRO stage
    # or recompute mode), and building these expressions is most of a family's derivation
    n_in, n_out, span = group_tiers(group, rank_order)
    share = None if copies is None else node_dedup_share(copies, n_out)
    in_pod = members_within(group, rank_order, S.pod_gpus)
    return _tier_time(kind, n_in, n_out, span, size_bytes, in_pod, share)


def domain_collective_time(kind: CollKind, n_in: sp.Expr, size_bytes: sp.Expr) -> sp.Expr:
    """Seconds of the same collective over ``n_in`` GPUs of one scale-up domain: the intra-
    domain part of :func:`collective_time` (which measured timing replaces by a measurement)."""
    return _tier_time(kind, n_in, sp.Integer(1), sp.Integer(1), sp.sympify(size_bytes))


def _tier_time(
    kind: CollKind,
    n_in: sp.Expr,
    n_out: sp.Expr,
    span: sp.Expr,
    size_bytes: sp.Expr,
    in_pod: sp.Expr | int = 1,
    remote_share: sp.Expr | None = None,
) -> sp.Expr:
    """``in_pod``: the group's members per pod (:func:`members_within`); ``remote_share``: the
    share of an all-to-all's network bytes sent (:func:`node_dedup_share`)."""
    bw_in = S.intra_bandwidth * S.intra_efficiency
    # above a pod the fabric carries 1/oversubscription of the pod's NIC bandwidth. Every group
    # of the collective's kind runs at once; a ring (or a pipeline) leaves a pod once per group
    # with members in it, so a pod's uplinks carry pod_gpus / in_pod flows at NIC speed: they
    # slow down by oversubscription / in_pod when that exceeds 1. An all-to-all sends the
    # share of its buffer bound outside the pod from every member: the full oversubscription.
    crosses = sp.Gt(span, S.pod_gpus, evaluate=False)
    slow = S.oversubscription if kind is CollKind.ALL_TO_ALL else S.oversubscription / in_pod
    pod = sp.Piecewise((_max(1, slow), crosses), (1, True), evaluate=False)
    remote = sp.Integer(1) if remote_share is None else remote_share
    bw_out = S.inter_bandwidth * S.inter_efficiency / pod
    a_in, a_out = S.intra_latency, S.inter_latency
    if kind is CollKind.SEND_RECV:
        # the slowest hop of the pipeline: over the NIC as soon as stages span domains
        bw = sp.Piecewise((bw_out, n_out > 1), (bw_in, True))
        lat = sp.Piecewise((a_out, n_out > 1), (a_in, True))
        return _min(1, DEGREE[MeshAxis.PP] - 1) * (size_bytes / bw + lat)
    if kind not in (
        CollKind.ALL_REDUCE,
        CollKind.ALL_GATHER,
        CollKind.REDUCE_SCATTER,
        CollKind.ALL_TO_ALL,
    ):
        raise ValueError(kind)
    # a one-rank group moves nothing and costs nothing; any other collective pays a base
    active = _min(1, n_in * n_out - 1)
    simple = _ring(
        kind, n_in, n_out, size_bytes, bw_in, bw_out, a_in, a_out,
        active * S.collective_base_latency, remote,
    )  # fmt: skip
    # the low-latency protocol: lower latencies, half the bandwidth (NCCL's LL; a cluster
    # without one has the bandwidth protocol's latencies bound here, so it never wins)
    ll = _ring(
        kind, n_in, n_out, size_bytes, bw_in / 2, bw_out / 2, S.ll_intra_latency,
        S.ll_inter_latency, active * S.ll_base_latency, remote,
    )  # fmt: skip
    best = _min(simple, ll)
    if kind is not CollKind.ALL_REDUCE:
        return best
    # inside one domain, small buffers go one-shot: each GPU reads its n - 1 peers' buffers
    # over NVLink and reduces locally (TensorRT-LLM / vLLM custom all-reduce)
    oneshot = S.oneshot_latency + (n_in - 1) * size_bytes / bw_in
    in_domain = sp.Lt(n_out, sp.Rational(3, 2), evaluate=False)
    has_oneshot = sp.Gt(S.oneshot_latency, 0, evaluate=False)
    inner = sp.Piecewise((_min(best, oneshot), has_oneshot), (best, True), evaluate=False)
    return sp.Piecewise((inner, in_domain), (best, True), evaluate=False)


def pipeline_hop_time(boundary_bytes: sp.Expr, key: CostKey) -> sp.Expr:
    """Seconds for one activation (or gradient) to cross a stage boundary. Without sequence
    parallelism, Megatron-LM's scatter/gather optimization (Narayanan et al. sec. 4.1) sends a
    1/tp slice over the network and all-gathers it over the tp group."""
    if key.graph.sequence_parallel:
        return collective_time(CollKind.SEND_RECV, {MeshAxis.PP}, boundary_bytes, key.rank_order)
    return collective_time(
        CollKind.SEND_RECV, {MeshAxis.PP}, boundary_bytes / S.tp, key.rank_order
    ) + _min(1, S.pp - 1) * collective_time(
        CollKind.ALL_GATHER, {MeshAxis.TP}, boundary_bytes, key.rank_order
    )


def embedding_sync_time(size_bytes: sp.Expr, rank_order: tuple[MeshAxis, ...]) -> sp.Expr:
    """Seconds for the tied-embedding gradient all-reduce between the first and last stage of a
    pipeline: a two-rank ring is a reduce-scatter and an all-gather, each moving half the
    buffer over the pipeline's slowest hop (0 when pp == 1)."""
    return 2 * collective_time(CollKind.SEND_RECV, {MeshAxis.PP}, size_bytes / 2, rank_order)


def _coll_time(
    coll: CollKind, group, size: sp.Expr, order, kernels: KernelSet | None, copies=None
) -> sp.Expr:
    t = collective_time(coll, group, size, order, copies)
    if kernels is None or coll.value not in (
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
    ):
        return t
    n_in, n_out, _ = group_tiers(frozenset(group), order)
    intra = domain_collective_time(coll, n_in, size)
    return kernels.time(Kernel(coll.value, (size, n_in, n_out, intra), t))


EAGER_COPY_S = 5e-6
"""Host time of one small eagerly dispatched tensor copy (ATen dispatch and CUDA launch: a few
microseconds, the per-op CPU cost CUDA graphs remove; PyTorch blog "Accelerating PyTorch with
CUDA Graphs", 2021). A list-form collective issues one per rank, back to back."""


def _per_tensor_time(op: Op, order, kernels: KernelSet | None) -> sp.Expr:
    """One parameter tensor's own list-form collective (DeepSpeed 0.3's ZeRO-3 over
    ``torch.distributed.all_gather`` / ``reduce_scatter`` with a tensor per rank): the NCCL
    collective, and the copy of each rank's piece out of (all-gather) or into (reduce-scatter)
    the flat buffer NCCL works on, one per rank (PyTorch ``ProcessGroupNCCL::allgather``
    copies ``outputTensors[i][j]`` from the flattened output one by one), streaming the
    buffer once besides."""
    ranks = sp.Mul(*[DEGREE[a] for a in op.group])
    copies = ranks * EAGER_COPY_S + 2 * op.comm_bytes / (S.hbm_bandwidth * S.memory_efficiency)
    return _coll_time(op.coll, op.group, op.comm_bytes, order, kernels) + copies
