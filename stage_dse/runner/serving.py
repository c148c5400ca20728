"""Serving sweeps: every (hardware, tp, pp, ep, batch, prompt) of a model, evaluated and stored.

Serving spaces are small (thousands of rows), so configurations are built and validated one by
one and evaluated together (one compiled serving program per family). Rows land in the same
results dataset as training rows, with ``workload == "serving"``: the serving columns
(``ttft_s``, ``tpot_s``, ``decode_tokens_per_s_per_gpu``, ``kv_capacity_seqs``, ...) are set,
memory columns hold the serving footprint, training-only columns are null.

``timing="measured"`` evaluates every row with measured kernel times (:mod:`stage_dse.kernels`,
each hardware on its preset's table set; a part without tables keeps the roofline) and stores
``timing`` and ``measured_share``: the share of a static row's request time
(``TTFT + (output_tokens - 1) x TPOT``) or of a continuous-batching row's mean engine step
that came from tables (the relative derivative along the measured kernels' times).
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

from stage_dse.cost.batching import continuous_batching, held_output_tokens
from stage_dse.cost.columns import SERVING_COLUMNS
from stage_dse.cost.serving import ServingTiming, evaluate_serving_table, serving_key
from stage_dse.cost.table import config_row
from stage_dse.errors import ConfigError
from stage_dse.results.schema import config_hash
from stage_dse.results.store import ResultStore, new_run_id
from stage_dse.runner.evaluate import finalize_rows
from stage_dse.runner.sweep import SweepReport
from stage_dse.spec.serving import ServingSpec, replicated_kv_heads, serving_plan, weight_only
from stage_dse.spec.sweep import ServingSweepSpec, divisors

__all__ = [
    "ServingSweepSpec",
    "measured_step_share",
    "run_serving",
    "serving_row",
    "serving_timing",
    "serving_top_table",
]

GIB = 2.0**30
EPS = 1e-4
"""Relative change of the measured kernels' times behind a continuous-batching row's
``measured_share`` (its step composes several evaluations; open-loop rates are solved
iteratively, so the step is smooth but not linear in them)."""


def serving_timing(timing: str, hardware) -> ServingTiming:
    """The serving timing of a sweep over ``hardware`` (:class:`~stage_dse.spec.HardwareSpec`
    objects): ``measured`` on each part's table set (``hardware.measured_gpu``, else its
    preset's), loaded now so that a missing extra or an unknown table set is a one-line
    error before anything is evaluated."""
    if timing not in ("roofline", "measured"):
        raise ConfigError(f"timing={timing!r} is not one of: roofline, measured")
    if timing == "roofline":
        return ServingTiming()
    from stage_dse.kernels.tables import load_tables, table_set

    gpus = {hw.name: table_set(hw) for hw in hardware}
    for gpu in set(gpus.values()) - {None}:
        load_tables(gpu)
    return ServingTiming("measured", gpus)


def measured_step_share(
    table: pd.DataFrame, keys: list, timing: ServingTiming, step: pd.Series, *args, **kwargs
) -> np.ndarray:
    """Share of continuous-batching steps ``step`` (``cb_step_s`` of
    ``continuous_batching(table, keys, *args, timing=timing, **kwargs)``) that measured
    kernels make up: the relative change of the step when they take ``1 + EPS`` times as
    long (0 under the roofline)."""
    if timing.source != "measured":
        return np.zeros(len(table))
    bumped = ServingTiming(timing.source, timing.measured_gpu, EPS)
    again = continuous_batching(table, keys, *args, timing=bumped, **kwargs)["cb_step_s"]
    share = (again.to_numpy() - step.to_numpy()) / (EPS * step.to_numpy())
    return np.clip(np.nan_to_num(share, nan=0.0), 0.0, 1.0)


def run_serving(
    spec: ServingSweepSpec,
    store: ResultStore,
    log: Callable[[str], None] = print,
    timing: str = "roofline",
) -> SweepReport:
    """Evaluate and store a serving sweep; ``timing``: ``roofline`` or ``measured`` (see the
    module docstring)."""
    measured = serving_timing(timing, spec.hardware)
    replaced = store.prepare(log)
    try:
        store.check_workload("serving")
        return _run_serving(spec, store, log, replaced, measured)
    finally:
        store.release()


def _run_serving(spec, store, log, replaced, timing: ServingTiming) -> SweepReport:
    t0 = time.perf_counter()
    report = SweepReport(name=spec.name, run_id=new_run_id())
    if replaced:
        log(f"removed {replaced} part files of another stage_dse version (replace_stale)")
    model = spec.model
    tps = divisors(model.num_heads) if spec.tp == "auto" else list(spec.tp)
    rows, keys = [], []
    continuous = spec.mode == "continuous"
    budgets = spec.prefill_budgets if continuous else (None,)
    # budget 0: the engine's default on each GPU (EngineSpec.for_hardware)
    default_budget = {hw.name: spec.engine.for_hardware(hw).prefill_budget for hw in spec.hardware}
    mix = [tuple(float(x) for x in item) for item in spec.request_mix]
    prompts, out_tokens, mix_label = spec.prompt_lens, spec.output_tokens, None
    if mix:  # one row per layout: the static parts at the mix's mean lengths
        total = sum(w for _, _, w in mix)
        prompts = (max(1, round(sum(p * w for p, _, w in mix) / total)),)
        out_tokens = max(1, round(sum(o * w for _, o, w in mix) / total))
        mix_label = ",".join(f"{p:g}x{o:g}:{w / total:g}" for p, o, w in mix)
    for hw, tp, pp, ep, batch, prompt, budget in itertools.product(
        spec.hardware, tps, spec.pp, spec.ep, spec.batch_sizes, prompts, budgets
    ):
        report.candidates += 1
        try:
            serving = ServingSpec(
                prompt_len=prompt,
                output_tokens=out_tokens,
                batch_size=batch,
                kv_dtype=spec.kv_dtype,
                weights_dtype=spec.weights_dtype,
                moe_routing=spec.moe_routing,
                moe_dispatch=spec.moe_dispatch,
            )
            row, key = serving_row(model, serving, hw, spec.cluster, tp, pp, ep)
        except ConfigError as exc:
            report.rejected[_rule(str(exc))] += 1
            continue
        if continuous and budget == 0:
            budget = default_budget[hw.name]
        row.update(
            {
                "serving_mode": spec.mode,
                "prefill_budget": float(budget) if continuous else np.nan,
                "arrival_rate": spec.arrival_rate if continuous else np.nan,
                "draft_tokens": float(spec.draft_tokens) if continuous else np.nan,
                "acceptance": spec.acceptance if continuous else np.nan,
                "request_mix": mix_label,
                "engine": spec.engine.name,
                **spec.engine.cost_columns(),
                "context_attention_speed": spec.engine.context_attention_speed(
                    serving.weights_dtype, serving.kv_dtype, hw.fp8_attention_speedup
                ),
                "expert_gemm_bytes": spec.engine.expert_gemm_bytes(serving, hw),
                **spec.engine.kv_pool_columns(hw.hbm_bytes, tp * pp),
                "clients": float(spec.clients) if continuous else np.nan,
                "burst": float(spec.burst) if continuous else np.nan,
                "output_lengths": spec.output_lengths if continuous else "",
                "max_total_tokens": float(spec.max_total_tokens) if continuous else np.nan,
                "moe_routing": spec.moe_routing if model.is_moe else "",
                "moe_dispatch": spec.moe_dispatch if model.is_moe else "",
            }
        )
        rows.append(row)
        keys.append(key)
    report.valid = len(rows)
    if not rows and report.rejected:
        reason, n = report.rejected.most_common(1)[0]
        raise ConfigError(
            f"no valid serving configuration among {report.candidates:,}; most often: "
            f"{reason} ({n:,} of them)"
        )
    log(
        f"serving sweep {spec.name}: {report.valid:,} valid configurations of "
        f"{report.candidates:,} ({sum(report.rejected.values()):,} rejected)"
    )
    if rows:
        table = pd.DataFrame(rows)
        table["timing"] = timing.source  # measured rows are other results of a configuration
        table["config_hash"] = config_hash(table).to_numpy()
        done = store.hashes()
        keep = ~table["config_hash"].isin(done).to_numpy()
        report.skipped = int((~keep).sum())
        table = table[keep].reset_index(drop=True)
        keys = [k for k, kept in zip(keys, keep) if kept]
        if len(table):
            static = costs = evaluate_serving_table(table, keys, timing=timing)
            if continuous:
                costs = _continuous(table, keys, costs, mix or None, timing)
            else:
                costs = _engine_static(table, costs)
            out = finalize_rows(table, None, spec.name, report.run_id)
            for src, dst in SERVING_COLUMNS.items():
                if src in costs:
                    out[dst] = costs[src].to_numpy()
            for col in (
                "serving_mode",
                "prefill_budget",
                "arrival_rate",
                "draft_tokens",
                "acceptance",
                "request_mix",
                "engine",
                "clients",
                "burst",
                "output_lengths",
                "max_total_tokens",
                "weight_only",
                "moe_routing",
                "moe_dispatch",
            ):
                out[col] = table[col].to_numpy()
            if continuous:
                out["measured_share"] = costs["measured_share"].to_numpy()
            else:
                out["measured_share"] = _static_share(table, static, costs)
            out["mem_weights_bytes"] = out["serve_weights_bytes"]
            out["mem_total_bytes"] = out["serve_mem_total_bytes"]
            out["mem_headroom_bytes"] = out["serve_mem_headroom_bytes"]
            fits = out["mem_headroom_bytes"].to_numpy() >= 0
            out["status"] = np.where(fits, "ok", "infeasible")
            out["reason"] = np.where(
                fits, "", "weights + KV cache + working set exceed usable memory"
            )
            store.write(out)
            report.evaluated = len(out)
            report.status.update(out["status"].value_counts().to_dict())
    report.seconds = time.perf_counter() - t0
    return report


def serving_row(model, serving: ServingSpec, hardware, cluster, tp: int, pp: int = 1, ep: int = 1):
    """The symbol row and serving key of one replica layout (a ``ConfigError`` when the layout
    does not suit the model). KV heads fewer than ``tp`` are replicated, one per rank."""
    model = replicated_kv_heads(model, tp)
    plan = serving_plan(model, tp, pp, serving.batch_size, ep)
    key = serving_key(model, serving, plan)
    like = serving.step_like(hardware, replicas=plan.dp)
    row = config_row(model, like, plan, hardware.serving(), cluster.replace(num_gpus=plan.num_gpus))
    row.update(
        {
            "workload": "serving",
            "kv_bytes": serving.kv_dtype.bytes,
            "prompt": serving.prompt_len,
            "output_tokens": serving.output_tokens,
            "context": serving.prompt_len,
            "weight_only": weight_only(serving, hardware),
        }
    )
    return row, key


def _continuous(
    table: pd.DataFrame,
    keys: list,
    static: pd.DataFrame,
    mix=None,
    timing: ServingTiming | None = None,
) -> pd.DataFrame:
    """Serving outputs of continuous-batching rows: the steady state replaces the static
    latencies and throughput; memory holds the KV cache of the requests that actually run
    (at most the capacity); ``measured_share`` is that of the mean engine step."""
    timing = timing or ServingTiming()
    args = (
        table["micro_batch"].to_numpy(float),
        table["prefill_budget"].to_numpy(float),
        table["arrival_rate"].to_numpy(float),
        table["draft_tokens"].to_numpy(float),
        table["acceptance"].to_numpy(float),
    )
    loads = {"clients": table["clients"].to_numpy(float), "burst": table["burst"].to_numpy(float)}
    if "output_lengths" in table:
        cap = table["max_total_tokens"].to_numpy(float)
        loads["output_lengths"] = table["output_lengths"].to_numpy(object)
        loads["max_total_tokens"] = np.where(cap > 0, cap, np.inf)
    cb = continuous_batching(table, keys, *args, mix=mix, timing=timing, **loads)
    out = static.copy()
    out["measured_share"] = measured_step_share(
        table, keys, timing, cb["cb_step_s"], *args, mix=mix, **loads
    )
    # the static program holds pp batches of micro_batch in flight: a sequence's cache on a GPU
    per_seq = static["serve_kv_cache_bytes"] / (table["micro_batch"] * table["pp"])
    # what a running request holds on average under the engine's reservation rule
    if "kv_reserve_ratio" in table:
        p, o = table["prompt"].astype(float), table["output_tokens"].astype(float)
        held = held_output_tokens(o, table["kv_reserve_ratio"].astype(float).fillna(1.0))
        per_seq = per_seq * (p + held) / (p + o)
    running = cb["cb_running"].fillna(0.0)
    out["serve_kv_cache_bytes"] = running * per_seq
    out["serve_working_bytes"] = cb["cb_working_bytes"]  # the widest engine step's
    out["serve_mem_total_bytes"] = (
        out["serve_weights_bytes"] + out["serve_kv_cache_bytes"] + out["serve_working_bytes"]
    )
    usable = table["usable_memory"].to_numpy(float)
    # no request fits: reported as short by one sequence's cache
    out["serve_mem_headroom_bytes"] = np.where(
        cb["cb_running"].notna(), usable - out["serve_mem_total_bytes"], -per_seq
    )
    out["serve_ttft_s"] = cb["cb_ttft_s"]
    out["serve_tpot_s"] = cb["cb_tpot_s"]
    out["serve_tokens_per_s_per_gpu"] = cb["cb_tokens_per_s_per_gpu"]
    out["serve_kv_capacity_seqs"] = cb["cb_kv_capacity_seqs"]
    out["cb_requests_per_s"] = cb["cb_requests_per_s"]
    out["cb_tokens_per_s_per_user"] = cb["cb_tokens_per_s_per_user"]
    out["cb_total_tokens_per_s_per_gpu"] = cb["cb_total_tokens_per_s_per_gpu"]
    return out


def _static_share(table: pd.DataFrame, kernels: pd.DataFrame, final: pd.DataFrame) -> np.ndarray:
    """Measured share of a static row's request time ``TTFT + (output_tokens - 1) x TPOT``:
    the serving program's (``kernels``) over the final figures, which add the engine's costs
    (not kernels, not measured)."""
    if "serve_measured_share" not in kernels:
        return np.zeros(len(table))
    after = table["output_tokens"].to_numpy(float) - 1

    def request_s(c: pd.DataFrame) -> np.ndarray:
        return c["serve_ttft_s"].to_numpy() + after * c["serve_tpot_s"].to_numpy()

    return kernels["serve_measured_share"].to_numpy() * request_s(kernels) / request_s(final)


def _engine_static(table: pd.DataFrame, costs: pd.DataFrame) -> pd.DataFrame:
    """Static rows on an engine: its per-iteration and per-request costs on the prefill and
    on every decode iteration of the batch."""
    over = table["step_overhead_s"].to_numpy(float)
    per_request = table["request_overhead_s"].to_numpy(float) * table["micro_batch"].to_numpy(float)
    if not np.any(over + per_request):
        return costs
    out = costs.copy()
    tpot = costs["serve_tpot_s"].to_numpy() + over + per_request
    out["serve_ttft_s"] = costs["serve_ttft_s"].to_numpy() + over + per_request
    out["serve_tokens_per_s_per_gpu"] = (
        costs["serve_tokens_per_s_per_gpu"].to_numpy() * costs["serve_tpot_s"].to_numpy() / tpot
    )
    out["serve_tpot_s"] = tpot
    return out


_PLAN_VALUE = re.compile(r"\b(tp|pp|ep|dp|batch_size|prompt_len)\(\d+\)")


def _rule(message: str) -> str:
    """Group rejection messages by their rule: the plan's own values are dropped, the model's
    kept (``tp(3) does not divide heads(64)`` -> ``tp does not divide heads(64)``)."""
    return _PLAN_VALUE.sub(r"\1", message)


def serving_top_table(df: pd.DataFrame, k: int = 10, by: str = "decode_tokens_per_s_per_gpu"):
    ok = df[(df["status"] == "ok") & (df["workload"] == "serving")]
    best = ok.sort_values(by, ascending=by not in ("decode_tokens_per_s_per_gpu",)).head(k)
    if len(best) and (best["serving_mode"].astype(str) == "continuous").all():
        return pd.DataFrame(
            {
                "model": best["model"],
                "hardware": best["hardware"],
                "tp": best["tp"],
                "ep": best["ep"],
                "max_running": best["micro_batch"],
                "budget": best["prefill_budget"].astype(int),
                "prompt": best["prompt"],
                "ttft_ms": (best["ttft_s"] * 1e3).round(1),
                "tpot_ms": (best["tpot_s"] * 1e3).round(2),
                "req_s": best["requests_per_s"].round(2),
                "tok_s_gpu": best["decode_tokens_per_s_per_gpu"].round(0),
                "tok_s_user": best["tokens_per_s_per_user"].round(1),
                "mem_gib": (best["mem_total_bytes"] / GIB).round(1),
                "kv_capacity": best["kv_capacity_seqs"],
            }
        ).reset_index(drop=True)
    return pd.DataFrame(
        {
            "model": best["model"],
            "hardware": best["hardware"],
            "tp": best["tp"],
            "pp": best["pp"],
            "ep": best["ep"],
            "batch": best["micro_batch"],
            "prompt": best["prompt"],
            "ttft_ms": (best["ttft_s"] * 1e3).round(1),
            "tpot_ms": (best["tpot_s"] * 1e3).round(2),
            "tok_s_gpu": best["decode_tokens_per_s_per_gpu"].round(0),
            "mem_gib": (best["mem_total_bytes"] / GIB).round(1),
            "kv_capacity": best["kv_capacity_seqs"],
        }
    ).reset_index(drop=True)
