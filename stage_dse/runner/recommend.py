"""``recommend``: the fewest GPUs that serve a request rate within latency targets (SLAs).

For one model, GPU and workload (prompt and output lengths, or a request mix), every candidate
deployment is costed with the serving model and sized to the target rate:

* **aggregated** replicas (tensor parallelism ``tp`` times expert parallelism ``ep``, continuous
  batching with at most ``R`` running requests per attention rank and a prefill budget of ``C``
  tokens per step, :mod:`stage_dse.cost.batching`): a replica qualifies when its TPOT meets the
  TPOT target and its TTFT without queueing meets the TTFT target; each of its ``ep`` attention
  ranks (one for a dense model) then takes up to ``lambda* = rho* mu`` requests/s, where ``mu``
  is the rank's saturated rate and ``rho*`` the load at which the M/D/1 wait uses up the TTFT
  margin ``m`` (``rho / (2 (1 - rho)) / mu = m``, so ``rho* = 2 m mu / (1 + 2 m mu)``): the
  ranks queue apart, as each attention data-parallel rank admits its own requests;
  ``ceil(target / (ep lambda*))`` replicas;
* **disaggregated** pools (:mod:`stage_dse.cost.disagg`): prefill replicas (on
  ``prefill_hardware`` if given; ``tp x ep`` GPUs, one prompt per attention rank) sized the
  same way against the TTFT target (their TTFT includes the KV transfer over the NIC, or
  NVLink), decode replicas (batch ``R`` per attention rank) to their saturated rate when their
  TPOT meets the target;
* at the disaggregated answer's GPU count, :func:`aggregated_rate_at` gives what the best
  qualifying aggregated layout serves on as many GPUs: the comparison at equal GPUs.

**Running limits.** The running requests per attention rank are capped by ``max_running``
(default: the engine profile's ``max_running``, ``max_num_seqs``) and by the KV cache that fits
(``cb_kv_capacity_seqs``: the memory left after the weights in ``weights_dtype`` and the widest
step's working set, in sequences of ``kv_dtype`` cache): the candidates are the powers of two
from 8 below ``min(max_running, KV capacity)`` and that limit itself (:func:`running_limits`),
for each layout and prefill budget; disaggregated decode batches likewise (the powers of two
from 8 and the largest batch whose cache fits beside its static pass's working set). Every
candidate row says which limit bound its rate (``bound``, the ``cb_bound`` of continuous
batching): ``tokens`` (every step full at the prefill budget), ``slots`` (the running limit),
``kv`` (the KV capacity: the running limit was cut to it, or not one sequence fits) or, for a
decode pool, ``slots``/``kv`` by the same rule.

**Engines.** ``engine`` (an :class:`~stage_dse.spec.engine.EngineSpec`) adds its per-iteration
and per-running-request costs: the ``step_overhead_s``/``request_overhead_s`` columns continuous
batching reads (aggregated), added to each prefill pass and decode step of the static pools
(disaggregated).

**Request mix.** ``mix=[(prompt, output_tokens, weight), ...]`` replaces the fixed lengths:
aggregated replicas run the classes through continuous batching (``ttft_s`` is the mean over
requests); disaggregated pools are costed at the mix's mean prompt and output lengths (the
prefill pass of the mean prompt, not the mean of the classes' passes: a simplification).

The answer is the qualifying candidate with the fewest GPUs (then the most output tokens/s per
GPU, the most slack under the targets, the smallest running limit or decode batch),
aggregated and disaggregated; when nothing qualifies, the candidate that misses by the
least (the largest ratio of a latency to its target) and by how much.

``timing="measured"`` costs every candidate with measured kernel times (both pools' GPUs on
their table sets, :func:`stage_dse.runner.serving.serving_timing`); every candidate row says
its ``timing`` and ``measured_share`` (aggregated: of the mean engine step; disaggregated: of a
request's time, :mod:`stage_dse.cost.disagg`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from stage_dse.cost.batching import continuous_batching
from stage_dse.cost.disagg import disaggregated
from stage_dse.cost.requests import request_classes
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.runner.serving import measured_step_share, serving_row, serving_timing
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec
from stage_dse.spec.engine import EngineSpec
from stage_dse.spec.serving import ServingSpec

__all__ = [
    "BOUND_WORDS",
    "Recommendation",
    "aggregated_rate_at",
    "recommend",
    "running_limits",
    "sla_load",
]

BUDGETS = (512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (8, 16, 32, 64, 128, 256, 512)
SMALLEST_RUNNING = 8
"""The smallest power-of-two running limit tried (below it only the limit itself)."""
BOUND_WORDS = {
    "tokens": "the prefill budget",
    "slots": "the running limit",
    "kv": "the KV capacity",
    "load": "the load",
}
"""What each ``bound`` value means, in words for printouts."""


def sla_load(mu: np.ndarray, ttft0: np.ndarray, ttft_sla: float) -> np.ndarray:
    """Requests/s a replica of saturated rate ``mu`` and unqueued TTFT ``ttft0`` takes while
    its M/D/1 TTFT stays within ``ttft_sla`` (0 when ``ttft0`` alone misses it)."""
    margin = np.maximum(ttft_sla - ttft0, 0.0) * mu
    return mu * 2 * margin / (1 + 2 * margin)


def _pool_columns(engine, hardware, ranks) -> dict[str, np.ndarray]:
    """The engine's KV-pool bounds per layout row (tp x pp ``ranks``)."""
    rows = [engine.kv_pool_columns(hardware.hbm_bytes, int(r)) for r in ranks]
    return {name: np.array([row[name] for row in rows], float) for name in rows[0]} if rows else {}


