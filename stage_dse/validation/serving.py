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
* ``closed_loop``: ``concurrency`` clients, each sending its next request when the last one
  completes (benchmark clients' ``--max-concurrency``), spread over the replicas;
* ``burst``: ``num_requests`` sent at once (an infinite request rate): the fill, saturated and
  drain phases of that many requests;
* ``other`` deployments (``mode_note``: prefill- or decode-only pools, production averages) are
  not modelled and are reported as such.

The engine (``engine``: ``trtllm``, ``vllm``, ``sglang``; :mod:`stage_dse.spec.engine`) adds its
per-iteration and per-request costs to every step, static or continuous, and supplies its
documented limits where a record leaves ``max_batch`` or ``max_num_tokens`` unstated.

Errors are ``predicted / published - 1`` of the published metric (throughput: positive means
optimistic; latencies: negative means optimistic).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pandas as pd

from stage_dse.config import list_presets, load_cluster, load_engine, load_hardware
from stage_dse.cost.batching import continuous_batching, draft_acceptance
from stage_dse.cost.serving import ServingTiming, evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.spec.engine import EngineSpec
from stage_dse.spec.serving import ServingSpec
from stage_dse.validation.corpus import Case, CorpusError
from stage_dse.validation.resolve import (
    Unexpressible,
    case_model,
    check_expressible,
    reserve_ratio,
    result_base,
    stated_kv_memory_fraction,
    tensorrt_engine_flow,
)

__all__ = ["Prepared", "evaluate_serving", "prepare"]


NATIVE_FP4_EXPERTS = {"gpt_oss_120b": "mxfp4", "gpt_oss_20b": "mxfp4"}
"""Models whose published checkpoint quantizes only the routed experts, in this format
(gpt-oss: MXFP4 experts; attention, router and embeddings bf16, its config.json's
``quantization_config.modules_to_not_convert``; no other checkpoint of them is published): a
record's ``weights: fp4`` or ``weights: fp8`` on them means that checkpoint, its other linear
layers in bf16. ``fp8`` is TensorRT-LLM's table label for gpt-oss on Hopper, where it runs the
checkpoint with 16-bit activations (W4A16): its deployment guide's MoE support matrix lists
H200 with activation BF16, MoE weights MXFP4 and the TRITON backend, Blackwell with MXFP8
activations ("Deployment Guide for GPT-OSS on TensorRT-LLM", TensorRT-LLM 1.2-1.4 docs)."""


def native_experts(model, weights: str) -> str | None:
    """The experts' format of the published expert-only checkpoint a record's ``weights``
    label names (:data:`NATIVE_FP4_EXPERTS`), or None where the label means its own format."""
    return NATIVE_FP4_EXPERTS.get(model.name) if weights in ("fp4", "fp8") else None


def _row(case: Case):
    from stage_dse.runner.serving import serving_row

    f = case.fields
    check_expressible(case)
    for key in ("weights", "kv"):
        valid = ("bf16", "fp16", "fp8") + (
            ("fp4", "nvfp4", "mxfp4", "int4") if key == "weights" else ()
        )
        if f.get(key, "bf16") not in valid:
            raise Unexpressible(f"{key} dtype {f[key]!r} ({', '.join(valid)})")
    if f["mode"] == "other":
        raise Unexpressible(f"deployment not modelled: {f['mode_note']}")
    # speculative decoding (MTP) as the record states it: drafts per step and the mean
    # tokens a step keeps, as the per-draft acceptance the steady state takes
    drafts, acceptance = int(f.get("draft_tokens", 0)), 0.0
    if drafts:
        if "accepted_length" not in f:
            raise Unexpressible("speculative decoding whose acceptance is not stated")
        if f["mode"] == "static":
            raise Unexpressible("speculative decoding in a static batch")
        try:
            acceptance = draft_acceptance(f["accepted_length"], drafts)
        except ConfigError as exc:
            raise CorpusError(f"{case.source.file}: run {case.id}: {exc}") from None
    if case.target.get("statistic") in ("p90", "p95", "p99"):
        raise Unexpressible(f"{case.target['statistic']} latency (the model gives means)")
    model = case_model(case)
    hw = load_hardware(f["hardware"])
    tp, pp, ep = _layout(f)
    if f["n_gpus"] % (tp * pp * ep):
        raise Unexpressible(f"n_gpus({f['n_gpus']}) is not a multiple of tp*pp*ep({tp * pp * ep})")
    cluster = load_cluster(f["cluster"], num_gpus=max(f["n_gpus"], tp * pp * ep))
    continuous = f["mode"] in ("inflight_max", "online_rate", "burst", "closed_loop")
    engine = case_engine(case)
    if continuous and engine.name == "none":
        for key in ("max_batch", "max_num_tokens"):
            if key not in f:
                raise CorpusError(
                    f"{case.source.file}: run {case.id}: mode={f['mode']} needs {key} (the "
                    "engine's limit, stated or its documented default listed in unstated) "
                    "or an engine whose default applies"
                )
    # continuous modes: one running request per attention rank binds the symbols (the engine's
    # running batch is the steady state's)
    batch = f["batch"] if f["mode"] == "static" else ep
    if batch % ep:
        raise Unexpressible(f"batch({batch}) does not split over ep({ep}) attention ranks")
    weights = f.get("weights", "bf16")
    experts = native_experts(model, weights)
    if experts is not None:  # the checkpoint's other linear layers are bf16
        weights = "bf16"
    serving = ServingSpec(
        prompt_len=f["isl"],
        output_tokens=f["osl"],
        batch_size=batch // ep,
        weights_dtype=weights,
        kv_dtype=f.get("kv", "bf16"),
        expert_weights_dtype=experts,
    )
    try:
        row, key = serving_row(model, serving, hw, cluster, tp, pp, ep)
    except ConfigError as exc:
        raise Unexpressible(str(exc)) from None
    tuned = trtllm_bench_limits(model, f, hw, serving.kv_dtype.value, f.get("weights", "bf16"))
    try:
        pool = engine.kv_pool_columns(
            hw.hbm_bytes,
            f["tp"] * pp,
            attention_dp=bool(f.get("attention_dp")),
            fraction=stated_kv_memory_fraction(f, engine),
        )
    except ConfigError as exc:  # a fraction read from the record's command
        raise CorpusError(f"{case.source.file}: run {case.id.split(VARIANT)[0]}: {exc}") from None
    speedup = 1.0 if tensorrt_engine_flow(f) else hw.fp8_attention_speedup
    row.update(
        {
            "tuned_max_batch": tuned[0],
            "tuned_max_num_tokens": tuned[1],
            "engine": engine.name,
            **engine.cost_columns(),
            # the record's attention_dp_config.enable_balance (TensorRT-LLM), else the engine's
            "dp_context_sync": float(f.get("attention_dp_balance", engine.dp_context_sync)),
            "kv_reserve_ratio": reserve_ratio(f, engine),
            "context_attention_speed": engine.context_attention_speed(
                serving.weights_dtype, serving.kv_dtype, speedup
            ),
            "expert_gemm_bytes": engine.expert_gemm_bytes(serving, hw),
            "draft_tokens": float(drafts),
            "acceptance": acceptance,
            **pool,
        }
    )
    return row, key


def _layout(f: dict) -> tuple[int, int, int]:
    """A record's replica layout ``(tp, pp, ep)``. ``attention_dp`` with no expert
    parallelism stated (TensorRT-LLM's ``enable_attention_dp``: every rank attends over its
    own requests, the routed experts split over the ranks) runs attention data-parallel over
    the ``tp`` ranks: ``ep = tp``, ``tp = 1`` (a dense model has no such layout)."""
    tp, pp, ep = f["tp"], f.get("pp", 1), f.get("ep", 1)
    if f.get("attention_dp") and ep == 1 and tp > 1:
        return 1, pp, tp
    return tp, pp, ep


def _prefill_split(f: dict, case: Case) -> int:
    """Attention ranks the engine splits a step's token budget over: those of a DP-attention
    layout on an engine that divides its budget among them
    (``EngineSpec.dp_attention_splits_budget``: SGLang); elsewhere each rank has the whole
    budget."""
    return _dp_split(f, case_engine(case).dp_attention_splits_budget and f.get("attention_dp"))


def _running_split(f: dict, case: Case) -> int:
    """Attention ranks the engine splits its running-request limit over: those of an
    expert-parallel layout on an engine that divides the limit among them
    (``EngineSpec.dp_attention_splits_running``: SGLang); elsewhere the limit is each rank's
    (TensorRT-LLM's ``max_batch_size`` "in each rank", vLLM's ``max_num_seqs`` per engine)."""
    return _dp_split(f, case_engine(case).dp_attention_splits_running)


def _stage_batches(f: dict, case: Case) -> int:
    """Batches in flight the engine's running-request limit applies to each of: the pipeline
    stages on an engine whose limit is per batch (``EngineSpec.running_limit_per_stage``:
    TensorRT-LLM), else 1 (the limit covers all of them)."""
    return f.get("pp", 1) if case_engine(case).running_limit_per_stage else 1


def _dp_split(f: dict, splits: bool) -> int:
    ranks = _layout(f)[2]
    return ranks if splits and ranks > 1 else 1


def _output_lengths(f: dict) -> tuple[str, float]:
    """How a case's output lengths spread: requests sampled from ShareGPT conversations
    decode each its own reply's length (the record gives the mean), spread as an exponential
    capped where the benchmark's sampler drops longer pairs (prompt plus reply at most 2,048
    tokens: vLLM's ``vllm/benchmarks/datasets.py`` ``is_valid_sequence``, the sampler of
    ``vllm bench serve``); synthetic and random datasets decode fixed lengths."""
    if "sharegpt" in str(f.get("dataset", "")).lower():
        return "exponential", 2048.0
    return "fixed", np.inf


def case_engine(case: Case) -> EngineSpec:
    """The engine profile a case ran on (``none`` where the record names none we have)."""
    return _engine(case.fields.get("engine", ""))


@cache
def _engine_on(name: str, hardware: str) -> EngineSpec:
    """An engine profile with the limits it defaults to on one GPU
    (:meth:`EngineSpec.for_hardware`), once per pair: every evaluation asks for them."""
    return _engine(name).for_hardware(load_hardware(hardware))


@cache
def _engine(name: str) -> EngineSpec:
    """An engine profile, read once per process: every evaluation of the corpus asks for one
    per case several times over, and the fit evaluates it hundreds of times."""
    return load_engine(name) if name in list_presets("engine") else load_engine("none")


def _limits(
    f: dict, engine: EngineSpec, tuned=(np.nan, np.nan), unstated=()
) -> tuple[float, float]:
    """Running-request and token limits: the record's as its source states them, else what
    the benchmark tool tuned (``tuned``: :func:`trtllm_bench_limits` for the KV cache format
    the row runs, NaN where it does not apply), else the record's own derivation of a default
    (a value listed in ``unstated``), else the engine's defaults."""
    batch, tokens = (engine.max_running, engine.prefill_budget)
    out = []
    for name, default, own in (
        ("max_batch", batch, tuned[0]),
        ("max_num_tokens", tokens, tuned[1]),
    ):
        if name in f and name not in unstated:
            out.append(float(f[name]))
        elif np.isfinite(own):
            out.append(float(own))
        else:
            out.append(float(f.get(name, default)))
    return out[0], out[1]


def total_params(model) -> float:
    """All weights of ``model``: embeddings (input and output unless tied), attention, dense
    MLPs, every routed and shared expert and the routers."""
    from stage_dse.validation.conventions import _attention_params, _mlp_params

    attn = _attention_params(model)
    h = model.hidden_size
    dense = model.num_dense_layers * (attn + _mlp_params(model, model.ffn_hidden_size))
    moe = 0
    if model.is_moe:
        experts = model.num_experts + model.num_shared_experts
        moe = model.num_moe_layers * (
            attn + experts * _mlp_params(model, model.moe_ffn_hidden_size) + h * model.num_experts
        )
    return float(dense + moe + h * model.vocab_size * (1 if model.tied_embeddings else 2))


UNTUNED_LIMITS = (2048.0, 8192.0)
"""``max_batch_size`` and ``max_num_tokens`` of TensorRT-LLM's ``BuildConfig``, which
``trtllm-bench`` takes for a checkpoint quantization its heuristic does not tune."""


def trtllm_bench_limits(model, f: dict, hardware, kv: str, weights: str) -> tuple[float, float]:
    """``max_batch`` and ``max_num_tokens`` as ``trtllm-bench throughput`` picks them when the
    command gives neither (``tensorrt_llm/bench/build/tuning.py``, ``calc_engine_setting`` and
    ``finetune_setting``): the requests of ``isl + osl`` tokens whose KV cache fits in 0.95 of
    the memory the whole engine leaves (all ``tp x pp`` GPUs, weights at 2, 1 or 0.5 bytes per
    parameter for bf16, FP8 and NVFP4 checkpoints, at least one KV head per tensor-parallel
    rank), capped at 4,096 and split over the pipeline stages, rounded up (at least 64); the
    token budget that batch times ``1 + isl / osl``, capped at 32,768, rounded up (at least
    2,048). The heuristic reads the checkpoint's config.json literally (``ModelConfig`` of
    ``bench/build/dataclasses.py``): under latent attention it counts ``num_key_value_heads``
    full heads of ``hidden_size // num_attention_heads`` (DeepSeek-V3's config has no
    ``head_dim``), not the latent the engine caches. The heuristic runs only for the
    quantizations it knows (``TUNED_QUANTS`` of ``bench/build/build.py``: none, FP8, FP8
    block scales, NVFP4); any other checkpoint gets ``BuildConfig``'s defaults, 2,048
    requests and 8,192 tokens (``tensorrt_llm/builder.py``): gpt-oss's MXFP4 experts load as
    ``W4A16_MXFP4`` on Hopper and ``W4A8_MXFP4_*`` on Blackwell (``_torch/model_config.py``,
    ``get_mxfp4_quant_algo``). NaN for other benchmark tools."""
    client = str((f.get("details") or {}).get("benchmark_client", ""))
    if not client.startswith("trtllm-bench"):
        return np.nan, np.nan
    if native_experts(model, weights) is not None:  # its MXFP4 checkpoint
        return UNTUNED_LIMITS
    per_param = {"fp8": 1.0, "fp4": 0.5, "nvfp4": 0.5}.get(weights, 2.0)
    per_kv = 1.0 if kv == "fp8" else 2.0
    tp, pp = f["tp"], f.get("pp", 1)
    gib = 2.0**30
    kv_heads = max(tp, model.num_kv_heads)
    head_size = model.hidden_size // model.num_heads if model.is_mla else model.head_dim
    per_token_gib = 2 * model.num_layers * kv_heads * head_size * per_kv / gib
    engine_gib = total_params(model) * per_param / gib
    free_gib = hardware.hbm_bytes / gib * tp * pp - engine_gib
    requests = free_gib * 0.95 / (per_token_gib * (f["isl"] + f["osl"]))
    if requests < 1:
        return np.nan, np.nan
    raw_bs = min(requests, 4096) / pp
    raw_tokens = min(raw_bs * (1 + f["isl"] / f["osl"]), 32768)
    if raw_bs < 256:
        batch = max(64, 32 * math.ceil(raw_bs / 32))
    elif raw_bs < 1024:
        batch = 128 * math.ceil(raw_bs / 128)
    else:
        batch = 256 * math.ceil(raw_bs / 256)
    if raw_tokens < 4096:
        tokens = max(2048, 256 * math.ceil(raw_tokens / 256))
    elif raw_tokens < 8192:
        tokens = 512 * math.ceil(raw_tokens / 512)
    else:
        tokens = 1024 * math.ceil(raw_tokens / 1024)
    return float(batch), float(tokens)


@dataclass
class Prepared:
    """The serving table of a list of cases (one row per expressible case)."""

    table: pd.DataFrame
    keys: list
    index: dict[str, int]
    """Row of each case (of each variant, ``<case>|kv=fp8``, where an unstated choice
    ranges over candidates)."""
    unexpressible: dict[str, str]
    variants: dict[str, tuple[Case, ...]] = field(default_factory=dict)
    """The variants of cases with an unstated serving choice."""
    runs: dict[str, str] = field(default_factory=dict)
    """The run each case's figure comes from (:func:`_run_of`), worked out once."""


VARIANT = "|"


def _variants(case: Case) -> tuple[Case, ...]:
    """The case, or one copy per candidate of an unstated KV-cache dtype: the record's
    ``candidates``, else bf16 and, beside FP8 or FP4 weights (a quantized checkpoint, whose
    engine may quantize the cache too), fp8. Like unstated plan choices in training, the
    fastest that fits is taken (a published benchmark runs the tuned configuration)."""
    f = case.fields
    if "kv" in f or "kv" not in case.unstated:
        return (case,)
    kvs = case.candidates.get("kv") or (
        ("bf16", "fp8") if f.get("weights", "bf16") not in ("bf16", "fp16") else ("bf16",)
    )
    if len(kvs) == 1:
        return (dataclasses.replace(case, fields={**f, "kv": kvs[0]}),)
    return tuple(
        dataclasses.replace(case, id=f"{case.id}{VARIANT}kv={kv}", fields={**f, "kv": kv})
        for kv in kvs
    )


def prepare(cases: list[Case]) -> Prepared:
    rows, keys, index, out, variants = [], [], {}, {}, {}
    one_of: dict = {}  # equal keys as one object: evaluations group rows by key identity
    for case in cases:
        options = _variants(case)
        if len(options) > 1:
            variants[case.id] = options
        reasons = []
        for variant in options:
            try:
                row, key = _row(variant)
            except Unexpressible as exc:
                reasons.append(str(exc))
                continue
            index[variant.id] = len(rows)
            rows.append(row)
            keys.append(one_of.setdefault(key, key))
        if len(reasons) == len(options):
            out[case.id] = reasons[0]
    runs = {c.id: _run_of(c) for c in cases}
    return Prepared(pd.DataFrame(rows), keys, index, out, variants, runs)


def evaluate_serving(
    cases: list[Case],
    prepared: Prepared | None = None,
    table: pd.DataFrame | None = None,
    timing: str | ServingTiming = "roofline",
) -> pd.DataFrame:
    """One row per case: published and predicted metric, signed error (%), ``status``
    (``table``: the prepared table with some symbol columns changed, as the fit does;
    ``timing``: the kernel times, :func:`~stage_dse.cost.serving.evaluate_serving_table`)."""
    prepared = prepare(cases) if prepared is None else prepared
    asked = cases
    cases = [
        v
        for c in cases
        for v in ([x for x in prepared.variants.get(c.id, ()) if x.id in prepared.index] or [c])
    ]
    table = prepared.table if table is None else table
    keys, index = prepared.keys, prepared.index
    out = {
        cid: {"status": "unexpressible", "reason": r} for cid, r in prepared.unexpressible.items()
    }
    if len(table):
        static = evaluate_serving_table(table, keys, timing=timing)
        # per-case lookups by position, once (a pandas row per case costs more than the model)
        static_rows = static.to_dict("records")
        tuned_batch, tuned_tokens, step_overhead, request_overhead, models = (
            table[c].to_numpy()
            for c in (
                "tuned_max_batch",
                "tuned_max_num_tokens",
                "step_overhead_s",
                "request_overhead_s",
                "model",
            )
        )
        by_id = {c.id: c for c in cases}
        cont = [cid for cid in index if by_id[cid].fields["mode"] != "static"]
        cb = None
        if cont:
            sel = [index[cid] for cid in cont]
            f = [by_id[cid].fields for cid in cont]
            limits = [
                _limits(
                    x,
                    _engine_on(x.get("engine", ""), x["hardware"]),
                    (tuned_batch[i], tuned_tokens[i]),
                    by_id[cid].unstated or (),
                )
                for x, cid, i in zip(f, cont, sel)
            ]
            replicas = [x["n_gpus"] / (x["tp"] * x.get("pp", 1) * x.get("ep", 1)) for x in f]
            rate = [x.get("request_rate", 0.0) / r for x, r in zip(f, replicas)]
            # clients and bursts over the deployment's replicas
            users = [
                x["concurrency"] / r if x["mode"] == "closed_loop" else 0.0
                for x, r in zip(f, replicas)
            ]
            sent = [
                x["num_requests"] / r if x["mode"] == "burst" else 0.0 for x, r in zip(f, replicas)
            ]
            sub = table.iloc[sel].reset_index(drop=True)
            spreads = [_output_lengths(x) for x in f]
            cb = continuous_batching(
                sub,
                [keys[i] for i in sel],
                # the engine's limit per attention rank
                np.array(
                    [
                        m * _stage_batches(x, by_id[cid]) / _running_split(x, by_id[cid])
                        for (m, _), x, cid in zip(limits, f, cont)
                    ],
                    dtype=float,
                ),
                np.array(
                    [c / _prefill_split(x, by_id[cid]) for (_, c), x, cid in zip(limits, f, cont)],
                    dtype=float,
                ),
                np.array(rate, dtype=float),
                clients=np.maximum(np.round(users), 0.0),
                burst=np.maximum(np.round(sent), 0.0),
                draft_tokens=sub["draft_tokens"].to_numpy(float),
                acceptance=sub["acceptance"].to_numpy(float),
                output_lengths=np.array([s for s, _ in spreads], dtype=object),
                max_total_tokens=np.array([cap for _, cap in spreads], dtype=float),
                timing=timing,
            )
            cb.index = cont
            cb = cb.to_dict("index")
    results = []
    for case in cases:
        rec = result_base(case, ServingTiming.of(timing).source)
        if case.id in out:
            results.append({**rec, **out[case.id]})
            continue
        f = case.fields
        i = index[case.id]
        s = static_rows[i]
        gpus = f["tp"] * f.get("pp", 1) * f.get("ep", 1)
        status, reason = "ok", ""
        if f["mode"] == "static":
            # the engine's costs on the prefill iteration and on each decode iteration
            over = float(step_overhead[i])
            per_request = float(request_overhead[i]) * f["batch"] / _layout(f)[2]
            ttft = float(s["serve_ttft_s"]) + over + per_request
            tpot = float(s["serve_tpot_s"]) + over + per_request
            e2e = ttft + (f["osl"] - 1) * tpot
            out_tok_gpu = f["batch"] * f["osl"] / e2e / gpus
            if s["serve_mem_headroom_bytes"] < 0:
                status, reason = "oom", "the batch's KV cache does not fit in the model's memory"
            req_s = f["batch"] / e2e * f["n_gpus"] / gpus
        else:
            c = cb[case.id]
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
                "plan": "tp{} pp{} ep{} ".format(*_layout(f)) + f["mode"],
                "model": str(models[i]),
                "hardware": f["hardware"],
                "num_gpus": f["n_gpus"],
                "workload": f"isl{f['isl']} osl{f['osl']}",
                "requests_per_s": req_s,
            }
        )
    return _best_variant(pd.DataFrame(results), asked, prepared)


