"""FP8 scaling recipes (``training.fp8_recipe``): per-tensor, row-wise (torchao), row-wise with
16-bit weight gradients, and MXFP8 block scales; their GEMM speeds (NVFP4's beside them), added
kernels, kept activations, the errors that refuse them, and their rows in a results folder."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import gpt
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware
from stage_dse.cost.bind import bind, bind_hardware, evaluate_plan
from stage_dse.cost.derive import cost_key
from stage_dse.cost.recompute import is_linear
from stage_dse.cost.time import _fp8_quantized_numel, section_time
from stage_dse.errors import ConfigError
from stage_dse.graph import OpKind, build_graphs
from stage_dse.graph.ir import Phase, Role
from stage_dse.graph.symbols import Symbols
from stage_dse.results import ResultStore, load
from stage_dse.results.schema import FP8_RECIPE_COLUMNS, config_hash
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.runner.sweep import rows_of_run
from stage_dse.search import SearchSpace
from stage_dse.spec import DType, ParallelPlan, TrainingSpec
from stage_dse.trace.select import config_from_row

H100 = load_hardware("h100_sxm")
B200 = load_hardware("b200")
RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8")


def step(recipe: str = "tensorwise", gemm: str = "fp8", **kw) -> TrainingSpec:
    return TrainingSpec(
        seq_len=kw.get("seq", 2048),
        global_batch_size=kw.get("batch", 2),
        gemm_dtype=gemm,
        fp8_recipe=recipe if gemm == "fp8" else "tensorwise",
    )


@pytest.mark.parametrize("recipe", (*RECIPES, "nvfp4"))
def test_each_recipe_times_the_linear_gemms_from_first_principles(recipe):
    """A compute-bound layer (no shape dependence, no launch cost or floors) on a Blackwell
    part, GEMM by GEMM: FP8 flops at the FP8 peak, divided by the recipe's kernel speed where
    it applies (MXFP8: every GEMM; row-wise: the forward ones, the backward ones run the
    per-tensor kernel); 16-bit weight gradients under rowwise_gw_hp; the quantize kernels of
    per-tensor scaling (3 bytes per element; MXFP8 writes a second copy: 4); under row-wise
    scales a rescale pass over every backward FP8 GEMM's output (4 bytes per element) and
    quantize passes for the weight (input gradient) and both operands (weight gradient).
    ``nvfp4`` (``training.gemm_dtype=nvfp4``): FP4 flops at the FP4 peak, its quantize kernels
    writing the row-wise and column-wise NVFP4 copies (2 + 2 x 0.5625 bytes per element); the
    step share applies to FP8 and FP4 alike (0.8 here)."""
    model = gpt(layers=4, hidden=8192, heads=64)
    plan = ParallelPlan(dp=1, micro_batch_size=1)
    hw = dataclasses.replace(
        B200,
        gemm_half_dim=1e-9,
        fp8_gemm_half_dim=1e-9,
        fp4_gemm_half_dim=1e-9,
        kernel_launch_s=0.0,
        elementwise_floor_s=0.0,
        rowwise_gemm_speed=0.6,
        mxfp8_gemm_speed=0.85,
        fp8_step_efficiency=0.8,
    )
    training = step(gemm="nvfp4") if recipe == "nvfp4" else step(recipe)
    cluster = load_cluster("hgx_b200", num_gpus=1)
    values = {**bind(model, training, plan), **bind_hardware(hw, cluster)}
    if recipe == "nvfp4":  # block scales: the MX flag; NVFP4's bytes, block scales included
        assert values["fp8_mx"] == 1 and values["gemm_bytes"] == DType.NVFP4.bytes == 0.5625
    symbols = Symbols.all()

    def num(expr) -> float:
        return float(expr.xreplace({symbols[k]: v for k, v in values.items()}))

    graph = build_graphs(model, plan, training).block
    got = num(section_time(graph, cost_key(model, plan, training)).gemm)
    bandwidth = hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency
    # the FP8 tables' efficiency at the share a training step reaches of it
    fp8_rate = hw.peak_fp8_flops * hw.sustained_clock * hw.fp8_gemm_efficiency
    fp8_rate *= hw.fp8_step_efficiency
    if recipe == "nvfp4":  # FP4 tensor cores, the same share of their tables' figure
        fp8_rate = hw.peak_fp4_flops * hw.sustained_clock * hw.fp4_gemm_efficiency
        fp8_rate *= hw.fp8_step_efficiency
    bf16_rate = hw.peak_flops * hw.sustained_clock * hw.gemm_efficiency
    rowwise = recipe in ("rowwise", "rowwise_gw_hp")
    quantize_bytes = {"mxfp8": 4, "nvfp4": 2 + 2 * 0.5625}.get(recipe, 3)
    expected = 0.0
    linear = [op for op in graph.ops if op.kind is OpKind.EINSUM and is_linear(op)]
    assert {op.phase for op in linear} == {Phase.FORWARD, Phase.BACKWARD}
    for op in linear:
        flops = num(op.flops)
        out = op.outputs[0]
        wgrad = out.role is Role.GRAD
        if wgrad and recipe == "rowwise_gw_hp":
            expected += flops / bf16_rate
            continue
        speed = {"mxfp8": hw.mxfp8_gemm_speed}.get(recipe, 1.0)
        if rowwise and op.phase is Phase.FORWARD:
            speed = hw.rowwise_gemm_speed
        expected += flops / (fp8_rate * speed)
        expected += quantize_bytes * num(_fp8_quantized_numel(op)) / bandwidth
        if rowwise and op.phase is Phase.BACKWARD:
            expected += 4 * num(out.local_numel) / bandwidth
            requantized = op.inputs if wgrad else [t for t in op.inputs if t.role is Role.WEIGHT]
            expected += sum(3 * num(t.local_numel) / bandwidth for t in requantized)
    assert got == pytest.approx(expected, rel=1e-9)


def test_row_wise_scales_keep_16_bit_inputs_and_mx_scales_one_copy():
    """Row-wise scaling keeps the 16-bit input of each linear layer (its FP8 copy is scaled
    along the wrong axis for the weight gradient): the activations of a bf16 step. MXFP8 keeps
    the column-wise copy only, the bytes of per-tensor FP8."""
    model = gpt(layers=4, hidden=1024, heads=16)
    plan = ParallelPlan(dp=1, micro_batch_size=2)
    cl = load_cluster("hgx_b200", num_gpus=1)
    got = {
        r: evaluate_plan(model, step(r), plan, hardware=B200, cluster=cl)["mem_activations_bytes"]
        for r in RECIPES
    }
    bf16 = evaluate_plan(model, step(gemm="bf16"), plan, hardware=B200, cluster=cl)
    assert got["tensorwise"] < bf16["mem_activations_bytes"]
    assert got["rowwise"] == got["rowwise_gw_hp"] == bf16["mem_activations_bytes"]
    assert got["mxfp8"] == got["tensorwise"]


@settings(max_examples=10, deadline=None)
@given(row=st.floats(0.5, 1.0), mx=st.floats(0.8, 1.0), micro=st.sampled_from([1, 2, 4]))
def test_no_recipe_is_faster_than_per_tensor_scaling(row, mx, micro):
    """Every recipe adds work to per-tensor scaling or runs a slower kernel, never less (a
    16-bit weight gradient is slower than an FP8 one on these shapes)."""
    hw = dataclasses.replace(B200, rowwise_gemm_speed=row, mxfp8_gemm_speed=mx)
    model = gpt(layers=4, hidden=4096, heads=32)
    plan = ParallelPlan(dp=8, micro_batch_size=micro)
    cl = load_cluster("hgx_b200", num_gpus=8)

    def step_s(recipe: str) -> float:
        training = step(recipe, seq=4096, batch=32)
        return evaluate_plan(model, training, plan, hardware=hw, cluster=cl)["step_s"]

    base = step_s("tensorwise")
    for recipe in RECIPES[1:]:
        assert step_s(recipe) >= base


def test_measured_kernels_take_the_recipe_on_top_of_the_tables():
    """timing=measured looks a GEMM up in the per-tensor FP8 table and applies the recipe's
    kernel speed and added kernels on top: row-wise costs more than per-tensor there too."""
    pytest.importorskip("pyarrow")
    model = gpt(layers=4, hidden=4096, heads=32)
    plan = ParallelPlan(dp=8, micro_batch_size=1)
    cl = load_cluster("dgx_h100", num_gpus=8)
    r = {
        recipe: evaluate_plan(
            model, step(recipe, seq=4096, batch=16), plan, hardware=H100, cluster=cl,
            timing="measured",
        )["step_s"]
        for recipe in ("tensorwise", "rowwise")
    }  # fmt: skip
    assert r["rowwise"] > r["tensorwise"]


def test_recipes_are_refused_where_they_cannot_run():
    with pytest.raises(ConfigError, match=r"fp8_recipe=rowwise scales FP8 GEMMs, but gemm_dtype"):
        TrainingSpec(seq_len=2048, global_batch_size=8, fp8_recipe="rowwise")
    with pytest.raises(ConfigError, match=r"training\.fp8_recipe='blockwise' is not one of"):
        TrainingSpec(seq_len=2048, global_batch_size=8, gemm_dtype="fp8", fp8_recipe="blockwise")
    with pytest.raises(ConfigError, match=r"fp8_recipe=mxfp8 needs block-scaled .* h100_sxm"):
        evaluate_plan(
            gpt(), step("mxfp8", batch=8), ParallelPlan(dp=8), hardware=H100,
            cluster=load_cluster("dgx_h100", num_gpus=8),
        )  # fmt: skip


def test_recipe_rows_are_distinct_and_per_tensor_rows_keep_their_hashes(tmp_path):
    def spec(recipe: str) -> SweepSpec:
        return SweepSpec(
            name="recipes",
            models=(gpt(layers=4, hidden=1024, heads=16),),
            training=step(recipe, batch=32),
            hardware=(B200,),
            cluster=load_cluster("hgx_b200"),
            gpu_counts=(8,),
            space=SearchSpace(micro_batch_size=(1, 2), zero_stage=(1,)),
        )

    store = ResultStore(tmp_path / "recipes")
    for recipe in RECIPES:
        run_grid(spec(recipe), LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert df["config_hash"].is_unique and len(df) % len(RECIPES) == 0
    # a per-tensor row hashes as it did before recipes existed (the columns absent)
    tensorwise = df[(df[list(FP8_RECIPE_COLUMNS)] == 0).all(axis=1)]
    assert len(tensorwise) == len(df) // len(RECIPES)
    before = config_hash(tensorwise.drop(columns=list(FP8_RECIPE_COLUMNS)))
    assert (before.to_numpy() == tensorwise["config_hash"].to_numpy()).all()
    # a run's own rows are found by its recipe
    for recipe in RECIPES:
        training = step(recipe, batch=32)
        mine = rows_of_run(df, "training", ["gpt_test"], ["b200"], "hgx_b200", training=training)
        assert len(mine) == len(tensorwise)
        assert mine["config_hash"].isin(df["config_hash"]).all()
        # and a trace of one of them is built for the same recipe and kernel speeds
        config = config_from_row(mine.iloc[0])
        assert config.training.fp8_recipe.value == recipe
        assert config.hardware.rowwise_gemm_speed == B200.rowwise_gemm_speed
        assert config.hardware.mxfp8_gemm_speed == B200.mxfp8_gemm_speed
    ok = df[df.status == "ok"]
    by = ok.groupby(["fp8_rowwise", "fp8_wgrad_hp", "fp8_mx"])["step_s"].mean()
    assert by.nunique() == len(RECIPES)