def running_limits(limit: float) -> tuple[int, ...]:
    """Running-request limits tried under ``limit`` (the engine's cap or the KV capacity,
    whichever is lower): powers of two from 8 below it, then ``limit`` itself (nothing when
    not one request fits)."""
    top = int(limit)
    if top < 1:
        return ()
    powers = itertools.takewhile(lambda r: r < top, (SMALLEST_RUNNING << i for i in range(64)))
    return (*powers, top)


@dataclass(frozen=True)
class Recommendation:
    aggregated: pd.DataFrame
    """Qualifying aggregated deployments, fewest GPUs first (``gpus``, ``replicas``, ...)."""
    disaggregated: pd.DataFrame
    """Qualifying disaggregated deployments, fewest GPUs first."""
    near_miss: pd.DataFrame
    """The closest candidates that miss a target, least miss first (``miss``: worst ratio)."""


def _layouts(model, base: ServingSpec, hardware, cluster, tps, eps, batches, engine):
    """Symbol rows of every buildable (tp, ep, batch) under ``engine``: rows, keys, (tp, ep,
    batch) and the reasons of the layouts that could not be built, by (tp, ep)."""
    rows, keys, meta, rejected = [], [], [], {}
    expert_bytes = engine.expert_gemm_bytes(base, hardware)
    for tp, ep in itertools.product(tps, eps):
        if tp > cluster.gpus_per_node:
            rejected[tp, ep] = (
                f"tp({tp}) exceeds the cluster's {cluster.gpus_per_node} GPUs per node"
            )
            continue
        for batch in batches:
            try:
                row, key = serving_row(
                    model, base.replace(batch_size=batch), hardware, cluster, tp, 1, ep
                )
            except ConfigError as exc:
                rejected[tp, ep] = str(exc)
                break
            row["expert_gemm_bytes"] = expert_bytes
            rows.append(row)
            keys.append(key)
            meta.append((tp, ep, batch))
    return pd.DataFrame(rows), keys, meta, rejected


def _none_buildable(model, tps, eps, rejected) -> ConfigError:
    """One line naming the field whose values left no layout: ``serving.ep`` when every ep
    is refused for itself (a dense model, not dividing the experts), else ``serving.tp``."""
    ep_reasons = {ep: why for (_, ep), why in rejected.items() if why.startswith("ep(")}
    bad_eps = [ep for ep in eps if ep in ep_reasons]
    if bad_eps and len(bad_eps) == len(eps):
        return ConfigError(
            f"serving.ep={list(eps)}: no expert-parallel size can serve {model.name}: "
            f"{ep_reasons[bad_eps[0]]}"
        )
    reason = next(iter(rejected.values()), "no candidates")
    return ConfigError(
        f"serving.tp={list(tps)}: no tensor-parallel degree can serve {model.name}: {reason}"
    )


