"""Measured kernel tables: reading aiconfigurator-core's data and interpolating it."""

from __future__ import annotations

import numpy as np
import pytest

from stage_dse.errors import ConfigError
from stage_dse.kernels.interp import GridTable
from stage_dse.kernels.tables import data_root, load_tables

needs_tables = pytest.mark.skipif(
    data_root() is None, reason="the measured extra (aiconfigurator-core) is not installed"
)
GPUS = ("a100_sxm", "h100_sxm")


def held_out_errors(table: GridTable) -> np.ndarray:
    """Leave-one-out over the grid: each interior layer of measured points (one value of one
    axis) is held out and interpolated from its neighbours; relative errors of every measured
    point of the layer. Removing a layer doubles the local grid spacing, so this over-states
    the error of a query that falls between measured points."""
    errors = []
    for axis, values in enumerate(table.axes):
        for i in range(1, len(values) - 1):
            reduced = GridTable(
                table.names,
                tuple(np.delete(a, i) if d == axis else a for d, a in enumerate(table.axes)),
                np.delete(table.seconds, i, axis=axis),
            )
            truth = np.take(table.seconds, i, axis=axis)
            where = [a if d != axis else values[i : i + 1] for d, a in enumerate(table.axes)]
            grid = [g.reshape(truth.shape) for g in np.meshgrid(*where, indexing="ij")]
            got, inside = reduced.lookup(*grid)
            ok = inside & np.isfinite(truth)
            errors.append(got[ok] / truth[ok] - 1)
    return np.concatenate(errors) if errors else np.zeros(0)


def test_interpolation_is_log_linear_and_exact_at_grid_points():
    t = GridTable.from_points(("a", "b"), np.array([[1, 1], [1, 4], [4, 1], [4, 4]]), [1, 2, 4, 8])
    got, inside = t.lookup(np.array([1, 4, 2, 2]), np.array([1, 4, 1, 2]))
    assert inside.all()
    assert got == pytest.approx([1, 8, 2, 8**0.5])  # (2, 1): halfway in log a between 1 and 4


def test_queries_outside_the_grid_or_in_an_unmeasured_cell_are_outside():
    t = GridTable.from_points(("a", "b"), np.array([[1, 1], [1, 4], [4, 1]]), [1, 2, 4])
    got, inside = t.lookup(np.array([8, 0.5, 2, 1]), np.array([1, 1, 2, 2]))
    assert inside.tolist() == [False, False, False, True]  # (2, 2) needs the missing (4, 4)
    assert np.isnan(got[:3]).all() and got[3] == pytest.approx(2**0.5)


def test_a_point_measured_twice_keeps_the_faster():
    t = GridTable.from_points(("a",), np.array([[1], [2], [2]]), [1.0, 3.0, 2.0])
    assert t.lookup(np.array([2]))[0][0] == 2.0


@needs_tables
@pytest.mark.parametrize("gpu", GPUS)
def test_lookup_returns_the_measured_value_at_measured_points(gpu):
    import pandas as pd

    tables = load_tables(gpu)
    frame = pd.read_parquet(
        next((data_root() / gpu / "gemm" / "trtllm").glob(f"{tables.version}/gemm_perf.parquet"))
    )
    rows = frame[frame["gemm_dtype"] == "bfloat16"].sample(200, random_state=0)
    got, inside = tables.gemm["bf16"].lookup(rows["m"], rows["n"], rows["k"])
    assert inside.all()
    assert got == pytest.approx(rows["latency"].to_numpy() * 1e-3, rel=1e-12)
    # a large GEMM runs near the GPU's dense bf16 peak (A100 312, H100 989 TFLOP/s)
    s, _ = tables.gemm["bf16"].lookup(8192, 8192, 8192)
    tflops = 2 * 8192**3 / float(s) / 1e12
    assert 0.6 < tflops / {"a100_sxm": 312, "h100_sxm": 989}[gpu] < 1.0


