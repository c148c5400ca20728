"""The pipeline schedule of a trace: which layers sit on which stage and model chunk, which
micro-batch runs next on each stage, and who sends what to whom.

What lives here, with no graph numbers and no I/O: :func:`stage_sections` (the graph sections
each model chunk of a stage runs, with the layer split the cost model uses,
:mod:`stage_dse.spec.stages`: embedding on the first virtual stage, head on the last, leading
dense layers before MoE blocks), :func:`schedule_order` (1F1B or interleaved order of forwards and
backwards on one stage) and :func:`pipeline_links` (neighbours and send/recv tags). The node
emission (:mod:`stage_dse.trace.program`) follows this order; it does not decide it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stage_dse.spec import ModelSpec
from stage_dse.spec.stages import virtual_stage_layers

if TYPE_CHECKING:
    from stage_dse.graph.core import Graph

__all__ = [
    "Link",
    "layer_runs",
    "pipeline_links",
    "schedule_order",
    "stage_layers",
    "stage_sections",
]


def stage_layers(layers: int, pp: int, split: str = "balanced") -> list[int]:
    """Layers per pipeline stage (one chunk each) under ``split`` (:mod:`stage_dse.spec.stages`)."""
    return virtual_stage_layers(layers, pp, 1, split)


def layer_runs(graphs, model: ModelSpec, start: int, count: int) -> list[tuple[Graph, int]]:
    """Layers [start, start + count) as runs of dense-MLP layers (leading or interleaved,
    :meth:`stage_dse.spec.ModelSpec.is_moe_layer`) and block layers."""
    runs: list[tuple[Graph, int]] = []
    for index in range(start, start + count):
        dense = graphs.dense is not None and not model.is_moe_layer(index)
        graph = graphs.dense if dense else graphs.block
        if runs and runs[-1][0] is graph:
            runs[-1] = (graph, runs[-1][1] + 1)
        else:
            runs.append((graph, 1))
    return runs


def stage_sections(
    graphs, model: ModelSpec, stage: int, pp: int, v: int, split: str = "balanced"
) -> list[list[tuple[Graph, int]]]:
    """Per model chunk of ``stage``: the (graph section, repeat count) pairs it runs in forward
    order (embedding on the first virtual stage, output head on the last), the layers as the
    cost model splits them (:func:`stage_dse.spec.stages.virtual_stage_layers`)."""
    counts = virtual_stage_layers(model.num_layers, pp, v, split)
    chunks = []
    for c in range(v):
        virtual = c * pp + stage
        sections: list[tuple[Graph, int]] = []
        if virtual == 0:
            sections.append((graphs.embed, 1))
        sections.extend(layer_runs(graphs, model, sum(counts[:virtual]), counts[virtual]))
        if virtual == pp * v - 1:
            sections.append((graphs.head, 1))
        chunks.append(sections)
    return chunks


def schedule_order(stage: int, pp: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """(phase, micro-batch, model chunk) in execution order on one pipeline stage.

    ``v == 1``: 1F1B (PipeDream-Flush): ``pp - stage - 1`` warm-up forwards, then one forward
    and one backward alternately, then the remaining backwards. ``v > 1``: the interleaved
    schedule of Narayanan et al. SC21 sec. 2.2 (Megatron-LM's order): virtual micro-batch ``k``
    runs chunk ``(k mod pp*v) div pp`` (backwards in reverse chunk order) of micro-batch
    ``(k div pp*v) * pp + k mod pp``, with ``2 (pp - stage - 1) + (v - 1) pp`` warm-up forwards.
    """
    if v == 1:
        warmup = min(pp - stage - 1, m)
        fwd = [(i, 0) for i in range(m)]
        bwd = [(i, 0) for i in range(m)]
    else:
        total = m * v
        warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)

        def virtual(k: int, forward: bool) -> tuple[int, int]:
            in_group = k % (pp * v)
            chunk = in_group // pp
            if not forward:
                chunk = v - 1 - chunk
            return (k // (pp * v)) * pp + k % pp, chunk

        fwd = [virtual(k, True) for k in range(total)]
        bwd = [virtual(k, False) for k in range(total)]
    n = len(fwd)
    order = [("F", *fwd[k]) for k in range(warmup)]
    for k in range(n - warmup):
        order += [("F", *fwd[warmup + k]), ("B", *bwd[k])]
    order += [("B", *bwd[k]) for k in range(n - warmup, n)]
    return order


@dataclass(frozen=True)
class Link:
    """Pipeline neighbours and message tags of one (stage, micro-batch, chunk) step."""

    first_virtual: bool
    last_virtual: bool
    prev_delta: int
    """Rank offset (in stages) of the previous virtual stage: -1, or wrapping to the last."""
    next_delta: int
    own_tag: int
    """Tag of what this step sends forward (+1 for the gradient it sends back)."""
    from_prev_tag: int
    from_next_tag: int


def pipeline_links(stage: int, pp: int, v: int, mb: int, chunk: int) -> Link:
    """Neighbours in the virtual pipeline (stage +-1, wrapping between chunks) and tags: a
    message's tag names the sender's chunk, ``2 * (mb * v + chunk) + direction``."""
    s, c = stage, chunk
    return Link(
        first_virtual=s == 0 and c == 0,
        last_virtual=s == pp - 1 and c == v - 1,
        prev_delta=-1 if s > 0 else pp - 1,
        next_delta=+1 if s < pp - 1 else -(pp - 1),
        own_tag=2 * (mb * v + c),
        from_prev_tag=2 * (mb * v + (c if s > 0 else c - 1)),
        from_next_tag=2 * (mb * v + (c if s < pp - 1 else c + 1)) + 1,
    )