# what a record says about where its figure was printed, not about the run
_NOT_THE_RUN = ("id", "where", "quote", "notes")


def _run_of(case: Case) -> str:
    """The run a case's figure comes from: its fields but the figure's own (several figures
    printed by one benchmark run are cases with equal runs)."""
    return repr(sorted((k, repr(v)) for k, v in case.fields.items() if k not in _NOT_THE_RUN))


def _best_variant(results: pd.DataFrame, asked: list[Case], prepared: Prepared) -> pd.DataFrame:
    """One row per asked case: among its variants that fit, the one its run serves fastest
    (the most requests per second over the run's variants), the same for every figure of one
    run: a benchmark ran one configuration, whose throughput and latencies it printed
    together."""
    if not prepared.variants or not len(results):
        return results.drop(columns="requests_per_s", errors="ignore")
    if "requests_per_s" not in results:  # none of the variants could be expressed
        results = results.assign(requests_per_s=np.nan)
    parts = results["case"].str.partition(VARIANT)
    base, option = parts[0], parts[2]  # a case without variants: option ""
    runs = {c.id: prepared.runs.get(c.id) or _run_of(c) for c in asked}
    run = base.map(runs).fillna(base).to_numpy()
    ok = (results["status"] == "ok").to_numpy()
    rate = results["requests_per_s"].to_numpy(float)
    rate = np.where(ok & np.isfinite(rate), rate, -np.inf)
    # a run's variant: the one with the highest rate summed over the run's figures
    speed = pd.DataFrame({"run": run, "option": option, "rate": rate})
    per_option = speed.groupby(["run", "option"], sort=False)["rate"].sum()
    chosen = per_option.groupby(level="run", sort=False).idxmax().map(lambda ro: ro[1])
    keep = option.to_numpy() == chosen.reindex(run).to_numpy()
    best = results[keep].assign(case=base[keep].to_numpy()).drop(columns="requests_per_s")
    best = best.drop_duplicates("case", keep="first").set_index("case")
    return best.loc[[c.id for c in asked]].reset_index()