@needs_tables
@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("kind", ["gemm", "attention", "nccl"])
def test_held_out_measurements_are_interpolated_from_their_neighbours(gpu, kind):
    """Median and 90th-percentile error of leave-one-out interpolation. Measured on these
    tables: medians 1.8-3.6%, 90th percentiles 7.7-15.8% (thin GEMMs at the coarse end of
    the grid vary most). The bounds leave room for noise in newer table versions and stay
    well below the 20-60% the constant-efficiency roofline is off on thin or small kernels."""
    tables = load_tables(gpu)
    group = {"gemm": tables.gemm, "attention": tables.attention, "nccl": tables.nccl}[kind]
    errors = np.abs(np.concatenate([held_out_errors(t) for t in group.values()]))
    assert len(errors) > 200
    assert np.median(errors) < 0.06
    assert np.quantile(errors, 0.9) < 0.20


@needs_tables
def test_tables_cover_what_training_needs():
    a100, h100 = load_tables("a100_sxm"), load_tables("h100_sxm")
    assert set(a100.gemm) == {"bf16"} and set(h100.gemm) == {"bf16", "fp8"}
    assert {(op, n) for op, n in h100.nccl} >= {
        (op, n)
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        for n in (2, 4, 8)
    }
    # Llama-3-70B attention at tp 8 (8 query heads, 1 kv head) and GPT-3 at tp 8 (12/12)
    assert (8, 1, 128) in h100.attention and (12, 12, 128) in a100.attention
    # an 8-GPU all-reduce of 128 MiB: bus bandwidth 2(n-1)/n * bytes / t within NVLink's range
    s, inside = h100.nccl["all_reduce", 8].lookup(128 * 2**20)
    busbw = 2 * 7 / 8 * 128 * 2**20 / float(s)
    assert inside and 200e9 < busbw < 450e9


def test_unknown_table_set_is_a_one_line_error():
    if data_root() is None:
        with pytest.raises(ConfigError, match=r"pip install -e '\.\[measured\]'"):
            load_tables("a100_sxm")
    else:
        with pytest.raises(ConfigError, match=r"hardware\.measured_gpu='tpu_v5' has no tables"):
            load_tables("tpu_v5")


def _table(model: str, hardware: str, cluster: str, gpus: int, seq: int, batch: int, space):
    from stage_dse.config import load_cluster, load_hardware, load_model
    from stage_dse.search import enumerate_plans
    from stage_dse.spec import TrainingSpec

    return enumerate_plans(
        load_model(model),
        TrainingSpec(seq_len=seq, global_batch_size=batch),
        load_hardware(hardware),
        load_cluster(cluster, num_gpus=gpus),
        space,
    ).table


def test_measured_timing_without_tables_is_the_roofline():
    """A GPU without tables (MI300X): every kernel keeps its roofline time, so the measured
    program (kernel times as inputs) reproduces the roofline step time."""
    from stage_dse.cost.table import evaluate_table
    from stage_dse.search import SearchSpace

    table = _table("llama3_8b", "mi300x", "mi300x_8", 64, 4096, 256, SearchSpace(tp=(1, 2, 8)))
    plain = evaluate_table(table)
    measured = evaluate_table(table, timing="measured")
    assert (measured["measured_share"] == 0).all()
    for col in ("time_step_s", "time_compute_s", "time_tp_comm_s", "mfu", "mem_total"):
        assert np.allclose(measured[col], plain[col], rtol=1e-12, atol=0), col


