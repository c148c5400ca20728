"""Binding specs to symbol values, and evaluating cost expressions for one plan.

What lives here: :func:`bind` (specs -> symbol values) and :func:`evaluate_plan`, which
evaluates the compiled expressions of a plan's family. Evaluation always goes through
``sympy.lambdify`` (compiled once per family and cached); per-config ``subs`` is never used.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import sympy as sp

from stage_dse.cost.derive import CostKey, cost_key, derive
from stage_dse.graph.symbols import S, Symbols
from stage_dse.graph.transformer import build_graphs
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec, validate_plan

__all__ = ["SYMBOL_ORDER", "bind", "compiled", "evaluate_plan"]

SYMBOL_ORDER: tuple[sp.Symbol, ...] = tuple(Symbols.all().values())
"""Argument order of every compiled function."""


def bind(model: ModelSpec, training: TrainingSpec, plan: ParallelPlan) -> dict[sp.Symbol, int]:
    """Values of every symbol for one concrete (model, training step, plan)."""
    return {
        S.micro_batch: plan.micro_batch_size,
        S.seq: training.seq_len,
        S.hidden: model.hidden_size,
        S.ffn: model.ffn_hidden_size,
        S.heads: model.num_heads,
        S.kv_heads: model.num_kv_heads,
        S.head_dim: model.head_dim,
        S.vocab: model.vocab_size,
        S.layers: model.num_layers,
        S.positions: model.max_positions or training.seq_len,
        S.global_batch: training.global_batch_size,
        S.dp: plan.dp,
        S.tp: plan.tp,
        S.pp: plan.pp,
        S.cp: plan.cp,
        S.ep: plan.ep,
        S.virtual_stages: plan.virtual_stages,
    }


@lru_cache(maxsize=512)
def compiled(key: CostKey) -> tuple[tuple[str, ...], Callable[..., list[np.ndarray]]]:
    """Names and one numpy function returning every cost of a family, arguments SYMBOL_ORDER."""
    exprs = derive(key).all()
    names = tuple(exprs)
    fn = sp.lambdify(SYMBOL_ORDER, [exprs[n] for n in names], modules="numpy", cse=True)
    return names, fn


def evaluate_plan(
    model: ModelSpec, training: TrainingSpec, plan: ParallelPlan, num_gpus: int | None = None
) -> dict[str, float]:
    """Every cost of one validated plan as plain floats (``mem_total``, ``flops_model``, ...)."""
    validate_plan(model, training, plan, num_gpus)
    build_graphs(model, plan, training)
    names, fn = compiled(cost_key(model, plan, training))
    values = bind(model, training, plan)
    out = fn(*(np.full(1, values[s], dtype=np.float64) for s in SYMBOL_ORDER))
    return {n: float(np.broadcast_to(v, (1,))[0]) for n, v in zip(names, out)}
