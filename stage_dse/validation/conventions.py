"""How published runs count flops: closed forms per convention, from the model's dimensions.

A source that reports TFLOP/s per GPU or MFU divides a flop count of its own by the measured
time. To compare like with like, the published figure is turned back into a step time with the
same count. A convention says what is counted (``target.flops`` of a corpus record):

* ``attention``: the score and value matmuls ``QK^T`` and ``AV`` (``2 s a (d_qk + d_v)`` flops
  per token and layer forward): ``none``, ``full`` (every query against every key) or
  ``causal`` (half of that, what a causal kernel executes);
* ``recompute``: ``full`` counts the layers' forward twice (Narayanan et al. SC21 eq. 3: the
  leading 72 becomes 96), ``selective`` counts the attention core's forward twice
  (Korthikanti et al. 2022, HFU);
* ``logits``: the output layer ``2 h V`` per token forward (eq. 3 counts it, never recomputed);
* ``params``: ``matmul`` counts the linear layers' weights, ``all`` adds the input embedding
  (the ``6 N`` of Kaplan et al. with ``N`` every parameter).

Forward plus backward is three forward passes. For a mixture-of-experts model the active
parameters count: the routed experts a token visits, the shared experts and the router.
"""

from __future__ import annotations

from stage_dse.spec import MlpKind, ModelSpec

__all__ = ["attention_flops_per_token_layer", "flops_per_step", "linear_params_per_token"]


def _attention_params(m: ModelSpec) -> int:
    h, a, d = m.hidden_size, m.num_heads, m.head_dim
    if m.is_mla:
        rope, v = m.rope_head_dim, m.v_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * a * (d + rope)
        kv = h * (m.kv_lora_rank + rope) + m.kv_lora_rank * a * (d + v)
        return q + kv + a * v * h
    return h * a * d + 2 * h * m.num_kv_heads * d + a * d * h


def _mlp_params(m: ModelSpec, width: int) -> int:
    return (3 if m.mlp is MlpKind.SWIGLU else 2) * m.hidden_size * width


def linear_params_per_token(m: ModelSpec) -> tuple[int, int]:
    """Weights of the transformer layers one token passes through (active parameters), and of
    the output layer."""
    attn = _attention_params(m)
    if m.is_moe:
        dense = m.num_dense_layers
        experts = (m.top_k + m.num_shared_experts) * _mlp_params(m, m.moe_ffn_hidden_size)
        moe_layer = attn + experts + m.hidden_size * m.num_experts
        layers = dense * (attn + _mlp_params(m, m.ffn_hidden_size))
        layers += (m.num_layers - dense) * moe_layer
    else:
        layers = m.num_layers * (attn + _mlp_params(m, m.ffn_hidden_size))
    return layers, m.hidden_size * m.vocab_size


def attention_flops_per_token_layer(m: ModelSpec, seq: int, attention: str) -> float:
    """Forward ``QK^T`` and ``AV`` flops of one token in one layer."""
    if attention == "none":
        return 0.0
    d_qk = m.head_dim + (m.rope_head_dim if m.is_mla else 0)
    d_v = m.v_head_dim if m.is_mla else m.head_dim
    full = 2.0 * seq * m.num_heads * (d_qk + d_v)
    return full / 2 if attention == "causal" else full


def flops_per_step(m: ModelSpec, seq: int, global_batch: int, convention: dict) -> float:
    """Flops of one optimizer step of ``global_batch`` sequences of ``seq`` tokens, counted as
    ``convention`` says (keys of :data:`stage_dse.validation.corpus.FLOPS_CONVENTION`)."""
    attention = convention.get("attention", "full")
    recompute = convention.get("recompute", "none")
    logits = convention.get("logits", True)
    layers, head = linear_params_per_token(m)
    if convention.get("params", "matmul") == "all":
        layers += m.hidden_size * m.vocab_size  # the input embedding's weights
    linear = 6.0 * layers * (4 / 3 if recompute == "full" else 1.0)
    attn = 3.0 * m.num_layers * attention_flops_per_token_layer(m, seq, attention)
    attn *= 4 / 3 if recompute in ("full", "selective") else 1.0
    out = 6.0 * head if logits else 0.0
    return float(seq) * global_batch * (linear + attn + out)