@needs_tables
def test_measured_kernels_come_from_the_tables_and_outside_shapes_fall_back():
    from stage_dse.cost.compile import SYMBOL_NAMES, family_for, family_kernels
    from stage_dse.cost.table import KEY_COLUMNS, evaluate_table, key_from_values
    from stage_dse.kernels.timing import kernel_seconds
    from stage_dse.search import SearchSpace

    space = SearchSpace(tp=(8,), pp=(8,), sequence_parallel=(False,), zero_stage=(1,))
    tables = load_tables("a100_sxm")
    shares = {}
    for seq in (2048, 32768):  # A100's attention table stops at 16,384 tokens
        table = _table("llama3_70b", "a100_80gb", "dgx_a100", 512, seq, 256, space)
        key = key_from_values(dict(table[list(KEY_COLUMNS)].iloc[0]))
        kernels = family_kernels(key)
        x = table[list(SYMBOL_NAMES)]
        x = np.ascontiguousarray(x.to_numpy(np.float64))
        shapes = family_for(key, "kernels", len(x))(x)
        seconds, measured = kernel_seconds(kernels, shapes, tables)
        attention = [j for j, k in enumerate(kernels) if k.table == "attention"]
        gemms = [j for j, k in enumerate(kernels) if k.table == "gemm"]
        if seq == 2048:  # every GEMM of Llama-3-70B at tp 8 is inside the table
            assert measured[:, gemms].all()
            # a GEMM's time is the table's at its (m, n, k)
            col = sum(len(k.shape) + 1 for k in kernels[: gemms[0]])
            m, n, k_ = shapes[0, col : col + 3]
            want = float(tables.gemm["bf16"].lookup(m, n, k_)[0])
            assert seconds[0, gemms[0]] == pytest.approx(want)
        assert measured[:, attention].all() == (seq == 2048)
        if seq == 32768:  # counted as roofline: the kernel's roofline seconds
            roof = [sum(len(k.shape) + 1 for k in kernels[: j + 1]) - 1 for j in attention]
            assert np.array_equal(seconds[:, attention], shapes[:, roof])
        shares[seq] = evaluate_table(table, timing="measured")["measured_share"]
    assert ((shares[2048] > 0.5) & (shares[2048] <= 1)).all()
    assert shares[32768].max() < shares[2048].min()


@needs_tables
def test_measured_sweep_rows_say_their_timing_and_never_collide_with_roofline_rows(tmp_path):
    from test_sweep import compose_cfg

    from stage_dse.cli import run
    from stage_dse.results import load

    base = [f"results_dir={tmp_path}", "runner.progress=false", "num_gpus=[16]"]
    run(compose_cfg([*base, "sweep_name=roof"]))
    run(compose_cfg([*base, "sweep_name=meas", "timing=measured"]))
    roof, meas = load(tmp_path / "roof"), load(tmp_path / "meas")
    assert set(roof["timing"]) == {"roofline"} and set(meas["timing"]) == {"measured"}
    assert (roof["measured_share"] == 0).all()
    ok = meas[meas["status"] == "ok"]
    assert ((ok["measured_share"] > 0) & (ok["measured_share"] <= 1)).all()
    assert not set(roof["config_hash"]) & set(meas["config_hash"])
    # memory does not depend on the timing source; step times do
    plan = ["dp", "tp", "pp", "cp", "micro_batch", "zero_stage", "recompute"]
    plan += ["sequence_parallel", "attention", "virtual_stages", "stage_layers"]
    both = roof.merge(meas, on=plan)
    assert len(both) == len(roof) == len(meas)
    assert np.allclose(both["mem_total_bytes_x"], both["mem_total_bytes_y"])
    assert not np.allclose(both["step_s_x"], both["step_s_y"])


