"""What overlapped work adds to a step's critical path: a collective under compute (the part
that outlasts it, plus the compute's slowdown beside it) and the data-parallel gradient
buckets queued behind the last backward. Pure sympy over the symbols, used by
:mod:`stage_dse.cost.time`."""

from __future__ import annotations

import sympy as sp

from stage_dse.cost.expr import _max, _min
from stage_dse.graph.symbols import S

__all__ = ["_bucket_queue", "_hidden"]


def _hidden(comm: sp.Expr, cover: sp.Expr) -> sp.Expr:
    """What a collective of ``comm`` seconds run under ``cover`` seconds of compute adds to the
    critical path: the part that outlasts the compute, plus the compute's slowdown while both
    run (``overlap_slowdown`` of the overlapped time: the collective's kernels take SMs and HBM
    bandwidth from the compute beside them)."""
    return _max(0, comm - cover) + S.overlap_slowdown * _min(comm, cover)


def _bucket_queue(
    sync: sp.Expr,
    cover: sp.Expr,
    layers: sp.Expr,
    first: tuple[sp.Expr, sp.Expr],
    last: tuple[sp.Expr, sp.Expr],
) -> sp.Expr:
    """Exposed seconds of a stage's gradient buckets (``sync`` in all) issued one per section
    as the last micro-batch's backward (``cover`` in all) leaves it, run one after another on
    one communicator: ``first`` (the output layer's bucket and backward, issued first) and
    ``last`` (the embedding's, issued last), equal layers between. The tail after the
    backward is ``max_i (sum_{j>=i} d_j - sum_{j>i} b_j)``, over the buckets ``i`` in issue
    order; with equal layers the maximum is at an end of the run of layers or at a tier.
    Plus ``overlap_slowdown`` of what runs under compute."""
    (d_h, b_h), (d_t, b_t) = first, last
    n = _max(1, layers)
    d_l, b_l = (sync - d_h - d_t) / n, (cover - b_h - b_t) / n
    tail = _max(
        d_t,
        d_l + d_t - b_t,
        n * d_l + d_t - (n - 1) * b_l - b_t,
        sync - n * b_l - b_t,
    )
    return tail + S.overlap_slowdown * _max(0, _min(sync - tail, cover))
