"""Serving under measured kernel timing: prefill and decode kernels from the tables, rows that
say so, consistent parts for continuous batching, one-line errors without tables."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.compile import SYMBOL_NAMES
from stage_dse.cost.serving import (
    SHARES,
    ServingTiming,
    _compiled_measured,
    evaluate_serving_table,
    measured_serving_program,
)
from stage_dse.errors import ConfigError
from stage_dse.kernels.interp import GridTable
from stage_dse.kernels.tables import data_root, load_tables
from stage_dse.results import ResultStore, load
from stage_dse.runner.serving import ServingSweepSpec, run_serving, serving_row
from stage_dse.spec.serving import ServingSpec

needs_tables = pytest.mark.skipif(
    data_root() is None, reason="the measured extra (aiconfigurator-core) is not installed"
)
H100 = load_hardware("h100_sxm")
TIMES = ["serve_ttft_s", "serve_tpot_s", "serve_prefill_attention_s", "serve_decode_attention_s"]


def rows(model: str, hardware=H100, tp: int = 1, batches=(1, 32), prompt=2048, out=256, **kw):
    table, keys = [], []
    for b in batches:
        serving = ServingSpec(prompt_len=prompt, output_tokens=out, batch_size=b, **kw)
        row, key = serving_row(load_model(model), serving, hardware, load_cluster("dgx_h100"), tp)
        table.append(row)
        keys.append(key)
    return pd.DataFrame(table), keys


def kernel_times(table: pd.DataFrame, keys: list, gpu: str):
    """Each measured kernel of row 0's program: (pass, kernel, shape, seconds, measured)."""
    from stage_dse.kernels.timing import kernel_seconds

    _, _, shapes, kernels = _compiled_measured(keys[0])
    _, found = measured_serving_program(keys[0])
    shape_out = shapes(table[list(SYMBOL_NAMES)].to_numpy(np.float64)[:1])
    seconds, measured = kernel_seconds(kernels, shape_out, load_tables(gpu))
    out, col = [], 0
    for j, (mode, kernel, _) in enumerate(found):
        n = len(kernel.shape)
        out.append((mode, kernel, shape_out[0, col : col + n], seconds[0, j], measured[0, j]))
        col += n + 1
    return out


def raw(gpu: str, folder: str, table: str) -> pd.DataFrame:
    path = data_root() / gpu / folder / "trtllm"
    return pd.read_parquet(max(path.glob(f"*/{table}.parquet"), key=lambda p: p.stat().st_mtime))


@needs_tables
def test_measured_rows_differ_from_the_roofline_and_every_part_is_measured():
    table, keys = rows("llama3_70b", tp=8, batches=(1, 32, 128))
    roof = evaluate_serving_table(table, keys)
    meas = evaluate_serving_table(table, keys, timing="measured")
    for col in TIMES:
        assert not np.allclose(roof[col], meas[col], rtol=1e-3), col
    # memory does not depend on the timing source
    for col in ("serve_weights_bytes", "serve_kv_cache_bytes", "serve_working_bytes"):
        assert np.array_equal(roof[col], meas[col])
    for col in SHARES:
        assert ((meas[col] > 0.5) & (meas[col] <= 1)).all(), col
    # the attention parts batching composes are inside TTFT / TPOT, measured alike
    assert (meas["serve_prefill_attention_s"] < meas["serve_ttft_s"]).all()
    assert (meas["serve_decode_attention_s"] < meas["serve_tpot_s"]).all()