def _lengths(prompt, output_tokens, mix):
    """The workload's classes ``[(prompt, output, weight)]`` (weights normalised) and the mean
    prompt and output lengths the static parts are costed at."""
    if mix:
        if prompt is not None or output_tokens is not None:
            raise ConfigError("recommend: give prompt and output_tokens or a request mix, not both")
        classes = request_classes(mix)
        mean_p = sum(p * w for p, _, w in classes)
        mean_o = sum(o * w for _, o, w in classes)
        return classes, max(1, round(mean_p)), max(1, round(mean_o)), mean_o
    if prompt is None or output_tokens is None:
        raise ConfigError("recommend: give prompt and output_tokens (or a request mix)")
    return None, prompt, output_tokens, float(output_tokens)


def recommend(
    model: ModelSpec,
    hardware: HardwareSpec,
    cluster: ClusterSpec,
    *,
    target_requests_per_s: float,
    ttft_sla_s: float,
    tpot_sla_s: float,
    prompt: int | None = None,
    output_tokens: int | None = None,
    mix: Sequence[tuple[float, float, float]] | None = None,
    tps: Sequence[int] = (1, 2, 4, 8),
    eps: Sequence[int] = (1,),
    weights_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    expert_weights_dtype: str | None = None,
    moe_routing: str = "power_law_1.01",
    moe_dispatch: str = "allgather",
    max_running: int | None = None,
    prefill_budgets: Sequence[int] = BUDGETS,
    engine: EngineSpec | None = None,
    prefill_hardware: HardwareSpec | None = None,
    kv_link: str = "nic",
    timing: str = "roofline",
) -> Recommendation:
    """See the module docstring. ``prompt``/``output_tokens`` or ``mix`` (request classes
    ``(prompt, output_tokens, weight)``); ``tps``/``eps``: the tensor- and expert-parallel
    sizes tried (ep > 1 for mixture-of-experts models: attention data-parallel over the ep
    ranks, ``tp x ep`` GPUs per replica; layouts that cannot be built are skipped);
    ``weights_dtype``, ``kv_dtype``, ``expert_weights_dtype``: as in
    :class:`~stage_dse.spec.serving.ServingSpec`; ``max_running``: running requests per
    attention rank at most (default: ``engine.max_running``; the KV capacity caps it too);
    ``engine``: the engine profile (default: none, the kernels alone);
    ``prefill_hardware``: the GPU of the disaggregated prefill pool (default ``hardware``);
    ``kv_link``: ``nic`` (scale-out network) or ``nvlink`` (both pools in one NVLink domain)
    for the KV transfer; ``timing``: ``roofline`` or ``measured``."""
    if kv_link not in ("nic", "nvlink"):
        raise ConfigError(f"serving.kv_link={kv_link!r} is not one of: nic, nvlink")
    for name, value in (
        ("target_requests_per_s", target_requests_per_s),
        ("ttft_sla_s", ttft_sla_s),
        ("tpot_sla_s", tpot_sla_s),
    ):
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    engine = engine or EngineSpec()
    cap = engine.max_running if max_running is None else max_running
    if isinstance(cap, bool) or not isinstance(cap, int | np.integer) or cap < 1:
        raise ConfigError(f"max_running (serving.batch_size) must be an integer >= 1, got {cap!r}")
    for name, values in (("tp", tps), ("ep", eps), ("prefill_budget", prefill_budgets)):
        if not len(values) or any(
            isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1 for v in values
        ):
            raise ConfigError(f"serving.{name}={list(values)} must be integers >= 1")
    classes, prompt, output_tokens, mean_out = _lengths(prompt, output_tokens, mix)
    if expert_weights_dtype is not None and not model.is_moe:
        raise ConfigError(
            f"serving.expert_weights_dtype={expert_weights_dtype} needs a mixture-of-experts "
            f"model; {model.name} has no experts (use weights_dtype)"
        )
    base = ServingSpec(
        prompt_len=prompt,
        output_tokens=output_tokens,
        weights_dtype=weights_dtype,
        kv_dtype=kv_dtype,
        expert_weights_dtype=expert_weights_dtype,
        moe_routing=moe_routing,
        moe_dispatch=moe_dispatch,
    )
    target = float(target_requests_per_s)
    pre_hw = prefill_hardware or hardware
    measured = serving_timing(timing, (hardware, pre_hw))
    tps, eps = tuple(int(t) for t in tps), tuple(int(e) for e in eps)
    table, keys, meta, rejected = _layouts(model, base, hardware, cluster, tps, eps, (1,), engine)
    if not len(table):
        raise _none_buildable(model, tps, eps, rejected)
    for name, value in engine.cost_columns().items():
        table[name] = value
    table["context_attention_speed"] = engine.context_attention_speed(
        base.weights_dtype, base.kv_dtype, hardware.fp8_attention_speedup
    )
    ranks = table["tp"].to_numpy() * table["pp"].to_numpy()
    for name, values in _pool_columns(engine, hardware, ranks).items():
        table[name] = values
    agg = _aggregated(table, keys, meta, cap, prefill_budgets, classes, measured)
    agg["load_per_replica"] = agg["ep"] * sla_load(
        agg["replica_requests_per_s"].to_numpy() / agg["ep"].to_numpy(),
        agg["ttft_s"].to_numpy(),
        ttft_sla_s,
    )
    agg["miss"] = np.maximum(agg["ttft_s"] / ttft_sla_s, agg["tpot_s"] / tpot_sla_s)
    ok = (agg["miss"] <= 1) & (agg["load_per_replica"] > 0)
    agg["replicas"] = np.where(ok, np.ceil(target / agg["load_per_replica"].where(ok, 1)), np.nan)
    agg["gpus"] = agg["replicas"] * agg["replica_gpus"]
    agg["tokens_per_s_per_gpu"] = target * mean_out / agg["gpus"]
    agg["kind"] = "aggregated"

    dis = _disaggregated(
        model, base, hardware, pre_hw, cluster, tps, eps, cap, engine, measured, kv_link,
        ttft_sla_s, tpot_sla_s, target, mean_out,
    )  # fmt: skip
    for frame in (agg, dis):
        frame["timing"] = measured.source
        frame["weights_dtype"] = base.weights_dtype.value
        frame["kv_dtype"] = base.kv_dtype.value
        frame["expert_weights_dtype"] = base.experts_dtype.value if model.is_moe else None
        frame["engine"] = engine.name
        frame["step_overhead_s"] = engine.step_overhead_s
        frame["request_overhead_s"] = engine.request_overhead_s
        frame["running_cap"] = cap

    # fewest GPUs, then the most slack under the targets, then the smallest running limit
    order, up = ["gpus", "tokens_per_s_per_gpu", "miss"], [True, False, True]
    good_agg = agg[agg["gpus"].notna()].sort_values(
        [*order, "max_running"], ascending=[*up, True], kind="stable"
    )
    good_dis = dis[dis["gpus"].notna()].sort_values(
        [*order, "decode_batch"], ascending=[*up, True], kind="stable"
    )
    misses = pd.concat([agg[agg["gpus"].isna()], dis[dis["gpus"].isna()]])
    near = misses[np.isfinite(misses["miss"])]
    near = near.sort_values(["miss", "max_running", "decode_batch"], kind="stable").head(5)
    return Recommendation(
        good_agg.reset_index(drop=True),
        good_dis.reset_index(drop=True),
        near.reset_index(drop=True),
    )


