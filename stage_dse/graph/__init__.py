"""Symbolic tensor graphs of transformer workloads (no I/O, no numeric evaluation).

``ir`` is the data model (tensors, ops, layouts, the op recorder); ``layout`` derives the
collectives a layout change needs; ``forward`` holds one builder per op kind and ``backward`` one
rule per op kind (a table keyed by ``OpKind``); ``core`` is the ``Graph`` of one model section
(parameters, forward, backward, optimizer step); ``transformer`` builds the dense, MoE and
serving sections of a model; ``symbols`` names the sympy symbols; ``key`` is the structural key
of a graph.

The names below load their module on first use: importing the package (or its sympy-free
``key`` and ``symbols``) does not import sympy.
"""

from stage_dse.lazy import lazy_names

_HOME = {
    "Graph": "core",
    "Axis": "ir",
    "CollKind": "ir",
    "Frequency": "ir",
    "Op": "ir",
    "OpKind": "ir",
    "Phase": "ir",
    "Region": "ir",
    "Role": "ir",
    "Scope": "ir",
    "Tensor": "ir",
    "DEGREE": "symbols",
    "S": "symbols",
    "Symbols": "symbols",
    "DIMS": "dims",
    "GraphKey": "key",
    "graph_key": "key",
    "ModelGraphs": "transformer",
    "build_graphs": "transformer",
}

__all__ = sorted(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