@needs_tables
def test_validate_prints_both_sources(capsys):
    from stage_dse.cli.validate import main

    args = ["--quiet", "--source", "narayanan2021_t1", "--source", "korthikanti2022_t4"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    for source in ("roofline", "measured"):
        line = next(x for x in lines if x.startswith(f"training timing={source} "))
        fields = dict(kv.split("=") for kv in line.split()[1:])
        assert fields["n"] == "20" and fields["cannot_express"] == "0"
        assert 0 < float(fields["mean_abs_err_pct"]) < 25
        assert fields["pairs_agree"].endswith("/14")


def test_timing_must_be_a_known_source(capsys):
    from stage_dse.cli.validate import main

    assert main(["timing=silicon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "stage-dse-validate: error: 'timing=silicon': expected timing=roofline or timing=measured"
    ]


@needs_tables
def test_collectives_across_domains_keep_the_network_part_and_measure_the_domain_part():
    import sympy as sp

    from stage_dse.cost.time import Kernel
    from stage_dse.kernels.timing import kernel_seconds

    tables = load_tables("h100_sxm")
    kernel = Kernel(
        "all_reduce",
        (sp.Symbol("b"), sp.Symbol("n"), sp.Symbol("d"), sp.Symbol("i")),
        sp.Symbol("r"),
    )
    size = 64 * 2**20
    intra_roofline, full_roofline = 0.4e-3, 2.0e-3
    shape_out = np.array(
        [
            [size, 8, 1, intra_roofline, intra_roofline],  # one domain of 8
            [size, 8, 4, intra_roofline, full_roofline],  # 4 domains of 8
            [size, 16, 1, intra_roofline, full_roofline],  # 16 per domain: no table
        ]
    )
    seconds, measured = kernel_seconds([kernel], shape_out, tables)
    table = float(tables.nccl["all_reduce", 8].lookup(size)[0])
    assert seconds[:, 0] == pytest.approx(
        [table, full_roofline - intra_roofline + table, full_roofline]
    )
    assert measured[:, 0].tolist() == [True, False, False]


@needs_tables
def test_remembered_lookups_answer_as_fresh_ones_when_the_roofline_or_tables_change():
    import sympy as sp

    from stage_dse.cost.time import Kernel
    from stage_dse.kernels import timing

    kernels = (
        Kernel("all_reduce", tuple(sp.symbols("b n d i")), sp.Symbol("r")),
        Kernel("gemm", tuple(sp.symbols("m k n g")), sp.Symbol("s"), scale=2),
    )
    rows = np.array(
        [
            [64 * 2**20, 8, 4, 0.4e-3, 2.0e-3, 4096, 8192, 8192, 2, 1e-3],
            [2**20, 8, 1, 0.1e-3, 0.1e-3, 1024, 4096, 4096, 2, 1e-4],
        ]
    )
    moved = rows.copy()
    moved[:, [4, 9]] *= 3  # the roofline seconds (what a fitted efficiency moves)
    for gpu, shape_out in (("h100_sxm", rows), ("h100_sxm", moved), ("a100_sxm", moved)):
        tables = load_tables(gpu)
        timing._MEMO.clear()
        fresh = timing.kernel_seconds(kernels, shape_out, tables)
        again = timing.kernel_seconds(kernels, shape_out.copy(), tables)
        assert timing._MEMO  # the second call was answered from memory
        for a, b in zip(fresh, again):
            assert np.array_equal(a, b)
        fresh[0][:] = 0  # the caller's arrays are its own
        assert timing.kernel_seconds(kernels, shape_out, tables)[0].min() > 0
    h100 = timing.kernel_seconds(kernels, moved, load_tables("h100_sxm"))[0]
    a100 = timing.kernel_seconds(kernels, moved, load_tables("a100_sxm"))[0]
    assert not np.array_equal(h100, a100)
    # across domains the network part follows the roofline, the domain part the table; a
    # GEMM inside its table does not move with the roofline
    before = timing.kernel_seconds(kernels, rows, load_tables("h100_sxm"))[0]
    assert (h100 - before).ravel().tolist() == pytest.approx([2 * 2.0e-3, 0.0, 0.0, 0.0], abs=1e-12)


@needs_tables
def test_tables_are_cached_in_compact_form_and_read_back_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    load_tables.cache_clear()
    first = load_tables("a100_sxm")
    (cached,) = tmp_path.glob("measured-a100_sxm-*.pkl")
    assert cached.stat().st_size < 2e6
    load_tables.cache_clear()
    again = load_tables("a100_sxm")
    assert again is not first and set(again.attention) == set(first.attention)
    for key, grid in first.nccl.items():
        assert np.array_equal(again.nccl[key].seconds, grid.seconds, equal_nan=True)
    cached.write_bytes(b"truncated")  # a damaged copy is read from the package again
    load_tables.cache_clear()
    assert set(load_tables("a100_sxm").gemm) == {"bf16"}
    load_tables.cache_clear()


@needs_tables
def test_measured_kernels_run_at_the_in_step_share_of_their_isolated_speed():
    """measured_efficiency slows the table-timed GEMMs and attention of a training step (the
    roofline ignores it); kernels outside the tables keep their roofline time."""
    from stage_dse.cost.table import evaluate_table
    from stage_dse.search import SearchSpace

    space = SearchSpace(tp=(8,), pp=(1,), sequence_parallel=(False,), zero_stage=(1,))
    table = _table("llama3_8b", "h100_sxm", "dgx_h100", 64, 4096, 256, space).iloc[:1]
    assert table["measured_efficiency"].iloc[0] < 1  # the preset's fitted in-step share
    at = {v: table.assign(measured_efficiency=v) for v in (1.0, 0.5)}
    fast = evaluate_table(at[1.0], timing="measured").iloc[0]
    slow = evaluate_table(at[0.5], timing="measured").iloc[0]
    assert 0.5 < fast["measured_share"] <= 1
    # the measured part of the compute doubles, the rest stays: the growth is that part
    grown = slow["time_compute_s"] / fast["time_compute_s"] - 1
    assert 0.5 < grown < 1
    roof = [evaluate_table(t)["time_step_s"].iloc[0] for t in at.values()]
    assert roof[0] == roof[1]


def test_a_measured_fp8_gemm_is_the_tables_time_which_includes_its_input_quantization():
    """The tables time TensorRT-LLM's Linear, which quantizes its bf16 input before the FP8
    GEMM: a table hit replaces both kernels, and only the fallback adds the quantize kernel
    to the GEMM's roofline."""
    import sympy as sp

    from stage_dse.config import load_model
    from stage_dse.cost.recompute import is_linear
    from stage_dse.cost.time import KernelSet, _gemm_time, _op_time
    from stage_dse.graph import build_graphs
    from stage_dse.graph.ir import OpKind, Phase
    from stage_dse.graph.symbols import S
    from stage_dse.spec import ParallelPlan, TrainingSpec

    training = TrainingSpec(seq_len=4096, global_batch_size=64, gemm_dtype="fp8")
    graphs = build_graphs(load_model("llama3_8b"), ParallelPlan(dp=8), training)
    op = next(
        o
        for o in graphs.block.ops
        if o.kind is OpKind.EINSUM and is_linear(o) and o.phase is Phase.FORWARD
    )
    kernels = KernelSet()
    seconds = _op_time(op, sp.Integer(0), kernels)
    ((kernel, symbol),) = kernels.symbols.items()
    clock = S.sustained_clock * S.measured_efficiency
    tensorwise = {S.fp8_rowwise: 0, S.fp8_wgrad_hp: 0, S.fp8_mx: 0}  # per-tensor scaling
    # the query projection runs inside the fused query-key-value GEMM: its share of that
    # GEMM's table time, (q) / (q + 2 kv) of it
    share = sp.Integer(1) / op.fused_width
    assert op.name == "q_proj" and sp.simplify(share - S.heads / (S.heads + 2 * S.kv_heads)) == 0
    assert sp.simplify(seconds.subs(tensorwise) - share * symbol / clock) == 0
    gemm, quantize = _gemm_time(op)
    assert quantize != 0
    fused = (gemm + quantize) * clock * op.fused_width
    assert sp.simplify(kernel.roofline - fused.subs(tensorwise)) == 0


def test_grouped_expert_gemms_keep_the_roofline_under_measured_timing():
    """The GEMM tables time one (m, n, k) GEMM; a grouped expert GEMM is one per local expert
    (the experts axis is in both operands and the output, not in m, n or k), so a lookup
    would time a single expert's share of it. Training and serving alike keep the roofline
    for them, which times the grouped op as one kernel; dense projections use the tables."""
    from stage_dse.config import load_cluster, load_hardware, load_model
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.cost.kernel_time import table_gemm
    from stage_dse.graph.ir import OpKind
    from stage_dse.graph.transformer import build_graphs
    from stage_dse.spec import ParallelPlan, TrainingSpec

    model = load_model("qwen3_30b_a3b")
    training = TrainingSpec(seq_len=4096, global_batch_size=8)
    plan = ParallelPlan(dp=8, ep=8)
    ops = [op for op in build_graphs(model, plan, training).block.ops if op.kind is OpKind.EINSUM]
    experts = [op for op in ops if op.name.startswith("experts.")]
    assert experts and not any(table_gemm(op) for op in experts)
    assert any(table_gemm(op) for op in ops if op.name.startswith(("q_proj", "o_proj")))
    if data_root() is None:
        return
    # the expert GEMMs are most of this step's flops: timed once per expert by the roofline,
    # the measured step's MFU stays near the roofline's (one expert's time each: +29%)
    hw, cluster = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=8)
    mfu = {
        t: evaluate_plan(model, training, plan, hardware=hw, cluster=cluster, timing=t)["mfu"]
        for t in ("roofline", "measured")
    }
    assert mfu["measured"] == pytest.approx(mfu["roofline"], rel=0.05)