def _aggregated(table, keys, meta, cap, budgets, classes, measured) -> pd.DataFrame:
    """Every (layout, running limit, prefill budget) under continuous batching. A first pass at
    the cap gives each (layout, budget) its KV capacity and is the candidate at
    ``min(cap, capacity)``; the powers of two below that limit are evaluated after it."""
    mix = classes or None

    def run(grid):
        big = table.iloc[[i for i, _, _ in grid]].reset_index(drop=True)
        big_keys = [keys[i] for i, _, _ in grid]
        limits = (
            np.array([r for _, r, _ in grid], float),
            np.array([c for _, _, c in grid], float),
        )
        cb = continuous_batching(big, big_keys, *limits, mix=mix, timing=measured)
        share = measured_step_share(big, big_keys, measured, cb["cb_step_s"], *limits, mix=mix)
        return cb.assign(measured_share=share)

    first_grid = [(i, cap, c) for i in range(len(table)) for c in budgets]
    first = run(first_grid)
    capacity = first["cb_kv_capacity_seqs"].to_numpy()
    limit = np.minimum(cap, capacity)
    grid, parts = [], [first]
    for (i, _, c), lim in zip(first_grid, limit):
        grid += [(i, r, c) for r in running_limits(lim)[:-1]]
    if grid:
        parts.append(run(grid))
    cb = pd.concat(parts, ignore_index=True)
    full = first_grid + grid
    # the first pass ran at the cap: its running limit is what the KV cache leaves of it
    running_limit = np.concatenate([np.maximum(limit, 0), [r for _, r, _ in grid]])
    tp = np.array([meta[i][0] for i, _, _ in full])
    ep = np.array([meta[i][1] for i, _, _ in full])
    return pd.DataFrame(
        {
            "tp": tp,
            "ep": ep,
            "max_running": running_limit.astype(int),
            "prefill_budget": [c for _, _, c in full],
            "ttft_s": cb["cb_ttft_s"],
            "tpot_s": cb["cb_tpot_s"],
            "replica_requests_per_s": cb["cb_requests_per_s"],
            "running": cb["cb_running"],
            "kv_capacity_seqs": cb["cb_kv_capacity_seqs"],
            "bound": cb["cb_bound"],
            "measured_share": cb["measured_share"],
            "replica_gpus": tp * ep,
        }
    )


