"""The graphs one model family is built as (:class:`ModelGraphs`): the pipeline's sections and
the layer variants the cost programs count per layer (:mod:`stage_dse.graph.layers`)."""

from __future__ import annotations

from dataclasses import dataclass

from stage_dse.graph.core import Graph
from stage_dse.graph.ir import Tensor
from stage_dse.graph.key import GraphKey

__all__ = ["ModelGraphs"]


@dataclass(frozen=True)
class ModelGraphs:
    key: GraphKey
    embed: Graph
    block: Graph
    head: Graph
    boundary: Tensor
    """Activation passed between pipeline stages (per micro-batch), in its layout."""
    tied_head_weight: Tensor | None
    """The head's copy of the word embeddings when they are tied (not a separate parameter)."""
    dense: Graph | None = None
    """A dense-MLP layer of a mixture-of-experts model that has some (leading or interleaved)."""
    windowed: Graph | None = None
    """A layer like ``block`` whose attention runs over the sliding window or within its chunk,
    in a model that has one. Not one of :attr:`sections`: the cost programs add, per windowed
    layer, what the window changes (``windowed - block``: attention and the KV cache; the MLPs
    cancel), so windowed dense-MLP and MoE layers alike are counted."""

    @property
    def sections(self) -> tuple[Graph, ...]:
        """embed, [dense layer,] layer, head: in pipeline order."""
        if self.dense is not None:
            return self.embed, self.dense, self.block, self.head
        return self.embed, self.block, self.head
