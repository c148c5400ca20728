"""DeepSeek-V3's DualPipe schedule (report sec. 3.2.1, Table 2): rank i holds stages i and
pp - 1 - i, the bubble is (pp/2 - 1)(F&B + B - 3W), pp + 1 micro-batches in flight; and
zero-bubble ZB-H1 (Qi et al. 2024): (pp - 1)(F + B - 2W) at 1F1B's memory."""

from __future__ import annotations

import dataclasses

import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan as _evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.spec.plan import validate_plan
from stage_dse.trace.build import TraceConfig

TRAINING = TrainingSpec(seq_len=2048, global_batch_size=64)
H100 = load_hardware("h100_sxm")
# untied: the embedding and the output layer hold the same number of weights, so the first
# and last 1F1B stages weigh the same
MODEL = dataclasses.replace(load_model("llama3_8b"), num_layers=16, tied_embeddings=False)


def evaluate(plan: ParallelPlan, model=MODEL, training=TRAINING) -> dict:
    cluster = load_cluster("dgx_h100", num_gpus=plan.num_gpus)
    return _evaluate_plan(model, training, plan, hardware=H100, cluster=cluster)


def plans(pp: int, **kw) -> tuple[ParallelPlan, ParallelPlan]:
    base = ParallelPlan(dp=2, pp=pp, micro_batch_size=1, **kw)
    return base, dataclasses.replace(base, schedule="dualpipe")


def test_two_stages_leave_no_bubble():
    one, dual = (evaluate(p) for p in plans(2))
    assert one["bubble_s"] > 0
    assert dual["bubble_s"] == 0


@pytest.mark.parametrize("pp", [4, 8])
def test_the_bubble_is_a_fraction_of_1f1bs(pp):
    one, dual = (evaluate(p) for p in plans(pp))
    # 1F1B: (pp - 1)(F + B); DualPipe: (pp/2 - 1)(F + 2B - 3W) with W <= B / 2 of the
    # linear layers, so at most (pp/2 - 1) 2 (F + B) and above (pp/2 - 1)(F + B / 2)
    assert dual["bubble_s"] < one["bubble_s"] * (pp / 2 - 1) * 2 / (pp - 1)
    assert dual["bubble_s"] > one["bubble_s"] * (pp / 2 - 1) / (2 * (pp - 1))
    assert dual["step_s"] < one["step_s"]


def test_each_rank_holds_two_stages_of_parameters():
    one, dual = (evaluate(p) for p in plans(4))
    for col in ("mem_weights_bytes", "mem_grads_bytes", "mem_optimizer_bytes"):
        assert dual[col] == pytest.approx(2 * one[col], rel=1e-3), col
    # and updates both: twice the optimizer's streaming
    assert dual["optimizer_s"] == pytest.approx(2 * one["optimizer_s"], rel=1e-3)


def test_pp_plus_one_micro_batches_of_activations_are_in_flight():
    small_vocab = dataclasses.replace(MODEL, vocab_size=1024)  # the logits kept are negligible
    one, dual = (evaluate(p, small_vocab) for p in plans(2))
    # 1F1B's first stage keeps pp = 2 micro-batches of one stage; a DualPipe rank keeps
    # pp + 1 = 3 stage-micro-batches over its two stages
    assert dual["mem_activations_bytes"] == pytest.approx(
        1.5 * one["mem_activations_bytes"], rel=0.01
    )


def test_the_schedule_needs_even_stages_and_micro_batches():
    with pytest.raises(ConfigError, match=r"dualpipe needs an even pp .* got pp\(3\)"):
        ParallelPlan(pp=3, schedule="dualpipe")
    plan = ParallelPlan(dp=2, pp=2, micro_batch_size=1, schedule="dualpipe")
    odd = TrainingSpec(seq_len=2048, global_batch_size=6)  # 3 micro-batches per replica
    with pytest.raises(ConfigError, match=r"num_microbatches\(3\) is odd"):
        validate_plan(MODEL, odd, plan)


