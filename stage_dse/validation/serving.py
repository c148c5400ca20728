"""Serving cases of the corpus: engine measurements against the serving model.

Each case is one replica layout (tp, pp, ep on ``n_gpus``) of a model, evaluated with the
serving program (:mod:`stage_dse.cost.serving`) and, for engines that batch per iteration, the
continuous-batching steady state (:mod:`stage_dse.cost.batching`). All cases form one table,
evaluated together. Modes:

* ``static``: a batch prefilled together and decoded together (``gptSessionBenchmark``):
  output tokens/s per GPU ``B x OSL / (TTFT + (OSL - 1) x TPOT) / gpus``; TTFT the prefill;
* ``inflight_max``: iteration-level batching under saturating load (``trtllm-bench``, offline
  throughput): at most ``max_batch`` running requests, ``max_num_tokens`` prompt tokens per
  step;
* ``online_rate``: the same at Poisson arrivals of ``request_rate`` requests/s, spread over the
  replicas on ``n_gpus``; throughput is what the replicas complete;
* ``burst``: ``num_requests`` sent at once (an infinite request rate): throughput and TPOT of
  the saturated engine; the TTFT of a burst (its queueing) is not modelled;
* ``closed_loop`` (N concurrent clients) and ``other`` deployments (``mode_note``: prefill- or
  decode-only pools, production averages) are not modelled and are reported as such.

Errors are ``predicted / published - 1`` of the published metric (throughput: positive means
optimistic; latencies: negative means optimistic).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from stage_dse.config import load_cluster, load_hardware
from stage_dse.cost.batching import continuous_batching
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.spec.serving import ServingSpec
from stage_dse.validation.corpus import Case, CorpusError
from stage_dse.validation.resolve import (
    Unexpressible,
    case_model,
    check_expressible,
    result_base,
)

__all__ = ["Prepared", "evaluate_serving", "prepare"]


def _row(case: Case):
    from stage_dse.runner.serving import serving_row

    f = case.fields
    check_expressible(case)
    for key in ("weights", "kv"):
        if f.get(key, "bf16") not in ("bf16", "fp16", "fp8"):
            raise Unexpressible(f"{key} dtype {f[key]!r} (bf16, fp16 or fp8)")
    if f["mode"] == "closed_loop":
        raise Unexpressible("closed-loop load (N concurrent clients) is not modelled")
    if f["mode"] == "other":
        raise Unexpressible(f"deployment not modelled: {f['mode_note']}")
    if f["mode"] == "burst" and case.target_kind in ("ttft_ms", "e2e_latency_s"):
        raise Unexpressible("queueing of a burst of requests sent at once (TTFT) is not modelled")
    if case.target.get("statistic") in ("p90", "p95", "p99"):
        raise Unexpressible(f"{case.target['statistic']} latency (the model gives means)")
    model = case_model(case)
    hw = load_hardware(f["hardware"])
    tp, pp, ep = f["tp"], f.get("pp", 1), f.get("ep", 1)
    if f["n_gpus"] % (tp * pp * ep):
        raise Unexpressible(f"n_gpus({f['n_gpus']}) is not a multiple of tp*pp*ep({tp * pp * ep})")
    cluster = load_cluster(f["cluster"], num_gpus=max(f["n_gpus"], tp * pp * ep))
    continuous = f["mode"] in ("inflight_max", "online_rate", "burst")
    if continuous:
        for key in ("max_batch", "max_num_tokens"):
            if key not in f:
                raise CorpusError(
                    f"{case.source.file}: run {case.id}: mode={f['mode']} needs {key} (the "
                    "engine's limit, stated or its documented default listed in unstated)"
                )
    # continuous modes: one running request per attention rank binds the symbols (the engine's
    # running batch is the steady state's)
    batch = f["batch"] if f["mode"] == "static" else ep
    if batch % ep:
        raise Unexpressible(f"batch({batch}) does not split over ep({ep}) attention ranks")
    serving = ServingSpec(
        prompt_len=f["isl"],
        output_tokens=f["osl"],
        batch_size=batch // ep,
        weights_dtype=f.get("weights", "bf16"),
        kv_dtype=f.get("kv", "bf16"),
    )
    try:
        row, key = serving_row(model, serving, hw, cluster, tp, pp, ep)
    except ConfigError as exc:
        raise Unexpressible(str(exc)) from None
    return row, key


@dataclass
class Prepared:
    """The serving table of a list of cases (one row per expressible case)."""

    table: pd.DataFrame
    keys: list
    index: dict[str, int]
    unexpressible: dict[str, str]


def prepare(cases: list[Case]) -> Prepared:
    rows, keys, index, out = [], [], {}, {}
    for case in cases:
        try:
            row, key = _row(case)
        except Unexpressible as exc:
            out[case.id] = str(exc)
            continue
        index[case.id] = len(rows)
        rows.append(row)
        keys.append(key)
    return Prepared(pd.DataFrame(rows), keys, index, out)


def evaluate_serving(
    cases: list[Case], prepared: Prepared | None = None, table: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per case: published and predicted metric, signed error (%), ``status``
    (``table``: the prepared table with some symbol columns changed, as the fit does)."""
    prepared = prepare(cases) if prepared is None else prepared
    table = prepared.table if table is None else table
    keys, index = prepared.keys, prepared.index
    out = {
        cid: {"status": "unexpressible", "reason": r} for cid, r in prepared.unexpressible.items()
    }
    if len(table):
        static = evaluate_serving_table(table, keys)
        by_id = {c.id: c for c in cases}
        cont = [cid for cid in index if by_id[cid].fields["mode"] != "static"]
        cb = None
        if cont:
            sel = [index[cid] for cid in cont]
            f = [by_id[cid].fields for cid in cont]
            replicas = [x["n_gpus"] / (x["tp"] * x.get("pp", 1) * x.get("ep", 1)) for x in f]
            rate = [x.get("request_rate", 0.0) / r for x, r in zip(f, replicas)]
            sub = table.iloc[sel].reset_index(drop=True)
            cb = continuous_batching(
                sub,
                [keys[i] for i in sel],
                # the engine's limit over the replica, per attention rank (ep of them)
                np.array([x["max_batch"] / x.get("ep", 1) for x in f], dtype=float),
                np.array([x["max_num_tokens"] for x in f], dtype=float),
                np.array(rate, dtype=float),
            )
            cb.index = cont
    results = []
    for case in cases:
        rec = result_base(case, "roofline")
        if case.id in out:
            results.append({**rec, **out[case.id]})
            continue
        f = case.fields
        i = index[case.id]
        s = static.iloc[i]
        gpus = f["tp"] * f.get("pp", 1) * f.get("ep", 1)
        status, reason = "ok", ""
        if f["mode"] == "static":
            ttft, tpot = float(s["serve_ttft_s"]), float(s["serve_tpot_s"])
            e2e = ttft + (f["osl"] - 1) * tpot
            out_tok_gpu = f["batch"] * f["osl"] / e2e / gpus
            if s["serve_mem_headroom_bytes"] < 0:
                status, reason = "oom", "the batch's KV cache does not fit in the model's memory"
            req_s = f["batch"] / e2e * f["n_gpus"] / gpus
        else:
            c = cb.loc[case.id]
            ttft, tpot = float(c["cb_ttft_s"]), float(c["cb_tpot_s"])
            e2e = ttft + (f["osl"] - 1) * tpot
            mu = float(c["cb_requests_per_s"])
            replicas = f["n_gpus"] / gpus
            rate = f.get("request_rate")
            done = mu * replicas if rate is None else min(rate, mu * replicas)
            req_s = done
            out_tok_gpu = done * f["osl"] / f["n_gpus"]
            if not np.isfinite(mu):
                status, reason = "oom", "no request's KV cache fits next to the weights"
        metric = {
            "out_tok_s_gpu": out_tok_gpu,
            "out_tok_s": out_tok_gpu * f["n_gpus"],
            "out_tok_s_user": 1.0 / tpot,
            "total_tok_s": out_tok_gpu * f["n_gpus"] * (f["isl"] + f["osl"]) / f["osl"],
            "total_tok_s_gpu": out_tok_gpu * (f["isl"] + f["osl"]) / f["osl"],
            "prefill_tok_s_gpu": out_tok_gpu * f["isl"] / f["osl"],
            "ttft_ms": ttft * 1e3,
            "tpot_ms": tpot * 1e3,
            "itl_ms": tpot * 1e3,
            "e2e_latency_s": e2e,
            "request_s": req_s,
        }[case.target_kind]
        results.append(
            {
                **rec,
                "status": status,
                "reason": reason,
                "predicted": metric,
                "err_pct": 100 * (metric / case.value - 1),
                "plan": f"tp{f['tp']} pp{f.get('pp', 1)} ep{f.get('ep', 1)} {f['mode']}",
                "model": str(table.iloc[i]["model"]),
                "hardware": f["hardware"],
                "num_gpus": f["n_gpus"],
                "workload": f"isl{f['isl']} osl{f['osl']}",
            }
        )
    return pd.DataFrame(results)
