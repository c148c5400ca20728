"""Disaggregated serving: prefill and decode on separate GPU pools (DistServe, Zhong et al.
OSDI 2024; Splitwise, Patel et al. ISCA 2024; NVIDIA Dynamo), and the replica ratio.

A **prefill replica** (its own layout, possibly another GPU type) runs prompts one batch of
``prefill_batch`` at a time: each request's first token comes after the batch's prefill, the
static TTFT of that batch; it serves ``prefill_batch / TTFT`` requests/s. Its KV cache then
travels to a decode replica: ``prompt x kv_bytes_per_token`` bytes per request, sent by the
prefill replica's GPUs in parallel (each holds its tensor-parallel shard) over the scale-out
NIC, or over NVLink when both pools sit in one NVLink domain (``kv_link="nvlink"``); the
transfer adds to TTFT. A **decode replica** keeps ``R`` requests decoding (no prefill steps
between them): one step of ``R`` tokens, the static decode step at batch ``R`` (its TPOT); it
serves ``R / (output_tokens x TPOT)`` requests/s.

``x`` prefill and ``y`` decode replicas (``xPyD``) serve ``min(x mu_p, y mu_d)`` requests/s on
``x g_p + y g_d`` GPUs; :func:`best_ratio` picks the small integer pair with the most output
tokens/s per GPU, so that neither pool starves the other.

Under measured kernel timing (the pools' static outputs evaluated with ``timing="measured"``)
``dis_measured_share`` is the share of a request's time, ``TTFT + (output_tokens - 1) x
TPOT`` with the transfer in TTFT, that came from tables: the prefill pool's measured share of
its TTFT and the decode pool's of its TPOT, weighted by their parts (the KV transfer is the
network model's).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["best_ratio", "disaggregated", "kv_transfer_bytes"]


def kv_transfer_bytes(static: pd.DataFrame, prompt) -> np.ndarray:
    """Bytes of KV cache one request hands from prefill to decode: its prompt's tokens times
    the cache bytes per token of the whole model (``serve_kv_bytes_per_token``)."""
    return np.asarray(prompt, dtype=float) * static["serve_kv_bytes_per_token"].to_numpy()


def disaggregated(
    prefill: pd.DataFrame,
    decode: pd.DataFrame,
    *,
    prompt,
    output_tokens,
    prefill_batch,
    decode_batch,
    prefill_gpus,
    decode_gpus,
    link_bytes_per_s,
    link_latency_s=0.0,
) -> pd.DataFrame:
    """Per-replica figures of a prefill pool and a decode pool, row by row: ``prefill`` and
    ``decode`` are static serving outputs (:func:`~stage_dse.cost.serving.evaluate_serving_table`)
    at batch ``prefill_batch`` and ``decode_batch``; ``link_bytes_per_s`` is the per-GPU bandwidth
    the prefill GPUs send the cache with (``inf``: a free network)."""
    ttft_prefill = prefill["serve_ttft_s"].to_numpy()
    kv = kv_transfer_bytes(prefill, prompt)
    send = np.asarray(prefill_gpus, float) * np.asarray(link_bytes_per_s, float)
    with np.errstate(divide="ignore"):
        transfer = np.where(np.isinf(send), 0.0, kv / send + link_latency_s)
    tpot = decode["serve_tpot_s"].to_numpy()
    mu_p = np.asarray(prefill_batch, float) / ttft_prefill
    mu_d = np.asarray(decode_batch, float) / (np.asarray(output_tokens, float) * tpot)
    after = (np.asarray(output_tokens, float) - 1) * tpot
    measured = _share(prefill, "serve_ttft_measured_share") * ttft_prefill
    measured = measured + _share(decode, "serve_tpot_measured_share") * after
    return pd.DataFrame(
        {
            "dis_ttft_s": ttft_prefill + transfer,
            "dis_kv_transfer_s": transfer,
            "dis_kv_bytes_per_request": kv,
            "dis_tpot_s": tpot,
            "dis_prefill_requests_per_s": mu_p,
            "dis_decode_requests_per_s": mu_d,
            "dis_prefill_gpus": np.broadcast_to(np.asarray(prefill_gpus, float), tpot.shape),
            "dis_decode_gpus": np.broadcast_to(np.asarray(decode_gpus, float), tpot.shape),
            "dis_measured_share": measured / (ttft_prefill + transfer + after),
        },
        index=decode.index,
    )


def _share(static: pd.DataFrame, name: str) -> np.ndarray:
    """A measured share of static serving outputs (0: roofline timing)."""
    return static[name].to_numpy() if name in static else np.zeros(len(static))


def best_ratio(per_replica: pd.DataFrame, output_tokens, max_replicas: int = 8) -> pd.DataFrame:
    """The ``xPyD`` (1 <= x, y <= ``max_replicas``) with the most output tokens/s per GPU for
    each row of :func:`disaggregated`; its throughput, GPUs and which pool limits it."""
    mu_p = per_replica["dis_prefill_requests_per_s"].to_numpy()[:, None, None]
    mu_d = per_replica["dis_decode_requests_per_s"].to_numpy()[:, None, None]
    g_p = per_replica["dis_prefill_gpus"].to_numpy()[:, None, None]
    g_d = per_replica["dis_decode_gpus"].to_numpy()[:, None, None]
    x = np.arange(1, max_replicas + 1)[None, :, None]
    y = np.arange(1, max_replicas + 1)[None, None, :]
    rate = np.minimum(x * mu_p, y * mu_d)
    gpus = x * g_p + y * g_d
    per_gpu = rate * np.asarray(output_tokens, float).reshape(-1, 1, 1) / gpus
    flat = per_gpu.reshape(len(per_replica), -1)
    best = np.nanargmax(np.where(np.isfinite(flat), flat, -np.inf), axis=1)
    bx, by = np.unravel_index(best, (max_replicas, max_replicas))
    rows = np.arange(len(per_replica))
    return pd.DataFrame(
        {
            "dis_prefill_replicas": bx + 1,
            "dis_decode_replicas": by + 1,
            "dis_requests_per_s": rate.reshape(len(rows), -1)[rows, best],
            "dis_gpus": gpus.reshape(len(rows), -1)[rows, best],
            "dis_tokens_per_s_per_gpu": flat[rows, best],
            "dis_limited_by": np.where(
                (bx + 1) * mu_p[:, 0, 0] <= (by + 1) * mu_d[:, 0, 0], "prefill", "decode"
            ),
        },
        index=per_replica.index,
    )
