"""The serving driver: one serving job from its specs to every figure a user is shown.

:func:`run_serving_job` takes a :class:`~stage_dse.spec.sweep.ServingJob` (the sweep's space,
the timing source, the latency targets, the request rate, ``top_k``, the recommend options)
and a :class:`~stage_dse.results.store.ResultStore`, and returns a :class:`ServingResult`;
the command line only prints it. Every decision is taken here:

* **the sweep** (``mode="sweep"``): every configuration evaluated and stored on the job's
  timing (:func:`stage_dse.runner.serving.run_serving`); the rows of this run's
  configurations read back (serving spaces are thousands of rows); the ``top_k`` by decode
  tokens/s per GPU;
* **the SLA front**, when a TTFT or TPOT target is given: among the feasible rows within the
  targets, the Pareto front of tokens/s per GPU against tokens/s per user (``1 / TPOT``),
  lowest TPOT first;
* **the recommendation** (:func:`stage_dse.runner.recommend.recommend`, per hardware), for
  ``mode="recommend"`` or after a sweep given both targets and ``target_requests_per_s``: the
  workload is the sweep's first prompt length and its output tokens, or its request mix; the
  tensor-parallel sizes are the sweep's, or under ``tp=auto`` the divisors of the KV heads
  within a node (one KV head per rank at most); the candidates are stored as one Parquet file
  under ``<store>/_recommend/``;
* **notes**: under ``timing=measured``, the parts without kernel tables (their rows keep the
  roofline) and the median share of the time the tables produced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from stage_dse.results.analysis import pareto
from stage_dse.results.store import ResultStore, new_run_id
from stage_dse.runner.recommend import BOUND_WORDS, Recommendation, aggregated_rate_at, recommend
from stage_dse.runner.serving import run_serving, serving_timing, serving_top_table
from stage_dse.runner.sweep import SweepReport, rows_of_run, tables_notes
from stage_dse.spec.serving import ServingSpec
from stage_dse.spec.sweep import ServingJob, divisors

__all__ = [
    "BOUND_WORDS",
    "HardwareAnswer",
    "RecommendResult",
    "ServingResult",
    "check_serving_job",
    "run_serving_job",
]


@dataclass(frozen=True)
class HardwareAnswer:
    """The recommendation on one hardware."""

    hardware: str
    answer: Recommendation
    equal_gpus_rate: float = np.nan
    """Requests/s the best qualifying aggregated layout serves on the disaggregated answer's
    GPU count (nan: no disaggregated answer, or no aggregated layout fits that count)."""
    equal_gpus_layout: pd.Series | None = None
    """That aggregated layout."""
    measured_share: float | None = None
    """``timing=measured``: median share of the qualifying candidates' time from tables."""


@dataclass(frozen=True)
class RecommendResult:
    model: str
    target_requests_per_s: float
    ttft_sla_ms: float
    tpot_sla_ms: float
    workload: str
    """The requests, in words: lengths or the request mix."""
    weights_dtype: str
    kv_dtype: str
    engine: str
    running_cap: int
    running_cap_from: str
    """Which option set ``running_cap``: ``serving.batch_size`` or ``engine.max_running``."""
    timing: str
    hardware: tuple[HardwareAnswer, ...]
    path: Path
    """The Parquet file of every candidate (qualifying and nearest misses)."""


@dataclass
class ServingResult:
    job: ServingJob
    report: SweepReport | None = None
    """The sweep's report (None for ``mode="recommend"``)."""
    store_root: Path | None = None
    folder_rows: int = 0
    """Rows in the results folder once the sweep ended."""
    rows: pd.DataFrame | None = None
    """The rows of this run's configurations (evaluated now or reused)."""
    reused: int = 0
    """Of ``rows``, those evaluated by earlier runs."""
    notes: list[str] = field(default_factory=list)
    top: pd.DataFrame | None = None
    """The ``top_k`` feasible configurations by decode tokens/s per GPU (a display table)."""
    front: pd.DataFrame | None = None
    """Within the latency targets (when one is given): the Pareto front (display table)."""
    front_rows: pd.DataFrame | None = None
    """The front's full rows."""
    within_targets: int = 0
    """Feasible rows within the targets."""
    feasible: int = 0
    recommendation: RecommendResult | None = None


def _hardware(job: ServingJob) -> tuple:
    pre = (job.prefill_hardware,) if job.recommends and job.prefill_hardware else ()
    return (*job.sweep.hardware, *pre)


def check_serving_job(job: ServingJob) -> None:
    """What a job checks before it evaluates anything: the timing's tables load on every part
    it runs on, the dtypes of a recommendation."""
    serving_timing(job.timing, _hardware(job))
    if job.recommends:
        spec = job.sweep
        ServingSpec(
            prompt_len=spec.prompt_lens[0], weights_dtype=spec.weights_dtype,
            kv_dtype=spec.kv_dtype, moe_routing=spec.moe_routing,
            moe_dispatch=spec.moe_dispatch,
        )  # fmt: skip


def run_serving_job(
    job: ServingJob, store: ResultStore, log: Callable[[str], None] = print
) -> ServingResult:
    """Run ``job`` (see the module docstring); ``store`` holds the sweep's rows and, under
    ``_recommend/``, a recommendation's candidates."""
    check_serving_job(job)
    result = ServingResult(job=job, store_root=store.root)
    if job.mode == "sweep":
        _sweep(job, store, log, result)
    if job.recommends:
        result.recommendation = _recommend(job, store.root)
    return result


