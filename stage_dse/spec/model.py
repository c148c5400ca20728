"""``ModelSpec``: the architecture of a transformer language model.

What lives here: the frozen description of a model (dimensions and structural choices) and its
validation. What does not: presets (loaded by :mod:`stage_dse.config.presets` from
``conf/model/*.yaml``) and any cost (derived from the symbolic graph in :mod:`stage_dse.graph`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum, positive_int

__all__ = ["MlpKind", "ModelSpec", "NormKind", "PositionKind"]


class NormKind(StrEnum):
    """Normalization layer: LayerNorm has a scale and a bias, RMSNorm a scale only."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class MlpKind(StrEnum):
    """Feed-forward block: GeLU with two matrices (GPT), or SwiGLU with three (Llama)."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class PositionKind(StrEnum):
    """Learned absolute position embeddings (GPT) or rotary embeddings (no parameters)."""

    LEARNED = "learned"
    ROPE = "rope"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A dense decoder-only transformer.

    Every size is a count (no units); byte sizes come from the dtypes of ``TrainingSpec``.
    """

    name: str
    """Preset or user name, carried into results."""
    num_layers: int
    """Transformer blocks."""
    hidden_size: int
    """Model (residual stream) width h."""
    ffn_hidden_size: int
    """Inner width of the MLP (4h for GPT, e.g. 14336 for Llama 3 8B)."""
    num_heads: int
    """Query heads a."""
    vocab_size: int
    """Vocabulary size V (already padded as trained)."""
    num_kv_heads: int = 0
    """Key/value heads (GQA). 0 means equal to ``num_heads`` (multi-head attention)."""
    head_dim: int = 0
    """Per-head width. 0 means ``hidden_size // num_heads``."""
    norm: NormKind = NormKind.LAYERNORM
    mlp: MlpKind = MlpKind.GELU
    position: PositionKind = PositionKind.LEARNED
    max_positions: int = 0
    """Rows of the learned position table; 0 means the training sequence length is used."""
    tied_embeddings: bool = True
    """Input embedding and output projection share one matrix."""
    bias: bool = True
    """Linear layers carry biases."""
    dropout: bool = True
    """Dropout on attention probabilities, attention/MLP outputs, embeddings (1-byte masks)."""

    def __post_init__(self) -> None:
        owner = "model"
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "vocab_size"):
            positive_int(owner, field, getattr(self, field))
        for field in ("num_kv_heads", "head_dim", "max_positions"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{owner}.{field} must be an integer >= 0, got {value!r}")
        object.__setattr__(self, "norm", coerce_enum(NormKind, owner, "norm", self.norm))
        object.__setattr__(self, "mlp", coerce_enum(MlpKind, owner, "mlp", self.mlp))
        object.__setattr__(
            self, "position", coerce_enum(PositionKind, owner, "position", self.position)
        )
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model.num_heads({self.num_heads}) does not divide "
                    f"model.hidden_size({self.hidden_size}); set model.head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads({self.num_kv_heads}) does not divide "
                f"model.num_heads({self.num_heads})"
            )

    @property
    def gqa_group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: object) -> ModelSpec:
        return dataclasses.replace(self, **changes)
