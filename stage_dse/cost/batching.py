"""Continuous batching with chunked prefill: the steady state of an inference engine.

vLLM, SGLang and TensorRT-LLM schedule per iteration (Orca, Yu et al. OSDI 2022): every engine
step runs one token for each request that is decoding plus, while prompts wait, a chunk of at
most ``C`` prompt tokens (chunked prefill, Sarathi-Serve, Agrawal et al. OSDI 2024: "stall-free"
batches). At most ``R`` requests run at once (``max_num_seqs``), fewer if their KV cache does
not fit. With prompts of ``P`` tokens and ``O`` output tokens, a prompt takes ``n = ceil(P/C)``
chunks of ``c = P/n`` tokens, one chunk per step, one prompt at a time. Under saturating load
(requests always waiting), per engine step:

* requests complete at ``r = min(1/n, R/(n + O))`` per step: prefill-bound (a chunk in every
  step) or slot-bound (each request holds a slot for ``n + O`` steps);
* a fraction ``f = r n`` of steps carry a chunk; they also decode ``R - 1`` requests when
  slot-bound (one slot is prefilling), ``O / n`` on average when prefill-bound; the other steps
  decode all ``R``;
* a chunk step takes ``T_mix = other(c + d) + n x attn_prefill(c) + attn_decode(d)``: the
  linear layers, norms and collectives of a prefill of ``c + d`` tokens, the chunk's attention
  over the prompt so far (``c`` queries over ``(P + c)/2`` keys on average: ``n`` times a
  standalone ``c``-token causal prefill, so the ``n`` chunks cost one whole prompt), and the
  decode attention of the ``d`` running requests at context ``P + O/2``; a decode-only step
  takes the decode step time of ``R`` requests, ``T_dec``. Each part is the serving program's
  (:mod:`stage_dse.cost.serving`), same roofline and collectives;
* mean step ``T = f T_mix + (1 - f) T_dec``; throughput ``r / T`` requests/s and ``r O / T``
  output tokens/s; TPOT is the mean step a decoding request sees, ``f' T_mix + (1 - f') T_dec``
  with ``f' = min(1, (R - 1) n / O)`` when slot-bound (the chunks of the others) and 1 when
  prefill-bound; tokens/s per user ``1 / TPOT``; TTFT ``n T_mix`` plus queueing.
* **Queueing**: at ``arrival_rate`` requests/s against the saturated rate ``mu = r / T``, the
  wait for admission is that of an M/D/1 queue, ``rho / (2 (1 - rho)) / mu`` with
  ``rho = arrival_rate / mu`` (Pollaczek-Khinchine); at ``rho >= 1`` TTFT is infinite. Step
  times stay those of the saturated mix, an upper bound below saturation.
* The KV cache caps ``R``: requests of ``P + O`` tokens that fit in the memory left after the
  weights and the working set of the largest mixed step.

* **Speculative decoding** (multi-token prediction, DeepSeek-V3's MTP; Leviathan et al. ICML
  2023): each decode step verifies ``k`` drafted tokens; with an acceptance rate ``alpha`` per
  draft, a request gains ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per step, so it decodes
  for ``O`` over that many steps. A verifying step runs ``k + 1`` tokens per request through
  the linear layers, reads each cache once, and drafts with ``k`` extra layers (an MTP module
  is one transformer layer); TPOT is the step time over the tokens gained.

With ``C = P`` and ``R = 1`` every step is a whole prefill or a single decode, and TTFT and
TPOT are exactly the static batch-1 ones. One pipeline stage per replica (``pp = 1``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError

__all__ = ["continuous_batching"]


def continuous_batching(
    table: pd.DataFrame,
    keys: list,
    max_running,
    prefill_budget,
    arrival_rate=0.0,
    draft_tokens=0,
    acceptance=0.0,
    mix=None,
) -> pd.DataFrame:
    """Steady state of every serving row (see the module docstring). ``table`` and ``keys``
    as for :func:`~stage_dse.cost.serving.evaluate_serving_table`; ``max_running`` (R),
    ``prefill_budget`` (C, prompt tokens per step) and ``arrival_rate`` (requests/s per
    replica; 0: saturated, no queueing) are scalars or arrays over the rows; ``draft_tokens``
    and ``acceptance``: speculative decoding; ``mix``: ``[(prompt, output_tokens, weight), ...]``
    request classes instead of the rows' own lengths (see the module docstring)."""
    n_rows = len(table)
    if n_rows == 0:
        return pd.DataFrame(index=table.index)
    if (table["pp"] != 1).any():
        raise ConfigError("continuous batching is modelled for one pipeline stage: serving.pp=[1]")
    R = np.broadcast_to(np.asarray(max_running, dtype=float), (n_rows,))
    C = np.broadcast_to(np.asarray(prefill_budget, dtype=float), (n_rows,))
    lam = np.broadcast_to(np.asarray(arrival_rate, dtype=float), (n_rows,))
    for name, v in (("max_running", R), ("prefill_budget", C)):
        if not np.all(v >= 1):
            raise ConfigError(f"serving.{name} must be >= 1, got {v.min():g}")
    if not np.all(lam >= 0):
        raise ConfigError(f"serving.arrival_rate must be >= 0, got {lam.min():g}")
    k = np.broadcast_to(np.asarray(draft_tokens, dtype=float), (n_rows,))
    alpha = np.broadcast_to(np.asarray(acceptance, dtype=float), (n_rows,))
    if not np.all((k >= 0) & (k == np.round(k))):
        raise ConfigError(f"serving.draft_tokens must be an integer >= 0, got {k.max():g}")
    if not np.all((alpha >= 0) & (alpha < 1)):
        raise ConfigError(f"serving.acceptance must be in [0, 1), got {alpha.max():g}")
    # tokens a request gains per decode step: the accepted drafts and the verifier's own
    gain = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    if mix is None:
        classes = [(table["prompt"].to_numpy(float), table["output_tokens"].to_numpy(float), 1.0)]
    else:
        classes = _classes(mix, n_rows)

    def run(**columns) -> pd.DataFrame:
        variant = table.assign(**columns)
        return evaluate_serving_table(variant, keys)

    def mean(values) -> np.ndarray:  # over requests
        return sum(w * v for (_, _, w), v in zip(classes, values))

    n_i = [np.ceil(p / C) for p, _, _ in classes]  # chunks per prompt
    c_i = [p / n for (p, _, _), n in zip(classes, n_i)]
    steps_i = [o / gain for _, o, _ in classes]  # decode steps per request
    n = mean(n_i)
    steps = mean(steps_i)
    c = mean([p for p, _, _ in classes]) / n  # prompt tokens per chunk step
    # decoding requests, weighted by how long each class decodes: their prompt and output
    decode_prompt = mean([s * p for s, (p, _, _) in zip(steps_i, classes)]) / steps
    decode_out = mean([s * o for s, (_, o, _) in zip(steps_i, classes)]) / steps
    lengths = {"prompt": decode_prompt, "output_tokens": decode_out}
    # the KV cache caps the running requests: per-sequence bytes from the decode layout,
    # memory left after the weights and the working set of the largest mixed step
    base = run(micro_batch=np.maximum(R, 1.0), **lengths)
    widest = run(micro_batch=1.0, prompt=np.maximum.reduce(c_i) + R)
    per_seq = base["serve_kv_cache_bytes"].to_numpy() / np.maximum(R, 1.0)
    usable = table["usable_memory"].to_numpy(float)
    free = usable - base["serve_weights_bytes"].to_numpy() - widest["serve_working_bytes"]
    capacity = np.floor(np.maximum(free.to_numpy(), 0.0) / per_seq)
    running = np.minimum(R, capacity)
    ok = running >= 1
    running = np.where(ok, running, 1.0)

    r = np.minimum(1.0 / n, running / (n + steps))
    slot_bound = running / (n + steps) < 1.0 / n
    f = r * n
    d_chunk = np.where(slot_bound, running - 1.0, steps / n)
    layers = table["layers"].to_numpy(float)
    mixed = run(micro_batch=1.0, prompt=c + d_chunk * (k + 1))
    # a class's chunks cost one whole prompt's attention: n_i chunk steps of n_i x att(c_i)
    chunk_attention = (
        mean(
            [
                ni * ni * run(micro_batch=1.0, prompt=ci)["serve_prefill_attention_s"].to_numpy()
                for ni, ci in zip(n_i, c_i)
            ]
        )
        / n
    )
    decoding = run(micro_batch=np.maximum(d_chunk, 1.0), **lengths)
    full = run(micro_batch=running, **lengths)
    verify = run(micro_batch=running * (k + 1), **lengths) if np.any(k > 0) else full
    other = mixed["serve_ttft_s"] - mixed["serve_prefill_attention_s"]
    # a request decoding with k drafts: k + 1 tokens through the linear layers, its cache read
    # once by the attention of all k + 1, and k draft layers (an MTP module, one layer each)
    dec_attn = decoding["serve_decode_attention_s"].to_numpy()
    draft_mix = k * decoding["serve_tpot_s"].to_numpy() / layers
    attn_decode = np.where(d_chunk > 0, dec_attn + draft_mix, 0.0)
    t_mix = other.to_numpy() + chunk_attention + attn_decode
    full_attn = full["serve_decode_attention_s"].to_numpy()
    t_dec = np.where(
        k > 0,
        verify["serve_tpot_s"].to_numpy()
        - verify["serve_decode_attention_s"].to_numpy()
        + full_attn
        + k * full["serve_tpot_s"].to_numpy() / layers,
        full["serve_tpot_s"].to_numpy(),
    )
    step = f * t_mix + (1.0 - f) * t_dec
    seen = np.where(slot_bound, np.minimum(1.0, (running - 1.0) * n / steps), 1.0)
    tpot = (seen * t_mix + (1.0 - seen) * t_dec) / gain
    out_len = mean([o for _, o, _ in classes])
    longest = np.maximum.reduce(n_i)
    replicas = table["dp"].to_numpy(float)  # attention ranks of an expert-parallel replica
    gpus = table["tp"].to_numpy(float) * table["pp"].to_numpy(float) * replicas
    mu = r / step * replicas  # requests/s at saturation
    rho = lam / mu
    with np.errstate(divide="ignore"):
        wait = np.where(rho < 1, rho / (2 * (1 - rho)) / mu, np.inf)
    out = pd.DataFrame(
        {
            "cb_running": running,
            "cb_decode_batch": f * d_chunk + (1 - f) * running,
            "cb_chunk_tokens": c,
            "cb_step_s": step,
            "cb_mixed_step_s": t_mix,
            "cb_decode_step_s": t_dec,
            "cb_ttft_s": n * t_mix + wait,
            "cb_ttft_longest_s": longest * t_mix + wait,
            "cb_tpot_s": tpot,
            "cb_requests_per_s": mu,
            "cb_tokens_per_s": mu * out_len,
            "cb_tokens_per_s_per_gpu": mu * out_len / gpus,
            "cb_tokens_per_s_per_user": 1.0 / tpot,
            "cb_kv_capacity_seqs": capacity,
            "cb_working_bytes": widest["serve_working_bytes"].to_numpy(),
        },
        index=table.index,
    )
    kept = ("cb_kv_capacity_seqs", "cb_working_bytes")
    out.loc[~ok, [c for c in out.columns if c not in kept]] = np.nan
    return out


def _classes(mix, n_rows: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Request classes ``(prompt, output_tokens, weight)``, weights normalised."""
    classes = [tuple(float(x) for x in item) for item in mix]
    if not classes or any(len(c) != 3 for c in classes):
        raise ConfigError("serving.request_mix: give [[prompt, output_tokens, weight], ...]")
    for p, o, w in classes:
        if not (p >= 1 and o >= 1 and w > 0):
            raise ConfigError(
                f"serving.request_mix: prompt and output_tokens must be >= 1 and weights > 0, "
                f"got [{p:g}, {o:g}, {w:g}]"
            )
    total = sum(w for _, _, w in classes)
    return [(np.full(n_rows, p), np.full(n_rows, o), w / total) for p, o, w in classes]
