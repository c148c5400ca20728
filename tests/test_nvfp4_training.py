"""NVFP4 GEMMs in a training step (``training.gemm_dtype=nvfp4``): the kept activations, the
step against MXFP8, the errors that refuse them, serving's NVFP4 left as it was, and their rows
in a results folder (the GEMM and quantize times from first principles:
``tests/test_fp8_recipe.py``, beside the FP8 recipes)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import gpt

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.trace.select import config_from_row

B200 = load_hardware("b200")
CLUSTER = load_cluster("hgx_b200", num_gpus=1)


def step(gemm: str, recipe: str = "tensorwise", seq: int = 2048, batch: int = 2) -> TrainingSpec:
    return TrainingSpec(seq_len=seq, global_batch_size=batch, gemm_dtype=gemm, fp8_recipe=recipe)


def test_nvfp4_keeps_the_column_wise_copy_of_the_inputs_only_linear_layers_keep():
    """Per element a linear layer alone keeps, NVFP4 keeps 0.5625 bytes where FP8 keeps 1 and
    bf16 2; everything else (weights, optimizer, the other activations) is the same."""
    model = gpt(layers=4, hidden=1024, heads=16)
    plan = ParallelPlan(dp=1, micro_batch_size=2)
    got = {
        g: evaluate_plan(model, step(g), plan, hardware=B200, cluster=CLUSTER)
        for g in ("bf16", "fp8", "nvfp4")
    }
    act = {g: r["mem_activations_bytes"] for g, r in got.items()}
    per_byte = act["bf16"] - act["fp8"]  # elements kept by linear layers only, times 1 byte
    assert per_byte > 0
    assert act["fp8"] - act["nvfp4"] == pytest.approx(per_byte * (1 - 0.5625), rel=1e-12)
    for k in ("params", "model_flops", "mem_weights_bytes", "mem_optimizer_bytes"):
        assert got["bf16"][k] == got["fp8"][k] == got["nvfp4"][k]


def test_nvfp4_speeds_up_a_gemm_bound_step_over_mxfp8_and_reports_mfu_against_fp4():
    """Llama 3 70B layers at 8k tokens a micro-batch on B200 are GEMM-bound: NVFP4 beats
    MXFP8 (twice the dense peak, less quantize traffic) without reaching half its time, and
    MFU is taken against the FP4 peak."""
    model = load_model("llama3_70b")
    plan = ParallelPlan(dp=1, tp=8, sequence_parallel=True, micro_batch_size=1, pp=1)
    cl = load_cluster("hgx_b200", num_gpus=8)
    model = dataclasses.replace(model, num_layers=4)
    fp8 = evaluate_plan(model, step("fp8", "mxfp8", 8192, 8), plan, hardware=B200, cluster=cl)
    fp4 = evaluate_plan(model, step("nvfp4", seq=8192, batch=8), plan, hardware=B200, cluster=cl)
    assert fp8["step_s"] / 2 < fp4["step_s"] < fp8["step_s"]
    per_gpu = fp4["model_flops"] / (fp4["step_s"] * 8)
    assert fp4["mfu"] == pytest.approx(per_gpu / B200.peak_fp4_flops, rel=1e-12)


def test_nvfp4_training_needs_fp4_tensor_cores_and_no_fp8_recipe():
    h100, cl = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=8)
    with pytest.raises(ConfigError, match="gemm_dtype=nvfp4 needs FP4 tensor cores; hardware h100"):
        evaluate_plan(gpt(), step("nvfp4", batch=64), ParallelPlan(dp=8), hardware=h100, cluster=cl)
    with pytest.raises(ConfigError, match="mxfp8 scales FP8 GEMMs, but gemm_dtype=nvfp4"):
        step("nvfp4", "mxfp8")
    with pytest.raises(ConfigError, match=r"training\.gemm_dtype='mxfp4' is not one of"):
        step("mxfp4")


def test_serving_nvfp4_binds_no_training_copies():
    """A serving pass quantizes activations for its forward GEMMs only: its NVFP4 rows bind
    no column-wise copy (``fp8_mx`` 0), as before training could use the format."""
    from stage_dse.runner.serving import serving_row
    from stage_dse.spec.serving import ServingSpec

    serving = ServingSpec(prompt_len=1024, output_tokens=64, batch_size=4, weights_dtype="nvfp4")
    row, _ = serving_row(load_model("llama3_8b"), serving, B200, CLUSTER, 1)
    assert row["gemm_bytes"] == 0.5625 and row["fp8_mx"] == 0


def test_nvfp4_rows_are_their_own_configurations_found_and_rebuilt(tmp_path):
    """A sweep's NVFP4 rows hash apart from its FP8 (MXFP8) and bf16 rows, a run finds its own
    rows by format, and a trace rebuilds an NVFP4 row's step: gemm_dtype nvfp4, no FP8
    recipe (the block flag is the format's)."""
    from stage_dse.results import ResultStore, load
    from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
    from stage_dse.runner.sweep import rows_of_run
    from stage_dse.search import SearchSpace

    formats = (("bf16", "tensorwise"), ("fp8", "mxfp8"), ("nvfp4", "tensorwise"))

    def spec(gemm: str, recipe: str) -> SweepSpec:
        return SweepSpec(
            name="formats",
            models=(gpt(layers=4, hidden=1024, heads=16),),
            training=step(gemm, recipe, batch=32),
            hardware=(B200,),
            cluster=load_cluster("hgx_b200"),
            gpu_counts=(8,),
            space=SearchSpace(micro_batch_size=(1, 2), zero_stage=(1,)),
        )

    store = ResultStore(tmp_path / "formats")
    for gemm, recipe in formats:
        run_grid(spec(gemm, recipe), LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert df["config_hash"].is_unique and len(df) % len(formats) == 0
    for gemm, recipe in formats:
        mine = rows_of_run(df, "training", ["gpt_test"], ["b200"], "hgx_b200",
                           training=step(gemm, recipe, batch=32))  # fmt: skip
        assert len(mine) == len(df) // len(formats)
        rebuilt = config_from_row(mine.iloc[0]).training
        assert (rebuilt.gemm_dtype.value, rebuilt.fp8_recipe.value) == (gemm, recipe)
    ok = df[df.status == "ok"]
    assert ok.groupby("gemm_bytes")["step_s"].mean().nunique() == len(formats)
