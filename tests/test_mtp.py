"""Multi-token prediction modules (DeepSeek-V3 sec. 2.2, Megatron-Core ``mtp_num_layers``):
one more layer of the model's kind and one more pass through the shared output layer, on the
last pipeline stage."""

from __future__ import annotations

import dataclasses

import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan as _evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.validation.corpus import Case, Source
from stage_dse.validation.resolve import case_model

TRAINING = TrainingSpec(seq_len=1024, global_batch_size=16)
H100, DGX = load_hardware("h100_sxm"), load_cluster("dgx_h100")


def evaluate_plan(model, training, plan):
    return _evaluate_plan(model, training, plan, hardware=H100, cluster=DGX)


def _model(mtp: int = 0, layers: int = 8) -> ModelSpec:
    return dataclasses.replace(load_model("llama3_8b"), num_layers=layers, mtp_layers=mtp)


def _moe(mtp: int = 0) -> ModelSpec:
    return dataclasses.replace(
        load_model("deepseek_v3"), num_layers=8, first_dense_layers=1, mtp_layers=mtp
    )


def test_mtp_adds_a_layer_of_parameters_and_no_head():
    plain, mtp, deeper = (evaluate_plan(m, TRAINING, ParallelPlan()) for m in
                          (_model(0), _model(1), _model(0, layers=9)))  # fmt: skip
    assert mtp["params"] == pytest.approx(deeper["params"], rel=1e-12)
    assert mtp["params_head"] == plain["params_head"]
    assert mtp["params_embedding"] == plain["params_embedding"]


def test_mtp_model_flops_are_one_layer_and_one_output_layer_more():
    plain, mtp, deeper = (evaluate_plan(m, TRAINING, ParallelPlan()) for m in
                          (_model(0), _model(1), _model(0, layers=9)))  # fmt: skip
    model = _model(0)
    # the output layer's forward GEMM, 2 b s h V over the step's tokens, times 3 (fwd + bwd)
    head = 3 * 2 * TRAINING.global_batch_size * TRAINING.seq_len * model.hidden_size
    head *= model.vocab_size
    layer = deeper["model_flops"] - plain["model_flops"]
    assert mtp["model_flops"] - plain["model_flops"] == pytest.approx(layer + head, rel=1e-9)


def test_mtp_sits_on_the_last_pipeline_stage():
    plan = ParallelPlan(pp=2, micro_batch_size=1)
    plain, mtp = (evaluate_plan(m, TRAINING, plan) for m in (_moe(0), _moe(1)))
    assert mtp["stage_first_flops"] == plain["stage_first_flops"]
    assert mtp["stage_last_flops"] > plain["stage_last_flops"]
    assert mtp["mem_first_stage_total"] == plain["mem_first_stage_total"]
    assert mtp["mem_last_stage_total"] > plain["mem_last_stage_total"]
    # the pipeline runs at its slowest stage's pace: the step can only get longer
    assert mtp["step_s"] > plain["step_s"]


def test_mtp_on_one_stage_lengthens_the_step_and_updates_the_head_once():
    plan = ParallelPlan(micro_batch_size=1)
    plain, mtp = (evaluate_plan(m, TRAINING, plan) for m in (_moe(0), _moe(1)))
    assert mtp["step_s"] > plain["step_s"]
    assert mtp["stage_first_flops"] > plain["stage_first_flops"]
    # no second optimizer step or gradient sync for the shared output layer
    assert mtp["optimizer_s"] == pytest.approx(
        plain["optimizer_s"] * mtp["params"] / plain["params"], rel=0.05
    )


def test_mtp_layers_must_be_a_non_negative_integer():
    with pytest.raises(ConfigError, match="mtp_layers"):
        _model(-1)


def test_traces_refuse_mtp_with_the_fix():
    from stage_dse.trace.build import TraceConfig

    with pytest.raises(ConfigError, match=r"model\.mtp_layers=1: traces .* mtp_layers=0"):
        TraceConfig(_model(1), TRAINING, ParallelPlan(), H100, DGX)


def test_a_record_changes_fields_of_a_preset():
    source = Source(id="s", citation="c", kind="training", file="f.yaml")
    case = Case(
        id="r",
        source=source,
        kind="training",
        fields={"model": {"preset": "deepseek_v3", "mtp_layers": 1}},
        target_kind="iter_s",
        value=1.0,
    )
    got = case_model(case)
    assert got == dataclasses.replace(load_model("deepseek_v3"), mtp_layers=1)