@needs_tables
def test_decode_gemm_at_batch_one_is_the_tables_value():
    """Llama-3-8B's q_proj and o_proj at batch 1 are a measured point of H100's GEMM table:
    (m, n, k) = (1, 4096, 4096), 16-bit."""
    table, keys = rows("llama3_8b", batches=(1,))
    gemm = raw("h100_sxm", "gemm", "gemm_perf")
    gemm = gemm[gemm["gemm_dtype"] == "bfloat16"]
    found = [
        (shape, s, ok)
        for mode, k, shape, s, ok in kernel_times(table, keys, "h100_sxm")
        if mode == "decode" and k.table == "gemm"
    ]
    # m: the running batch; every decode GEMM is measured but the output layer's, whose n
    # (the vocabulary, 128,256) lies beyond the table's largest (65,536): it keeps its roofline
    assert found and all(shape[0] == 1 for shape, _, _ in found)
    n_max = gemm["n"].max()
    assert all(ok == (shape[1] <= n_max) for shape, _, ok in found)
    assert sum(not ok for _, _, ok in found) == 1
    (s,) = {s for shape, s, _ in found if tuple(shape[:3]) == (1, 4096, 4096)}  # q, o_proj
    point = gemm[(gemm["m"] == 1) & (gemm["n"] == 4096) & (gemm["k"] == 4096)]["latency"]
    assert s == pytest.approx(point.min() * 1e-3, rel=1e-12)


@needs_tables
def test_decode_attention_is_the_generation_tables_value():
    """A decode step at a KV length the table measured (prompt 1920 + 256 / 2 = 2048 cached
    positions): 32 query and 8 key/value heads of 128 on one H100, batch 1, 16-bit cache."""
    table, keys = rows("llama3_8b", batches=(1,), prompt=1920)
    ((shape, s),) = [
        (shape, s)
        for _, k, shape, s, ok in kernel_times(table, keys, "h100_sxm")
        if k.table == "generation_attention" and ok
    ]
    assert tuple(shape[[0, 1, 3, 4, 5, 6]]) == (1, 2048, 32, 8, 128, 2)
    g = raw("h100_sxm", "attention", "generation_attention_perf")
    g = g[
        (g["batch_size"] == 1)
        & (g["isl"] + g["step"] == 2048)
        & (g["num_heads"] == 32)
        & (g["num_key_value_heads"] == 8)
        & (g["head_dim"] == 128)
        & (g["kv_cache_dtype"] == "bfloat16")
        & (g["window_size"] == 0)
    ]
    assert s == pytest.approx(g["latency"].min() * 1e-3, rel=1e-12)


@needs_tables
def test_latent_attention_uses_the_mla_tables():
    table, keys = rows("deepseek_v3", hardware=load_hardware("h200"), tp=8, batches=(8,))
    found = {k.table: ok for _, k, _, _, ok in kernel_times(table, keys, "h200_sxm")}
    assert found["context_mla"] and found["generation_mla"]
    assert "context_attention" not in found and "generation_attention" not in found


def test_waves_of_the_largest_measured_batch_where_a_cell_was_left_out():
    """A (batch, length) cell the collection skipped: the batch runs as waves of the largest
    batch measured at that length."""
    from stage_dse.kernels.timing import _batched

    points = np.array([[1, 1], [1, 2], [2, 1], [2, 2], [4, 1]])
    grid = GridTable.from_points(("batch", "kv"), points, [1.0, 2.0, 1.5, 3.0, 2.5])
    got, ok = _batched(grid, np.array([4.0, 4.0, 8.0, 0.5]), np.array([1.0, 2.0, 2.0, 1.0]))
    assert ok.tolist() == [True, True, True, False]
    assert got[:3] == pytest.approx([2.5, 2 * 3.0, 4 * 3.0])


def test_a_part_without_tables_keeps_the_roofline():
    mi300x = load_hardware("mi300x")
    table, keys = rows("llama3_8b", hardware=mi300x)
    roof = evaluate_serving_table(table, keys)
    meas = evaluate_serving_table(table, keys, timing="measured")
    assert np.allclose(meas[TIMES], roof[TIMES], rtol=1e-12, atol=0)
    assert (meas[list(SHARES)] == 0).all().all()
    # likewise a part mapped to no table set
    off = ServingTiming("measured", {"h100_sxm": None})
    h100, keys = rows("llama3_8b")
    assert np.allclose(
        evaluate_serving_table(h100, keys, timing=off)[TIMES],
        evaluate_serving_table(h100, keys)[TIMES],
        rtol=1e-12,
    )