def _with_engine(static: pd.DataFrame, engine: EngineSpec, batch, column: str) -> pd.DataFrame:
    """A static pass's ``column`` (``serve_ttft_s`` or ``serve_tpot_s``) with the engine's
    per-iteration and per-request costs of a batch of ``batch`` added (measured shares kept
    as shares of the longer time)."""
    extra = engine.step_overhead_s + engine.request_overhead_s * np.asarray(batch, float)
    if not np.any(extra):
        return static
    out = static.copy()
    kernels = static[column].to_numpy()
    out[column] = kernels + extra
    share = column.replace("_s", "_measured_share")
    if share in out:
        out[share] = static[share].to_numpy() * kernels / out[column].to_numpy()
    return out


def _disaggregated(
    model, base, hardware, pre_hw, cluster, tps, eps, cap, engine, measured, kv_link,
    ttft_sla_s, tpot_sla_s, target, mean_out,
) -> pd.DataFrame:  # fmt: skip
    """Prefill replicas (tp, ep, one prompt per attention rank) and decode replicas (tp, ep,
    batch per rank up to the running cap and the KV capacity), every pair, sized to the
    target."""
    pre_t, pre_k, pre_m, _ = _layouts(model, base, pre_hw, cluster, tps, eps, (1,), engine)
    if len(pre_t):
        pre_t["context_attention_speed"] = engine.context_attention_speed(
            base.weights_dtype, base.kv_dtype, pre_hw.fp8_attention_speedup
        )
    one_t, one_k, one_m, _ = _layouts(model, base, hardware, cluster, tps, eps, (1,), engine)
    one = evaluate_serving_table(one_t, one_k, timing=measured)

    # the largest batch whose cache fits beside its own working set (a decode pass's: a
    # decode pool runs no prompt; it grows with the batch, so the capacity falls as the batch
    # grows), by bisection
    def fits(batch):
        at = one_t.assign(micro_batch=np.maximum(batch, 1.0))
        got = evaluate_serving_table(at, one_k, timing=measured)
        return (batch >= 1) & (batch <= got["serve_decode_kv_capacity_seqs"].to_numpy())

    hi = np.minimum(cap, one["serve_decode_kv_capacity_seqs"].to_numpy()).astype(float)
    lo = np.zeros_like(hi)
    top = fits(hi)
    lo[top] = hi[top]
    while np.any(hi - lo > 1):
        mid = np.floor((lo + hi) / 2)
        ok = fits(mid)
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
    limits = lo
    dec_t, dec_k, dec_m = [], [], []
    for i, lim in enumerate(limits):
        tp, ep, _ = one_m[i]
        batches = [b for b in DECODE_BATCHES if b < lim] + ([int(lim)] if lim >= 1 else [])
        t, k, m, _ = _layouts(model, base, hardware, cluster, (tp,), (ep,), batches, engine)
        dec_t.append(t)
        dec_k += k
        dec_m += [(*x, "kv" if x[2] == lim and lim < cap else "slots") for x in m]
    dec_t = pd.concat(dec_t, ignore_index=True) if dec_t else pd.DataFrame()
    pre = evaluate_serving_table(pre_t, pre_k, timing=measured)
    dec = evaluate_serving_table(dec_t, dec_k, timing=measured)
    pre = _with_engine(pre, engine, 1, "serve_ttft_s")
    dec = _with_engine(dec, engine, [b for _, _, b, _ in dec_m], "serve_tpot_s")
    dec_fits = (dec["serve_decode_headroom_bytes"] >= 0).to_numpy()
    pairs = [(i, j) for i in range(len(pre)) for j in range(len(dec)) if dec_fits[j]]
    p_idx, d_idx = [i for i, _ in pairs], [j for _, j in pairs]
    p_ep = np.array([pre_m[i][1] for i in p_idx], float)
    d_ep = np.array([dec_m[j][1] for j in d_idx], float)
    p_gpus = np.array([pre_m[i][0] for i in p_idx], float) * p_ep
    d_gpus = np.array([dec_m[j][0] for j in d_idx], float) * d_ep
    per = disaggregated(
        pre.iloc[p_idx].reset_index(drop=True),
        dec.iloc[d_idx].reset_index(drop=True),
        prompt=base.prompt_len,
        output_tokens=base.output_tokens,
        prefill_batch=p_ep,
        decode_batch=np.array([dec_m[j][2] for j in d_idx], float) * d_ep,
        prefill_gpus=p_gpus,
        decode_gpus=d_gpus,
        link_bytes_per_s=cluster.inter_bandwidth_bytes_per_s
        if kv_link == "nic"
        else cluster.intra_bandwidth_bytes_per_s,
        link_latency_s=cluster.inter_latency_s if kv_link == "nic" else cluster.intra_latency_s,
    )
    dis = pd.DataFrame(
        {
            "prefill_tp": [pre_m[i][0] for i in p_idx],
            "prefill_ep": [pre_m[i][1] for i in p_idx],
            "decode_tp": [dec_m[j][0] for j in d_idx],
            "decode_ep": [dec_m[j][1] for j in d_idx],
            "decode_batch": [dec_m[j][2] for j in d_idx],
            "kv_capacity_seqs": dec["serve_decode_kv_capacity_seqs"].to_numpy()[d_idx],
            "bound": [dec_m[j][3] for j in d_idx],
            "ttft_s": per["dis_ttft_s"],
            "tpot_s": per["dis_tpot_s"],
            "measured_share": per["dis_measured_share"],
        }
    )
    # each prefill attention rank queues its own prompts
    load_p = p_ep * sla_load(
        per["dis_prefill_requests_per_s"].to_numpy() / np.maximum(p_ep, 1),
        per["dis_ttft_s"].to_numpy(),
        ttft_sla_s,
    )
    dis["miss"] = np.maximum(dis["ttft_s"] / ttft_sla_s, dis["tpot_s"] / tpot_sla_s)
    ok = ((dis["miss"] <= 1) & (load_p > 0)).to_numpy()
    dis["prefill_replicas"] = np.where(ok, np.ceil(target / np.where(ok, load_p, 1)), np.nan)
    dis["decode_replicas"] = np.where(
        ok, np.ceil(target / per["dis_decode_requests_per_s"].to_numpy()), np.nan
    )
    dis["prefill_gpus_per_replica"] = p_gpus
    dis["decode_gpus_per_replica"] = d_gpus
    dis["gpus"] = dis["prefill_replicas"] * p_gpus + dis["decode_replicas"] * d_gpus
    dis["tokens_per_s_per_gpu"] = target * mean_out / dis["gpus"]
    dis["kind"] = "disaggregated"
    dis["prefill_hardware"] = pre_hw.name
    return dis


def aggregated_rate_at(aggregated: pd.DataFrame, gpus: float) -> tuple[float, pd.Series | None]:
    """The most requests/s qualifying aggregated replicas serve on ``gpus`` GPUs (whole
    replicas of one layout, each at its SLA load), and that layout."""
    if aggregated.empty:
        return 0.0, None
    rate = np.floor(gpus / aggregated["replica_gpus"]) * aggregated["load_per_replica"]
    best = int(np.argmax(rate.to_numpy()))
    return float(rate.iloc[best]), aggregated.iloc[best]
