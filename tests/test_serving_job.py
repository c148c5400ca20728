"""The serving driver: every serving option of the command line reaches
:func:`stage_dse.runner.serving_job.run_serving_job` and shows in what it returns."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from test_sweep import compose_cfg

from stage_dse.config.schema import ServingConf, SlaConf, to_serving_job
from stage_dse.errors import ConfigError
from stage_dse.kernels.tables import data_root
from stage_dse.results import ResultStore
from stage_dse.runner.serving_job import run_serving_job

needs_tables = pytest.mark.skipif(
    data_root() is None, reason="the measured extra (aiconfigurator-core) is not installed"
)
TINY = [
    "workload=serving",
    "model=llama3_8b",
    "serving.tp=[1,2]",
    "serving.batch_size=[1,8,64]",
    "serving.prompt_len=[512]",
    "serving.output_tokens=64",
]
"""Six configurations of a small model."""


def job_of(overrides, tmp_path):
    return to_serving_job(compose_cfg([*TINY, f"results_dir={tmp_path}", *overrides]))


def run_job(overrides, tmp_path):
    job = job_of(overrides, tmp_path)
    return run_serving_job(job, ResultStore(tmp_path / job.sweep.name), log=lambda s: None)


NOT_A_JOB_OPTION = {"phase": "the pass stage-dse-trace writes; no serving job reads it"}
"""``serving.*`` options that a serving job does not take (and why)."""
OTHER_VALUE = {
    "tp": "[4]",
    "pp": "[2]",
    "ep": "[2]",
    "batch_size": "[2]",
    "prompt_len": "[128]",
    "output_tokens": "32",
    "kv_dtype": "fp8",
    "weights_dtype": "fp8",
    "hardware": "[h200]",
    "mode": "continuous",
    "prefill_budget": "[1024]",
    "arrival_rate": "0.5",
    "draft_tokens": "1",
    "acceptance": "0.5",
    "sla.ttft_ms": "500",
    "sla.tpot_ms": "20",
    "target_requests_per_s": "3",
    "request_mix": "[[512,64,1]]",
    "prefill_hardware": "h200",
    "kv_link": "nvlink",
    "engine": "vllm",
    "clients": "4",
    "burst": "4",
    "output_lengths": "exponential",
    "max_total_tokens": "1024",
    "moe_routing": "balanced",
    "moe_dispatch": "alltoall",
}
NEEDS = {
    "request_mix": ["serving.mode=continuous"],
    "arrival_rate": ["serving.mode=continuous"],
    "clients": ["serving.mode=continuous"],
    "burst": ["serving.mode=continuous"],
    "output_lengths": ["serving.mode=continuous"],
}
"""What an option needs beside it (both jobs get it: only the option differs)."""


def test_every_serving_option_is_covered_here():
    names = {f.name for f in dataclasses.fields(ServingConf) if f.name != "sla"}
    names |= {f"sla.{f.name}" for f in dataclasses.fields(SlaConf)}
    assert names == set(OTHER_VALUE) | set(NOT_A_JOB_OPTION)


@pytest.mark.parametrize("option", sorted(OTHER_VALUE))
def test_no_serving_option_is_lost_on_the_way_to_the_driver(option, tmp_path):
    """A non-default value of each option gives another job: none is dropped between the
    config and the driver."""
    base = NEEDS.get(option, [])
    default = job_of(base, tmp_path)
    other = job_of([*base, f"serving.{option}={OTHER_VALUE[option]}"], tmp_path)
    assert other != default


@pytest.mark.parametrize(
    ("override", "field", "value"),
    [
        ("timing=measured", "timing", "measured"),
        ("top_k=3", "top_k", 3),
        ("mode=recommend", "mode", "recommend"),
    ],
)
def test_top_level_serving_options_reach_the_job(override, field, value, tmp_path):
    sla = ["serving.sla.ttft_ms=1000", "serving.sla.tpot_ms=50", "serving.target_requests_per_s=1"]
    assert getattr(job_of([*sla, override], tmp_path), field) == value


@needs_tables
def test_measured_timing_shows_in_the_rows_and_notes(tmp_path):
    result = run_job(["timing=measured"], tmp_path)
    assert set(result.rows["timing"]) == {"measured"} and len(result.rows) == 6
    assert (result.rows["measured_share"] > 0).all()
    assert any(n.startswith("timing: measured kernel tables for") for n in result.notes)
    roofline = run_job([], tmp_path)
    assert set(roofline.rows["timing"]) == {"roofline"} and not roofline.notes
    sla = ["serving.sla.ttft_ms=2000", "serving.sla.tpot_ms=40", "serving.target_requests_per_s=3"]
    rec = run_job(["mode=recommend", "timing=measured", *sla], tmp_path).recommendation
    assert set(pd.read_parquet(rec.path)["timing"]) == {"measured"}
    assert rec.timing == "measured" and 0 < rec.hardware[0].measured_share <= 1


def test_top_k_sets_the_top_table(tmp_path):
    result = run_job(["top_k=2"], tmp_path)
    assert len(result.top) == 2
    ok = result.rows[result.rows["status"] == "ok"]
    best = ok["decode_tokens_per_s_per_gpu"].nlargest(2).round(0).tolist()
    assert result.top["tok_s_gpu"].tolist() == best
    assert result.front is None and result.recommendation is None


@pytest.mark.parametrize("target", ["ttft_ms", "tpot_ms"])
def test_each_latency_target_bounds_the_front(target, tmp_path):
    free = run_job([], tmp_path / "free").rows
    ok = free[free["status"] == "ok"]
    column = "ttft_s" if target == "ttft_ms" else "tpot_s"
    cut_ms = float(ok[column].median() * 1e3)  # about half the feasible rows meet it
    result = run_job([f"serving.sla.{target}={cut_ms}"], tmp_path)
    assert 0 < result.within_targets < result.feasible == len(ok)
    assert len(result.front) and (result.front_rows[column] * 1e3 <= cut_ms).all()
    assert result.recommendation is None  # one target and no rate: no recommendation


def test_targets_and_a_rate_after_a_sweep_recommend(tmp_path):
    sla = ["serving.sla.ttft_ms=2000", "serving.sla.tpot_ms=40"]
    result = run_job([*sla, "serving.target_requests_per_s=3"], tmp_path)
    assert result.report is not None and len(result.rows) == 6
    rec = result.recommendation
    assert (rec.target_requests_per_s, rec.ttft_sla_ms, rec.tpot_sla_ms) == (3, 2000, 40)
    assert rec.running_cap == 64 and rec.running_cap_from == "serving.batch_size"
    saved = pd.read_parquet(rec.path)
    assert set(saved["target_requests_per_s"]) == {3} and set(saved["kv_link"]) == {"nic"}
    qualifying = saved[saved["part"] != "near_miss"]
    assert (qualifying["tpot_s"] <= 0.040).all() and (
        qualifying["max_running"].dropna() <= 64
    ).all()
    assert set(saved["tp"].dropna()) <= {1, 2}


def test_recommend_mode_recommends_only_and_takes_its_options(tmp_path):
    overrides = [
        "mode=recommend",
        "serving.sla.ttft_ms=2000",
        "serving.sla.tpot_ms=40",
        "serving.target_requests_per_s=3",
        "serving.prefill_hardware=h200",
        "serving.kv_link=nvlink",
    ]
    result = run_job(overrides, tmp_path)
    assert result.report is None and result.rows is None
    stored = (tmp_path / "default_serving").rglob("*.parquet")
    assert all("_recommend" in p.parts for p in stored)  # no sweep rows
    rec = result.recommendation
    saved = pd.read_parquet(rec.path)
    dis = saved[saved["part"] == "disaggregated"]
    assert len(dis) and set(dis["prefill_hardware"]) == {"h200"}
    assert set(saved["kv_link"]) == {"nvlink"} and set(saved["timing"]) == {"roofline"}
    assert [a.hardware for a in rec.hardware] == ["h100_sxm"]


def test_recommend_mode_without_targets_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"serving\.sla\.ttft_ms and serving\.sla\.tpot_ms"):
        job_of(["mode=recommend"], tmp_path)
    with pytest.raises(ConfigError, match=r"^serving\.sla\.tpot_ms must be > 0"):
        job_of(["serving.sla.tpot_ms=-5"], tmp_path)


def test_vllm_limits_follow_the_gpu_as_vllm_serve_picks_them(tmp_path):
    """vLLM's `vllm serve` defaults: max_num_seqs 1024 and max_num_batched_tokens 8192 on a GPU
    of at least 70 GiB that is not an A100, 256 and 2048 elsewhere. A continuous sweep with the
    engine and no stated budget runs each GPU at its own; a stated budget holds everywhere."""
    from stage_dse.config import load_engine, load_hardware

    vllm = load_engine("vllm")
    limits = {
        hw: (e.max_running, e.prefill_budget)
        for hw in ("h100_sxm", "h200", "b200", "mi300x", "a100_80gb", "l40s")
        for e in [vllm.for_hardware(load_hardware(hw))]
    }
    assert limits == {
        "h100_sxm": (1024, 8192),
        "h200": (1024, 8192),
        "b200": (1024, 8192),
        "mi300x": (1024, 8192),
        "a100_80gb": (256, 2048),
        "l40s": (256, 2048),
    }
    trtllm = load_engine("trtllm")
    assert trtllm.for_hardware(load_hardware("h100_sxm")) == trtllm  # one set for every GPU
    sweep = [
        "serving.mode=continuous",
        "serving.engine=vllm",
        "serving.hardware=[h100_sxm,a100_80gb]",
        "serving.tp=[1]",
    ]
    rows = run_job(sweep, tmp_path).rows
    assert rows.groupby("hardware")["prefill_budget"].unique().map(list).to_dict() == {
        "a100_80gb": [2048.0],
        "h100_sxm": [8192.0],
    }
    stated = run_job([*sweep, "serving.prefill_budget=[4096]"], tmp_path / "stated").rows
    assert set(stated["prefill_budget"]) == {4096.0}
    assert set(run_job(["serving.mode=continuous"], tmp_path / "none").rows["prefill_budget"]) == {
        2048.0
    }
    with pytest.raises(ConfigError, match=r"engine\.large_gpu_excludes must be a list"):
        vllm.replace(large_gpu_excludes="a100")
