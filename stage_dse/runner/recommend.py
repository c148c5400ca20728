"""``recommend``: the fewest GPUs that serve a request rate within latency targets (SLAs).

For one model, GPU and workload (prompt and output lengths), every candidate deployment is
costed with the serving model and sized to the target rate:

* **aggregated** replicas (tensor parallelism ``tp``, continuous batching with at most ``R``
  running requests and a prefill budget of ``C`` tokens per step, :mod:`stage_dse.cost.batching`):
  a replica qualifies when its TPOT meets the TPOT target and its TTFT without queueing meets
  the TTFT target; it then takes up to ``lambda* = rho* mu`` requests/s, where ``mu`` is its
  saturated rate and ``rho*`` the load at which the M/D/1 wait uses up the TTFT margin
  ``m`` (``rho / (2 (1 - rho)) / mu = m``, so ``rho* = 2 m mu / (1 + 2 m mu)``);
  ``ceil(target / lambda*)`` replicas;
* **disaggregated** pools (:mod:`stage_dse.cost.disagg`): prefill replicas (on
  ``prefill_hardware`` if given) sized the same way against the TTFT target (their TTFT includes
  the KV transfer over the NIC, or NVLink), decode replicas (batch ``R``) to their saturated
  rate when their TPOT meets the target;
* at the disaggregated answer's GPU count, :func:`aggregated_rate_at` gives what the best
  qualifying aggregated layout serves on as many GPUs: the comparison at equal GPUs.

The answer is the qualifying candidate with the fewest GPUs (then the most output tokens/s per
GPU), aggregated and disaggregated; when nothing qualifies, the candidate that misses by the
least (the largest ratio of a latency to its target) and by how much.

``timing="measured"`` costs every candidate with measured kernel times (both pools' GPUs on
their table sets, :func:`stage_dse.runner.serving.serving_timing`); every candidate row says
its ``timing`` and ``measured_share`` (aggregated: of the mean engine step; disaggregated: of a
request's time, :mod:`stage_dse.cost.disagg`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from stage_dse.cost.batching import continuous_batching
from stage_dse.cost.disagg import disaggregated
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.runner.serving import measured_step_share, serving_row, serving_timing
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec
from stage_dse.spec.serving import ServingSpec

__all__ = ["Recommendation", "aggregated_rate_at", "recommend", "sla_load"]

RUNNING = (8, 16, 32, 64, 128, 256)
BUDGETS = (512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (8, 16, 32, 64, 128, 256, 512)


def sla_load(mu: np.ndarray, ttft0: np.ndarray, ttft_sla: float) -> np.ndarray:
    """Requests/s a replica of saturated rate ``mu`` and unqueued TTFT ``ttft0`` takes while
    its M/D/1 TTFT stays within ``ttft_sla`` (0 when ``ttft0`` alone misses it)."""
    margin = np.maximum(ttft_sla - ttft0, 0.0) * mu
    return mu * 2 * margin / (1 + 2 * margin)


@dataclass(frozen=True)
class Recommendation:
    aggregated: pd.DataFrame
    """Qualifying aggregated deployments, fewest GPUs first (``gpus``, ``replicas``, ...)."""
    disaggregated: pd.DataFrame
    """Qualifying disaggregated deployments, fewest GPUs first."""
    near_miss: pd.DataFrame
    """The closest candidates that miss a target, least miss first (``miss``: worst ratio)."""


def _rows(model, hardware, cluster, tps, batches, prompt, out_len):
    rows, keys, meta = [], [], []
    for tp, batch in itertools.product(tps, batches):
        serving = ServingSpec(prompt_len=prompt, output_tokens=out_len, batch_size=batch)
        try:
            row, key = serving_row(model, serving, hardware, cluster, tp)
        except ConfigError:
            continue
        rows.append(row)
        keys.append(key)
        meta.append((tp, batch))
    return pd.DataFrame(rows), keys, meta


def recommend(
    model: ModelSpec,
    hardware: HardwareSpec,
    cluster: ClusterSpec,
    *,
    prompt: int,
    output_tokens: int,
    target_requests_per_s: float,
    ttft_sla_s: float,
    tpot_sla_s: float,
    tps: tuple[int, ...] = (1, 2, 4, 8),
    prefill_hardware: HardwareSpec | None = None,
    kv_link: str = "nic",
    timing: str = "roofline",
) -> Recommendation:
    """See the module docstring. ``prefill_hardware``: the GPU of the disaggregated prefill
    pool (default ``hardware``); ``kv_link``: ``nic`` (scale-out network) or ``nvlink`` (both
    pools in one NVLink domain) for the KV transfer; ``timing``: ``roofline`` or
    ``measured``."""
    if kv_link not in ("nic", "nvlink"):
        raise ConfigError(f"serving.kv_link={kv_link!r} is not one of: nic, nvlink")
    for name, value in (
        ("target_requests_per_s", target_requests_per_s),
        ("ttft_sla_s", ttft_sla_s),
        ("tpot_sla_s", tpot_sla_s),
    ):
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    target = float(target_requests_per_s)
    pre_hw = prefill_hardware or hardware
    measured = serving_timing(timing, (hardware, pre_hw))
    tps = tuple(t for t in tps if t <= cluster.gpus_per_node)
    # aggregated: every (tp, R, C) with continuous batching
    table, keys, meta = _rows(model, hardware, cluster, tps, (1,), prompt, output_tokens)
    if not len(table):
        raise ConfigError(f"no tensor-parallel degree in {tps} fits {model.name}'s heads")
    grid = list(itertools.product(range(len(table)), RUNNING, BUDGETS))
    big = table.iloc[[i for i, _, _ in grid]].reset_index(drop=True)
    big_keys = [keys[i] for i, _, _ in grid]
    limits = (np.array([r for _, r, _ in grid]), np.array([c for _, _, c in grid]))
    cb = continuous_batching(big, big_keys, *limits, timing=measured)
    agg = pd.DataFrame(
        {
            "tp": [meta[i][0] for i, _, _ in grid],
            "max_running": [r for _, r, _ in grid],
            "prefill_budget": [c for _, _, c in grid],
            "ttft_s": cb["cb_ttft_s"],
            "tpot_s": cb["cb_tpot_s"],
            "replica_requests_per_s": cb["cb_requests_per_s"],
            "measured_share": measured_step_share(
                big, big_keys, measured, cb["cb_step_s"], *limits
            ),
        }
    )
    agg["replica_gpus"] = agg["tp"]
    agg["load_per_replica"] = sla_load(
        agg["replica_requests_per_s"].to_numpy(), agg["ttft_s"].to_numpy(), ttft_sla_s
    )
    agg["miss"] = np.maximum(agg["ttft_s"] / ttft_sla_s, agg["tpot_s"] / tpot_sla_s)
    ok = (agg["miss"] <= 1) & (agg["load_per_replica"] > 0)
    agg["replicas"] = np.where(ok, np.ceil(target / agg["load_per_replica"].where(ok, 1)), np.nan)
    agg["gpus"] = agg["replicas"] * agg["replica_gpus"]
    agg["tokens_per_s_per_gpu"] = target * output_tokens / agg["gpus"]
    agg["kind"] = "aggregated"

    # disaggregated: prefill replicas (tp, batch 1) and decode replicas (tp, batch R)
    pre_t, pre_k, pre_m = _rows(model, pre_hw, cluster, tps, (1,), prompt, output_tokens)
    dec_t, dec_k, dec_m = _rows(
        model, hardware, cluster, tps, DECODE_BATCHES, prompt, output_tokens
    )
    pre = evaluate_serving_table(pre_t, pre_k, timing=measured)
    dec = evaluate_serving_table(dec_t, dec_k, timing=measured)
    dec_fits = (dec["serve_mem_headroom_bytes"] >= 0).to_numpy()
    pairs = [(i, j) for i in range(len(pre)) for j in range(len(dec)) if dec_fits[j]]
    p_idx, d_idx = [i for i, _ in pairs], [j for _, j in pairs]
    per = disaggregated(
        pre.iloc[p_idx].reset_index(drop=True),
        dec.iloc[d_idx].reset_index(drop=True),
        prompt=prompt,
        output_tokens=output_tokens,
        prefill_batch=1,
        decode_batch=np.array([dec_m[j][1] for j in d_idx], float),
        prefill_gpus=np.array([pre_m[i][0] for i in p_idx], float),
        decode_gpus=np.array([dec_m[j][0] for j in d_idx], float),
        link_bytes_per_s=cluster.inter_bandwidth_bytes_per_s
        if kv_link == "nic"
        else cluster.intra_bandwidth_bytes_per_s,
        link_latency_s=cluster.inter_latency_s if kv_link == "nic" else cluster.intra_latency_s,
    )
    dis = pd.DataFrame(
        {
            "prefill_tp": [pre_m[i][0] for i in p_idx],
            "decode_tp": [dec_m[j][0] for j in d_idx],
            "decode_batch": [dec_m[j][1] for j in d_idx],
            "ttft_s": per["dis_ttft_s"],
            "tpot_s": per["dis_tpot_s"],
            "measured_share": per["dis_measured_share"],
        }
    )
    load_p = sla_load(
        per["dis_prefill_requests_per_s"].to_numpy(), per["dis_ttft_s"].to_numpy(), ttft_sla_s
    )
    dis["miss"] = np.maximum(dis["ttft_s"] / ttft_sla_s, dis["tpot_s"] / tpot_sla_s)
    ok = ((dis["miss"] <= 1) & (load_p > 0)).to_numpy()
    dis["prefill_replicas"] = np.where(ok, np.ceil(target / np.where(ok, load_p, 1)), np.nan)
    dis["decode_replicas"] = np.where(
        ok, np.ceil(target / per["dis_decode_requests_per_s"].to_numpy()), np.nan
    )
    dis["gpus"] = (
        dis["prefill_replicas"] * dis["prefill_tp"] + dis["decode_replicas"] * dis["decode_tp"]
    )
    dis["tokens_per_s_per_gpu"] = target * output_tokens / dis["gpus"]
    dis["kind"] = "disaggregated"
    dis["prefill_hardware"] = pre_hw.name
    agg["timing"] = dis["timing"] = measured.source

    order = ["gpus", "tokens_per_s_per_gpu"]
    good_agg = agg[agg["gpus"].notna()].sort_values(order, ascending=[True, False])
    good_dis = dis[dis["gpus"].notna()].sort_values(order, ascending=[True, False])
    misses = pd.concat([agg[agg["gpus"].isna()], dis[dis["gpus"].isna()]])
    near = misses[np.isfinite(misses["miss"])].sort_values("miss").head(5)
    return Recommendation(
        good_agg.reset_index(drop=True),
        good_dis.reset_index(drop=True),
        near.reset_index(drop=True),
    )


def aggregated_rate_at(aggregated: pd.DataFrame, gpus: float) -> tuple[float, pd.Series | None]:
    """The most requests/s qualifying aggregated replicas serve on ``gpus`` GPUs (whole
    replicas of one layout, each at its SLA load), and that layout."""
    if aggregated.empty:
        return 0.0, None
    rate = np.floor(gpus / aggregated["replica_gpus"]) * aggregated["load_per_replica"]
    best = int(np.argmax(rate.to_numpy()))
    return float(rate.iloc[best]), aggregated.iloc[best]
