"""The sympy symbols every cost expression is written in.

Model dimensions and parallel degrees are positive integer symbols, so one derived expression
serves every model of a family and every plan; binding happens only when costs are evaluated
(vectorized, by :mod:`stage_dse.cost.compile`).
"""

from __future__ import annotations

import sympy as sp

from stage_dse.spec.plan import MeshAxis

__all__ = ["DEGREE", "S", "Symbols"]


def _sym(name: str) -> sp.Symbol:
    return sp.Symbol(name, positive=True, integer=True)


class Symbols:
    """Namespace of the symbols (attribute names are the column names used for binding)."""

    # model dimensions
    micro_batch = _sym("micro_batch")
    seq = _sym("seq")
    hidden = _sym("hidden")
    ffn = _sym("ffn")
    heads = _sym("heads")
    kv_heads = _sym("kv_heads")
    head_dim = _sym("head_dim")
    vocab = _sym("vocab")
    layers = _sym("layers")
    positions = _sym("positions")
    # step
    global_batch = _sym("global_batch")
    # parallel degrees
    dp = _sym("dp")
    tp = _sym("tp")
    pp = _sym("pp")
    cp = _sym("cp")
    ep = _sym("ep")
    virtual_stages = _sym("virtual_stages")

    @classmethod
    def all(cls) -> dict[str, sp.Symbol]:
        return {k: v for k, v in vars(cls).items() if isinstance(v, sp.Symbol)}


S = Symbols

DEGREE: dict[MeshAxis, sp.Symbol] = {
    MeshAxis.DP: S.dp,
    MeshAxis.TP: S.tp,
    MeshAxis.PP: S.pp,
    MeshAxis.CP: S.cp,
    MeshAxis.EP: S.ep,
}
"""Symbol of the size of each mesh axis."""
