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
from stage_dse.spec._validate import coerce_enum, non_negative_int, positive_int

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
    """A decoder-only transformer: dense, or mixture-of-experts when ``num_experts > 0``.

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
    parallel_block: bool = False
    """Attention and MLP both read one norm of the layer input and their outputs join the
    residual together, ``x + attn(ln(x)) + mlp(ln(x))`` (GPT-J; PaLM, Chowdhery et al. 2022
    sec. 2; GPT-NeoX ``gpt_j_residual``; MegaScale, Jiang et al. 2024 sec. 3.1). Training
    graphs add the two branches' tensor-parallel partial sums and reduce them once, as
    GPT-NeoX and MegaScale do (one all-reduce, or one reduce-scatter and one all-gather with
    sequence parallelism, per layer instead of two); serving graphs reduce each branch, as
    vLLM's and TensorRT-LLM's GPT-J layers do. Dense models with standard attention only.
    Models with two norms of the input (GPT-NeoX-20B, Falcon-40B/180B) differ by one norm."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    top_k: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Inner width of one expert (SwiGLU); 0 means ``ffn_hidden_size``."""
    num_shared_experts: int = 0
    """Experts every token passes through (DeepSeek-style), each of ``moe_ffn_hidden_size``."""
    first_dense_layers: int = 0
    """The first k layers use a dense MLP of ``ffn_hidden_size`` (DeepSeek-V3: 3)."""
    moe_layer_interval: int = 1
    """After the leading dense layers, every k-th layer is an MoE layer and the others use the
    dense MLP of ``ffn_hidden_size``: layer ``i`` is MoE when ``(i - first_dense_layers + 1)``
    is a multiple of k (Hugging Face's ``interleave_moe_layer_step``; Llama 4 Maverick: 2, MoE
    on layers 1, 3, 5, ...). 1: every layer after the leading dense ones is MoE."""
    capacity_factor: float = 1.0
    """Tokens an expert processes relative to a perfectly balanced share (routing is assumed
    balanced; > 1 pads every expert to that capacity)."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3) when > 0: rank of the query compression.
    Then ``head_dim`` is the per-head no-position part of queries and keys."""
    kv_lora_rank: int = 0
    """MLA: rank of the joint key/value compression (the cached latent)."""
    rope_head_dim: int = 0
    """MLA: per-head rotary part of queries and keys (the key part is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value width (0: ``head_dim``)."""
    sliding_window: int = 0
    """Tokens a windowed (banded) attention layer attends to: each query sees itself and the
    ``sliding_window - 1`` positions before it, and the layer caches at most that many
    positions per sequence. 0: every layer attends over the whole context."""
    sparse_attention_topk: int = 0
    """DeepSeek Sparse Attention (DeepSeek-V3.2): each query attends to the ``k`` earlier
    tokens its lightning indexer scores highest (``index_topk``, 2048), its latent attention
    over at most that many; 0: dense attention. Needs latent attention and the indexer's
    sizes."""
    indexer_heads: int = 0
    """DSA: heads of the lightning indexer (``index_n_heads``, 64)."""
    indexer_head_dim: int = 0
    """DSA: width of an indexer head and of its cached key (``index_head_dim``, 128)."""
    full_attention_interval: int = 0
    """With ``sliding_window`` or ``attention_chunk_size``: layer ``i`` (0-based) attends over
    the whole context when ``(i + 1)`` is a multiple of k, the others over the window or
    chunk (gpt-oss: 2, windowed layers 0, 2, 4, ... as its config.json's ``layer_types``;
    Gemma 3: 6; Llama 4: 4, its global no-RoPE layers). 0: every layer is windowed
    (Mistral-7B-v0.1)."""
    attention_chunk_size: int = 0
    """Chunked local attention (Llama 4's iRoPE, config.json's ``attention_chunk_size``): a
    chunked layer's query at position ``p`` attends to the positions from the start of its
    aligned chunk of this many (``p - p mod chunk``) up to itself, in prefill and in decode.
    Engines keep the whole cache of every layer by default (TensorRT-LLM's KV-cache manager has
    one window, ``max_seq_len``; vLLM frees blocks before the current chunk only with
    ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``, off through v0.11) and their
    kernels skip the keys before the chunk (TensorRT-LLM's context FMHA and generation kernels
    start at the chunk boundary, docs/source/features/long-sequence.md "Chunked attention";
    vLLM's ``ChunkedLocalAttention`` splits each request into per-chunk batches). 0: none.
    Exclusive with ``sliding_window``."""

    mtp_layers: int = 0
    """Multi-token prediction modules trained beside the model (DeepSeek-V3, sec. 2.2: the
    ``D`` sequential modules predicting tokens ``2..D+1`` ahead; Megatron-Core's
    ``mtp_num_layers``). Each is one more transformer layer of the model's (MoE) kind and one
    more pass through the shared output layer and loss, on the last pipeline stage
    (Megatron-Core places them there, after the last layer); its embedding and output layer are
    the model's own. Its projection of the concatenated hidden state and embedding (``2h x h``)
    and two norms are left out (under 1% of a DeepSeek-V3 step). 0: none."""

    def __post_init__(self) -> None:
        owner = "model"
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "vocab_size"):
            positive_int(owner, field, getattr(self, field))
        for field in ("num_kv_heads", "head_dim", "max_positions", "mtp_layers"):
            non_negative_int(owner, field, getattr(self, field))
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
        for field in ("num_experts", "top_k", "moe_ffn_hidden_size", "num_shared_experts",
                      "first_dense_layers"):  # fmt: skip
            non_negative_int(owner, field, getattr(self, field))
        positive_int(owner, "moe_layer_interval", self.moe_layer_interval)
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ConfigError(
                    f"model.top_k({self.top_k}) must be in 1..num_experts({self.num_experts})"
                )
            if self.mlp is not MlpKind.SWIGLU:
                raise ConfigError("model.num_experts > 0 needs mlp=swiglu (experts are SwiGLU)")
            if self.first_dense_layers >= self.num_layers:
                raise ConfigError(
                    f"model.first_dense_layers({self.first_dense_layers}) must be < "
                    f"num_layers({self.num_layers})"
                )
            if self.num_moe_layers == 0:
                raise ConfigError(
                    f"model.moe_layer_interval({self.moe_layer_interval}) leaves no MoE layer in "
                    f"the {self.num_layers - self.first_dense_layers} layers after "
                    "first_dense_layers; use an interval <= that count"
                )
            if self.moe_ffn_hidden_size == 0:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if not (isinstance(self.capacity_factor, int | float) and self.capacity_factor >= 1):
                raise ConfigError(
                    f"model.capacity_factor must be a number >= 1, got {self.capacity_factor!r}"
                )
        elif self.top_k or self.num_shared_experts or self.first_dense_layers:
            raise ConfigError(
                "model.top_k/num_shared_experts/first_dense_layers need num_experts > 0"
            )
        elif self.moe_layer_interval != 1:
            raise ConfigError(
                f"model.moe_layer_interval({self.moe_layer_interval}) needs num_experts > 0; "
                "leave it 1 for a dense model"
            )
        for field in ("q_lora_rank", "kv_lora_rank", "rope_head_dim", "v_head_dim"):
            non_negative_int(owner, field, getattr(self, field))
        if self.is_mla:
            if not (self.kv_lora_rank and self.rope_head_dim):
                raise ConfigError(
                    "model.q_lora_rank > 0 (latent attention) needs kv_lora_rank and rope_head_dim"
                )
            if self.num_kv_heads != self.num_heads:
                raise ConfigError("model: latent attention has no key/value head groups; "
                                  "set num_kv_heads to num_heads or leave it 0")  # fmt: skip
            if self.v_head_dim == 0:
                object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads({self.num_kv_heads}) does not divide "
                f"model.num_heads({self.num_heads})"
            )
        self._check_window()
        self._check_sparse()
        if self.parallel_block and (self.is_moe or self.is_mla):
            raise ConfigError(
                "model.parallel_block is modelled for dense models with standard attention; "
                f"set it false for {'num_experts > 0' if self.is_moe else 'q_lora_rank > 0'}"
            )

    def _check_sparse(self) -> None:
        fields = ("sparse_attention_topk", "indexer_heads", "indexer_head_dim")
        for field in fields:
            non_negative_int("model", field, getattr(self, field))
        if not self.sparse_attention_topk:
            if self.indexer_heads or self.indexer_head_dim:
                raise ConfigError(
                    "model.indexer_heads/indexer_head_dim need sparse_attention_topk > 0"
                )
            return
        if not self.is_mla:
            raise ConfigError(
                "model.sparse_attention_topk (DeepSeek Sparse Attention) needs latent attention "
                "(q_lora_rank > 0)"
            )
        if not (self.indexer_heads and self.indexer_head_dim):
            raise ConfigError(
                "model.sparse_attention_topk needs indexer_heads and indexer_head_dim > 0 (the "
                "lightning indexer's sizes)"
            )

    def _check_window(self) -> None:
        for field in ("sliding_window", "full_attention_interval", "attention_chunk_size"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 0:
                raise ConfigError(
                    f"model.{field} must be >= 0 (an integer), got {getattr(self, field)!r}"
                )
        k = self.full_attention_interval
        if self.sliding_window and self.attention_chunk_size:
            raise ConfigError(
                f"model.sliding_window({self.sliding_window}) and attention_chunk_size"
                f"({self.attention_chunk_size}) cannot both be set: a layer attends over a "
                "sliding window or within its chunk; set one of them 0"
            )
        field = "sliding_window" if self.sliding_window else "attention_chunk_size"
        if not self.has_windowed_layers:
            if k:
                raise ConfigError(
                    f"model.full_attention_interval({k}) needs sliding_window or "
                    "attention_chunk_size > 0; leave it 0 for a model without windowed layers"
                )
            return
        if self.is_mla:
            raise ConfigError(
                f"model.{field} needs grouped-query attention, not latent attention "
                f"(q_lora_rank > 0); set {field} 0"
            )
        if k == 1:
            raise ConfigError(
                "model.full_attention_interval(1) leaves no windowed layer: use 0 (every layer "
                f"windowed) or >= 2, or set {field} 0"
            )
        if k > self.num_layers:
            raise ConfigError(
                f"model.full_attention_interval({k}) must be <= num_layers({self.num_layers}); "
                "use 0 for every layer windowed"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.q_lora_rank > 0

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) has routed experts (see ``moe_layer_interval``)."""
        after = index - self.first_dense_layers
        return self.is_moe and after >= 0 and (after + 1) % self.moe_layer_interval == 0

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts (0 for a dense model)."""
        if not self.is_moe:
            return 0
        return (self.num_layers - self.first_dense_layers) // self.moe_layer_interval

    @property
    def num_dense_layers(self) -> int:
        """Layers with the dense MLP: all of a dense model's, the leading and interleaved ones of
        a mixture-of-experts model."""
        return self.num_layers - self.num_moe_layers

    @property
    def has_dense_layers(self) -> bool:
        """A mixture-of-experts model with some dense-MLP layers (a second block section)."""
        return self.is_moe and self.num_dense_layers > 0

    @property
    def has_sparse_attention(self) -> bool:
        """DeepSeek Sparse Attention (``sparse_attention_topk > 0``)."""
        return self.sparse_attention_topk > 0

    @property
    def has_sliding_window(self) -> bool:
        return self.sliding_window > 0

    @property
    def has_chunked_attention(self) -> bool:
        """Chunked local attention (``attention_chunk_size > 0``)."""
        return self.attention_chunk_size > 0

    @property
    def has_windowed_layers(self) -> bool:
        """Some layers attend over a sliding window or within a chunk."""
        return self.has_sliding_window or self.has_chunked_attention

    def is_windowed_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) attends over the sliding window or within its chunk (see
        ``full_attention_interval``)."""
        if not self.has_windowed_layers:
            return False
        k = self.full_attention_interval
        return k == 0 or (index + 1) % k != 0

    @property
    def num_windowed_layers(self) -> int:
        """Layers attending over the sliding window or within a chunk (0 without either)."""
        if not self.has_windowed_layers:
            return 0
        k = self.full_attention_interval
        return self.num_layers - (self.num_layers // k if k else 0)

    @property
    def gqa_group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: object) -> ModelSpec:
        return dataclasses.replace(self, **changes)