def test_traces_refuse_the_schedule_with_the_fix():
    plan = ParallelPlan(dp=2, pp=2, micro_batch_size=1, schedule="dualpipe")
    with pytest.raises(ConfigError, match="schedule=dualpipe: traces carry"):
        TraceConfig(MODEL, TRAINING, plan, H100, load_cluster("dgx_h100", num_gpus=8))


def test_a_table_of_dualpipe_plans_matches_the_per_plan_answers():
    from stage_dse.cost.table import evaluate_plans, plans_table

    cluster = load_cluster("dgx_h100", num_gpus=16)
    plans = [ParallelPlan(dp=16 // pp, pp=pp, micro_batch_size=1, schedule=s)
             for pp in (2, 4) for s in ("1f1b", "dualpipe")]  # fmt: skip
    table = evaluate_plans(plans_table(MODEL, TRAINING, plans, H100, cluster))
    for i, plan in enumerate(plans):
        one = _evaluate_plan(MODEL, TRAINING, plan, hardware=H100, cluster=cluster)
        for col in ("step_s", "bubble_s", "mem_total_bytes"):
            assert table[col].iloc[i] == pytest.approx(one[col], rel=1e-9), (plan.schedule, col)


def test_a_sweep_ranges_over_schedules_and_names_the_plans_it_rejects():
    from stage_dse.search.space import enumerate_plans
    from stage_dse.spec.sweep import SearchSpace

    space = SearchSpace(tp=(1,), pp=(1, 2, 4), cp=(1,), ep=(1,), schedule=("1f1b", "dualpipe"),
                        micro_batch_size=(1,), zero_stage=(1,), recompute=("none",),
                        sequence_parallel=(False,))  # fmt: skip
    cluster = load_cluster("dgx_h100", num_gpus=16)
    found = enumerate_plans(MODEL, TRAINING, H100, cluster, space)
    assert found.rejected["dualpipe needs an even pp"] == 1  # pp 1
    schedules = found.table.groupby("pp")["schedule"].apply(lambda s: sorted(set(map(str, s))))
    assert schedules.to_dict() == {1: ["1f1b"], 2: ["1f1b", "dualpipe"], 4: ["1f1b", "dualpipe"]}


def test_zero_bubble_fills_the_1f1b_bubble_with_weight_gradients_at_the_same_memory():
    base = ParallelPlan(dp=2, pp=4, micro_batch_size=1)
    one, zb = evaluate(base), evaluate(dataclasses.replace(base, schedule="zb1p"))
    # the bubble loses twice the weight-gradient GEMMs per stage: at most 2/3 of the
    # backward's share, so it stays above a third of 1F1B's; nothing else moves
    assert one["bubble_s"] / 3 < zb["bubble_s"] < one["bubble_s"]
    assert one["step_s"] - zb["step_s"] == pytest.approx(one["bubble_s"] - zb["bubble_s"])
    for col in ("mem_total_bytes", "compute_s", "dp_comm_s", "optimizer_s"):
        assert zb[col] == pytest.approx(one[col], rel=1e-12), col


def test_a_sweep_rejects_zero_bubble_with_chunked_stages():
    from stage_dse.search.space import enumerate_plans
    from stage_dse.spec.sweep import SearchSpace

    space = SearchSpace(tp=(1,), pp=(2,), cp=(1,), ep=(1,), schedule=("1f1b", "zb1p"),
                        virtual_stages=(1, 2), micro_batch_size=(1,), zero_stage=(1,),
                        recompute=("none",), sequence_parallel=(False,))  # fmt: skip
    cluster = load_cluster("dgx_h100", num_gpus=16)
    found = enumerate_plans(MODEL, TRAINING, H100, cluster, space)
    assert found.rejected["zb1p and dualpipe run one chunk per stage (virtual_stages=1)"] == 1
    assert sorted(map(str, found.table["schedule"])) == ["1f1b", "interleaved", "zb1p"]


def test_an_unknown_schedule_in_a_sweep_is_named():
    from stage_dse.spec.sweep import SearchSpace

    with pytest.raises(ConfigError, match=r"plan.schedule=\['gpipe'\]: list one or more of"):
        SearchSpace(schedule=("gpipe",))