@needs_tables
def test_continuous_batching_with_one_request_equals_the_static_measured_batch_one():
    """Chunks of the whole prompt and one running request: every step is a whole prefill or
    a single decode, so the steady state's TTFT and TPOT are the static batch-1 figures,
    under measured timing as under the roofline (its parts are measured alike)."""
    from stage_dse.cost.batching import continuous_batching

    table, keys = rows("llama3_8b", batches=(1,))
    static = evaluate_serving_table(table, keys, timing="measured").iloc[0]
    cb = continuous_batching(table, keys, 1, 2048, timing="measured").iloc[0]
    assert cb["cb_ttft_s"] == pytest.approx(static["serve_ttft_s"], rel=1e-9)
    assert cb["cb_tpot_s"] == pytest.approx(static["serve_tpot_s"], rel=1e-9)


def spec(name: str, mode: str = "static") -> ServingSweepSpec:
    return ServingSweepSpec(
        name=name,
        model=load_model("llama3_8b"),
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        tp=(1, 2),
        batch_sizes=(1, 16),
        prompt_lens=(1024,),
        mode=mode,
    )


@needs_tables
@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_measured_sweep_rows_say_so_and_hash_apart(tmp_path, mode):
    quiet = {"log": lambda s: None}
    run_serving(spec("s", mode), ResultStore(tmp_path / "roof"), **quiet)
    run_serving(spec("s", mode), ResultStore(tmp_path / "meas"), timing="measured", **quiet)
    roof, meas = load(tmp_path / "roof"), load(tmp_path / "meas")
    assert set(roof["timing"]) == {"roofline"} and set(meas["timing"]) == {"measured"}
    assert (roof["measured_share"] == 0).all()
    assert ((meas["measured_share"] > 0) & (meas["measured_share"] <= 1)).all()
    assert not set(roof["config_hash"]) & set(meas["config_hash"])
    both = roof.merge(meas, on=["tp", "micro_batch"])
    assert len(both) == len(roof) == 4
    assert not np.allclose(both["tpot_s_x"], both["tpot_s_y"], rtol=1e-3)
    assert not np.allclose(both["ttft_s_x"], both["ttft_s_y"], rtol=1e-3)


@needs_tables
def test_recommend_costs_both_pools_with_measured_kernels():
    from stage_dse.runner.recommend import recommend

    kw = {
        "prompt": 1024,
        "output_tokens": 128,
        "target_requests_per_s": 5.0,
        "ttft_sla_s": 1.0,
        "tpot_sla_s": 0.05,
        "tps": (1, 2),
    }
    args = (load_model("llama3_8b"), H100, load_cluster("dgx_h100"))
    roof = recommend(*args, **kw)
    meas = recommend(*args, timing="measured", **kw)
    for part in ("aggregated", "disaggregated"):
        r, m = getattr(roof, part), getattr(meas, part)
        assert len(m) and set(m["timing"]) == {"measured"} and set(r["timing"]) == {"roofline"}
        assert ((m["measured_share"] > 0) & (m["measured_share"] <= 1)).all()
        assert (r["measured_share"] == 0).all()
        assert not np.allclose(r["tpot_s"].iloc[0], m["tpot_s"].iloc[0], rtol=1e-3)


@needs_tables
def test_unknown_table_set_is_a_one_line_error_before_any_work(tmp_path):
    odd = spec("s")
    odd = ServingSweepSpec(**{**odd.__dict__, "hardware": (H100.replace(measured_gpu="tpu_v5"),)})
    with pytest.raises(ConfigError, match=r"hardware\.measured_gpu='tpu_v5' has no tables"):
        run_serving(odd, ResultStore(tmp_path / "x"), log=lambda s: None, timing="measured")
    assert not (tmp_path / "x").exists() or not list((tmp_path / "x").glob("*.parquet"))


