"""Which layers of a model are dense and which MoE, and which attend over a sliding window,
over the symbols.

A model with a dense section (:attr:`stage_dse.graph.transformer.ModelGraphs.dense`) has
``dense_layers`` leading dense-MLP layers and, after them, an MoE layer every
``moe_interval``-th layer (:attr:`stage_dse.spec.ModelSpec.moe_layer_interval`; Llama 4
Maverick alternates them). The cost programs (training memory, flops and time, serving passes
and weights) count a stage's layers of each kind with :func:`dense_layers_among`; the trace
writer places them layer by layer with :meth:`stage_dse.spec.ModelSpec.is_moe_layer`, and the
two agree on the first and last stage of every split.

A model with a sliding window (:attr:`stage_dse.graph.transformer.ModelGraphs.windowed`) has
full attention on every ``full_interval``-th layer and the window on the others
(:attr:`stage_dse.spec.ModelSpec.full_attention_interval`); :func:`windowed_layers_among`
counts a stage's windowed layers the same way. The two patterns are independent: attention
and MLP costs of a layer add, so a stage's cost is its dense and MoE layers' plus, for each
windowed layer, the difference the window makes to attention.
"""

from __future__ import annotations

import sympy as sp

from stage_dse.graph.symbols import S

__all__ = ["dense_layers_among", "windowed_layers_among"]


def _moe_layers_in_first(n: sp.Expr) -> sp.Expr:
    """MoE layers among layers ``0 .. n-1``: none of the leading ``dense_layers``, then every
    ``moe_interval``-th."""
    return sp.floor(sp.Max(0, n - S.dense_layers, evaluate=False) / S.moe_interval)


def dense_layers_among(layers: sp.Expr, where: str) -> sp.Expr:
    """Dense-MLP layers among ``layers`` consecutive layers of a mixture-of-experts model whose
    graphs have a dense section.

    ``where`` says which layers: ``"whole"`` (all ``layers`` of the model), ``"first"`` (layers
    ``0 .. layers-1``: the first pipeline stage), ``"last"`` (the last ``layers``: the last
    stage) or ``"mid"`` (a middle stage, whose offset the closed forms do not carry: it is
    counted with as many MoE layers as its length allows, ``ceil(layers / moe_interval)``, the
    heavier case, and with the leading dense layers ending before it). Exact for the first
    and last stage of a one-chunk split; with model chunks (interleaved schedule) a stage's
    layers are counted as if they were consecutive, which moves at most one layer per chunk
    between the two kinds when ``moe_interval > 1``. With ``moe_interval == 1`` these are the
    leading dense layers on the first stage and none elsewhere.
    """
    if where in ("whole", "first"):
        return layers - _moe_layers_in_first(layers)
    if where == "last":
        moe = _moe_layers_in_first(S.layers) - _moe_layers_in_first(S.layers - layers)
        return layers - moe
    if where == "mid":
        return layers - sp.ceiling(layers / S.moe_interval)
    raise ValueError(f"where={where!r}: one of whole, first, last, mid")


def windowed_layers_among(layers: sp.Expr, where: str) -> sp.Expr:
    """Sliding-window layers among ``layers`` consecutive layers of a model whose graphs have
    a windowed section; ``where`` as for :func:`dense_layers_among` (a middle stage is counted
    with as many full-attention layers as its length allows, ``ceil(layers / full_interval)``,
    the heavier case)."""
    k = S.full_interval
    if where in ("whole", "first"):
        return layers - sp.floor(layers / k)
    if where == "last":
        return layers - (sp.floor(S.layers / k) - sp.floor((S.layers - layers) / k))
    if where == "mid":
        return layers - sp.ceiling(layers / k)
    raise ValueError(f"where={where!r}: one of whole, first, last, mid")
