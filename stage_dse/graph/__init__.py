"""Symbolic tensor graphs of transformer workloads (no I/O, no numeric evaluation).

``ir`` is the data model (tensors, ops, layouts, the op recorder); ``layout`` derives the
collectives a layout change needs; ``forward`` holds one builder per op kind and ``backward`` one
rule per op kind (a table keyed by ``OpKind``); ``core`` is the ``Graph`` of one model section
(parameters, forward, backward, optimizer step); ``transformer`` builds the dense, MoE and
serving sections of a model; ``symbols`` names the sympy symbols.
"""

from stage_dse.graph.core import Graph
from stage_dse.graph.ir import (
    Axis,
    CollKind,
    Frequency,
    Op,
    OpKind,
    Phase,
    Region,
    Role,
    Scope,
    Tensor,
)
from stage_dse.graph.symbols import DEGREE, S, Symbols
from stage_dse.graph.transformer import DIMS, GraphKey, ModelGraphs, build_graphs, graph_key

__all__ = [
    "DEGREE",
    "DIMS",
    "Axis",
    "CollKind",
    "Frequency",
    "Graph",
    "GraphKey",
    "ModelGraphs",
    "Op",
    "OpKind",
    "Phase",
    "Region",
    "Role",
    "S",
    "Scope",
    "Symbols",
    "Tensor",
    "build_graphs",
    "graph_key",
]