def test_measured_serving_without_the_extra_is_a_one_line_error(tmp_path, monkeypatch):
    import stage_dse.kernels.tables as tables

    monkeypatch.setattr(tables, "data_root", lambda: None)
    tables.load_tables.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"pip install -e '\.\[measured\]'"):
            run_serving(spec("s"), ResultStore(tmp_path / "x"), timing="measured")
    finally:
        tables.load_tables.cache_clear()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stage_dse.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_tables
def test_cli_serving_sweep_with_measured_timing(tmp_path):
    proc = cli(
        "workload=serving",
        "timing=measured",
        "serving.tp=[1,2]",
        "serving.batch_size=[1,8]",
        "serving.prompt_len=[512]",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "timing: measured kernel tables for" in proc.stdout
    df = pd.read_parquet(tmp_path / "default_serving")
    assert len(df) == 4 and set(df["timing"]) == {"measured"}
    assert ((df["measured_share"] > 0) & (df["measured_share"] <= 1)).all()


@needs_tables
def test_cli_names_a_table_set_that_does_not_exist_in_one_line(tmp_path):
    proc = cli(
        "workload=serving",
        "timing=measured",
        "hardware.measured_gpu=tpu_v5",
        f"results_dir={tmp_path}",
    )
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1
    assert "hardware.measured_gpu='tpu_v5' has no tables" in err[0]


def test_cli_notes_a_part_without_tables(tmp_path):
    proc = cli(
        "workload=serving",
        "timing=measured",
        "hardware=mi300x",
        "cluster=mi300x_8",
        "serving.tp=[8]",
        "serving.batch_size=[1]",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "note: timing=measured: no measured kernel tables for mi300x" in proc.stdout
    df = pd.read_parquet(tmp_path / "default_serving")
    assert set(df["timing"]) == {"measured"} and (df["measured_share"] == 0).all()


@needs_tables
def test_validation_serving_cases_run_on_measured_kernels(tmp_path, capsys):
    from stage_dse.cli.validate import main

    out = tmp_path / "cases.parquet"
    assert main(["--quiet", "--kind", "serving", "--source", "trtllm_v061", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "serving programs have no measured path" not in text
    lines = {
        t: next(x for x in text.splitlines() if x.startswith(f"serving timing={t} "))
        for t in ("roofline", "measured")
    }
    assert lines["roofline"].split()[2:] != lines["measured"].split()[2:]
    res = pd.read_parquet(out)
    assert (res["timing"] == res["timing_run"]).all()
    ok = res[res["status"] == "ok"].pivot(index="case", columns="timing", values="predicted")
    assert len(ok) and not np.allclose(ok["roofline"], ok["measured"], rtol=1e-3)


@needs_tables
def test_fused_projections_are_one_gemm_of_their_summed_widths():
    """Llama-3-8B decode at batch 1: q, k and v read the same input and run as one GEMM of
    4096 + 1024 + 1024 columns, gate and up as one of 2 x 14336; o_proj and down_proj stay
    single (each reads its own input)."""
    table, keys = rows("llama3_8b", batches=(1,))
    shapes = {
        tuple(int(v) for v in shape[:3])
        for mode, k, shape, _, _ in kernel_times(table, keys, "h100_sxm")
        if mode == "decode" and k.table == "gemm"
    }
    assert (1, 6144, 4096) in shapes and (1, 28672, 4096) in shapes
    assert (1, 4096, 4096) in shapes and (1, 4096, 14336) in shapes
    assert not {(1, 1024, 4096), (1, 14336, 4096)} & shapes
    # a fused GEMM's roofline fallback is its parts' rooflines, so an unmeasured GPU's totals
    # equal the roofline's exactly
    off = ServingTiming("measured", {"h100_sxm": None})
    assert np.allclose(
        evaluate_serving_table(table, keys, timing=off)[TIMES],
        evaluate_serving_table(table, keys)[TIMES],
        rtol=1e-12,
    )


def moe_raw(gpu: str) -> pd.DataFrame:
    folder = data_root() / gpu / "moe" / "trtllm"
    return pd.concat(pd.read_parquet(p) for p in folder.glob("*/moe_perf.parquet"))


@needs_tables
@pytest.mark.parametrize("routing", ["balanced", "power_law_1.01", "power_law_1.2"])
def test_routed_experts_are_the_fused_moe_tables_value(routing):
    """Qwen3-235B-A22B decode on 8 H200s as 8 attention ranks (experts split 8 ways), 16
    requests per rank, FP8 experts: the group's 128 tokens are a measured point of the MoE
    table (hidden 4096, expert width 1536, top-8 of 128, moe_tp 1, moe_ep 8)."""
    h200 = load_hardware("h200")
    serving = ServingSpec(
        prompt_len=1024, output_tokens=256, batch_size=16, weights_dtype="fp8", moe_routing=routing
    )
    row, key = serving_row(
        load_model("qwen3_235b_a22b"), serving, h200, load_cluster("dgx_h100"), 1, 1, 8
    )
    table = pd.DataFrame([row])
    found = [
        (shape, s, ok)
        for mode, k, shape, s, ok in kernel_times(table, [key], "h200_sxm")
        if mode == "decode" and k.table == "moe"
    ]
    ((shape, s, ok),) = found
    assert ok and tuple(shape[:7]) == (128, 4096, 1536, 8, 128, 1, 8)
    m = moe_raw("h200_sxm")
    point = m[
        (m["moe_dtype"] == "fp8")
        & (m["hidden_size"] == 4096)
        & (m["inter_size"] == 1536)
        & (m["num_experts"] == 128)
        & (m["topk"] == 8)
        & (m["moe_tp_size"] == 1)
        & (m["moe_ep_size"] == 8)
        & (m["distribution"] == routing)
        & (m["num_tokens"] == 128)
        & (m["kernel_source"] != "moe_torch_flow_nongated")
    ]
    newest = point[point["version"] == max(point["version"], key=_version)]
    assert s == pytest.approx(newest["latency"].min() * 1e-3, rel=1e-12)
    # no op of the block is timed apart: the grouped GEMMs are inside the kernel
    assert not any(
        k.table == "gemm" and int(shape[1]) in (1536, 3072)
        for _, k, shape, _, _ in kernel_times(table, [key], "h200_sxm")
    )


def _version(v: str):
    from packaging.version import Version

    return Version(v)


def test_moe_formats_follow_the_experts_storage_and_the_gemm_precision():
    from stage_dse.kernels.timing import _moe_formats

    assert _moe_formats(2, 2) == ("bfloat16",)
    assert _moe_formats(1, 1) == ("fp8", "fp8_block")
    assert _moe_formats(1, 2) == ()  # FP8 storage on 16-bit math: no table
    assert _moe_formats(0.53125, 2) == ("w4a16_mxfp4",)  # an engine feeding bf16
    assert _moe_formats(0.53125, 1) == ("w4a8_mxfp4_mxfp8",)  # MXFP8 activations (W4A8)
    assert _moe_formats(0.5625, 0.5625) == ("nvfp4",)
    assert _moe_formats(0.5625, 2) == ()


def test_moe_tokens_beyond_the_table_run_as_waves_of_its_largest():
    from stage_dse.kernels.tables import MeasuredTables
    from stage_dse.kernels.timing import _moe

    grid = GridTable.from_points(("tokens",), np.array([[1.0], [64.0], [1024.0]]), [1, 2, 8])
    layout = ("bfloat16", 2048, 768, 8, 128, 1, 1, "balanced")
    tables = MeasuredTables("x", {}, {}, {}, "0", moe={layout: grid})
    base = [2048, 768, 8, 128, 1, 1, 2, 2, 0]
    shape = np.array([[64.0, *base], [4096.0, *base], [64.0, *base[:-1], 1]])
    got, ok = _moe(shape, tables)
    assert ok.tolist() == [True, True, False]  # no power-law table for this layout
    assert got[:2] == pytest.approx([2.0, 4 * 8.0])
