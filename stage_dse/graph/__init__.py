"""Symbolic tensor graphs of transformer workloads (no I/O, no numeric evaluation).

``core`` holds the graph engine (tensors, layouts, ops, collectives, automatic backward);
``transformer`` builds the dense GPT/Llama sections; ``symbols`` names the sympy symbols.
"""

from stage_dse.graph.core import (
    Axis,
    CollKind,
    Frequency,
    Graph,
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