def _sweep(job: ServingJob, store: ResultStore, log, result: ServingResult) -> None:
    spec = job.sweep
    report = run_serving(spec, store, log, timing=job.timing)
    df = store.read()
    result.report, result.folder_rows = report, len(df)
    if job.timing == "measured":
        result.notes += tables_notes(spec.hardware)
        ok = df[(df["status"] == "ok") & (df["run_id"] == report.run_id)]
        if len(ok):
            share = float(ok["measured_share"].median())
            step = "engine step" if spec.mode == "continuous" else "request time"
            result.notes.append(
                f"timing: measured kernel tables for {share:.0%} of the {step} (median over "
                "this run's configurations), roofline for the rest"
            )
    rows = rows_of_run(
        df,
        "serving",
        [spec.model.name],
        [hw.name for hw in spec.hardware],
        spec.cluster.name,
        timing=job.timing,
    )
    result.rows = rows
    result.reused = int((rows["run_id"].astype(str) != report.run_id).sum())
    result.top = serving_top_table(rows, job.top_k)
    if not (job.ttft_sla_ms or job.tpot_sla_ms):
        return
    ok = rows[rows["status"] == "ok"]
    meets = ok[
        (ok["ttft_s"] * 1e3 <= (job.ttft_sla_ms or np.inf))
        & (ok["tpot_s"] * 1e3 <= (job.tpot_sla_ms or np.inf))
    ]
    scored = meets.assign(
        neg_gpu=-meets["decode_tokens_per_s_per_gpu"], neg_user=-1.0 / meets["tpot_s"]
    )
    front = pareto(scored, ["neg_gpu", "neg_user"]).sort_values("neg_user")
    result.front_rows = front.drop(columns=["neg_gpu", "neg_user"])
    result.front = serving_top_table(front, len(front), by="tpot_s")
    result.within_targets, result.feasible = len(meets), len(ok)


def _recommend(job: ServingJob, root: Path) -> RecommendResult:
    """The fewest GPUs serving ``job.target_requests_per_s`` within the targets on each
    hardware, aggregated and disaggregated; every candidate stored under ``root/_recommend``."""
    spec = job.sweep
    ttft_ms, tpot_ms, target = job.ttft_sla_ms, job.tpot_sla_ms, job.target_requests_per_s
    prompt = spec.prompt_lens[0]
    mix = [tuple(float(x) for x in item) for item in spec.request_mix] or None
    total = sum(w for _, _, w in mix or ())
    mix_label = ",".join(f"{p:g}x{o:g}:{w / total:g}" for p, o, w in mix or ())  # as rows
    workload = (
        f"the mix {mix_label} (prompt x output:weight)"
        if mix
        else f"{prompt} prompt + {spec.output_tokens} output tokens"
    )
    per_node = spec.cluster.gpus_per_node
    tps = (
        tuple(d for d in divisors(spec.model.num_kv_heads) if d <= per_node)
        if spec.tp == "auto"
        else tuple(spec.tp)
    )
    answers, candidates = [], []
    engines = [spec.engine.for_hardware(hw) for hw in spec.hardware]  # its limits on each GPU
    engine_caps = [e.max_running for e in engines]
    for hw, engine in zip(spec.hardware, engines, strict=True):
        answer = recommend(
            spec.model,
            hw,
            spec.cluster,
            prompt=None if mix else prompt,
            output_tokens=None if mix else spec.output_tokens,
            mix=mix,
            target_requests_per_s=target,
            ttft_sla_s=ttft_ms / 1e3,
            tpot_sla_s=tpot_ms / 1e3,
            tps=tps,
            eps=tuple(spec.ep),
            weights_dtype=spec.weights_dtype,
            kv_dtype=spec.kv_dtype,
            moe_routing=spec.moe_routing,
            moe_dispatch=spec.moe_dispatch,
            max_running=job.max_running,
            engine=engine,
            prefill_hardware=job.prefill_hardware,
            kv_link=job.kv_link,
            timing=job.timing,
        )
        for part, frame in (
            ("aggregated", answer.aggregated),
            ("disaggregated", answer.disaggregated),
            ("near_miss", answer.near_miss),
        ):
            candidates.append(frame.assign(hardware=hw.name, model=spec.model.name, part=part))
        rate, layout = np.nan, None
        if len(answer.disaggregated):
            rate, layout = aggregated_rate_at(answer.aggregated, answer.disaggregated.iloc[0].gpus)
        share = None
        parts = pd.concat([answer.aggregated, answer.disaggregated])
        if job.timing == "measured" and len(parts):
            share = float(parts["measured_share"].median())
        answers.append(HardwareAnswer(hw.name, answer, rate, layout, share))
    folder = root / "_recommend"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{new_run_id()}.parquet"
    pd.concat(candidates, ignore_index=True).assign(
        target_requests_per_s=target, ttft_sla_ms=ttft_ms, tpot_sla_ms=tpot_ms,
        prompt=np.nan if mix else prompt, output_tokens=np.nan if mix else spec.output_tokens,
        request_mix=mix_label or None, kv_link=job.kv_link,
    ).to_parquet(path)  # fmt: skip
    return RecommendResult(
        model=spec.model.name,
        target_requests_per_s=target,
        ttft_sla_ms=ttft_ms,
        tpot_sla_ms=tpot_ms,
        workload=workload,
        weights_dtype=str(spec.weights_dtype),
        kv_dtype=str(spec.kv_dtype),
        engine=spec.engine.name,
        running_cap=job.max_running or max(engine_caps),
        running_cap_from=(
            "serving.batch_size"
            if job.max_running is not None
            else "engine.max_running" + (", by GPU" if len(set(engine_caps)) > 1 else "")
        ),
        timing=job.timing,
        hardware=tuple(answers),
        path=path,
    )
