"""The validation corpus: its files' schema, the flop conventions, the harness, the fit, and the
guard on every group's recorded error."""

from __future__ import annotations

import dataclasses
import textwrap

import numpy as np
import pandas as pd
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.kernels.tables import data_root
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.validation.conventions import flops_per_step
from stage_dse.validation.corpus import CorpusError, load_corpus, read_file
from stage_dse.validation.fit import Parameter, Problem, fit, leave_one_source_out, loss
from stage_dse.validation.report import group_summary, ranking_pairs
from stage_dse.validation.resolve import Unexpressible
from stage_dse.validation.serving import VARIANT, evaluate_serving, prepare
from stage_dse.validation.training import training_setup

CASES = load_corpus()


# ------------------------------------------------------------------------------ the files
def test_corpus_is_large_and_cites_every_figure():
    training = [c for c in CASES if c.kind == "training"]
    serving = [c for c in CASES if c.kind == "serving"]
    assert len(training) >= 60 and len(serving) >= 100
    sources = {c.source.id for c in CASES}
    assert len(sources) >= 12
    for c in CASES:
        assert c.source.citation and (c.source.url or c.source.commit)
        assert c.fields["where"], c.id


def test_every_training_case_resolves_or_names_what_is_missing():
    for case in (c for c in CASES if c.kind == "training"):
        try:
            setup = training_setup(case)
        except Unexpressible as exc:
            assert str(exc), case.id
            continue
        assert setup.plans or setup.rejected, case.id


def test_every_serving_case_resolves_or_names_what_is_missing():
    serving = [c for c in CASES if c.kind == "serving"]
    prepared = prepare(serving)
    resolved = {cid.split(VARIANT)[0] for cid in prepared.index}
    assert resolved.isdisjoint(prepared.unexpressible)
    assert len(resolved) + len(prepared.unexpressible) == len(serving)
    assert all(prepared.unexpressible.values())
    # an unstated KV-cache dtype beside quantized weights ranges over bf16 and fp8
    for cid, variants in prepared.variants.items():
        assert {v.fields["kv"] for v in variants} == {"bf16", "fp8"}, cid


def test_the_figures_of_one_run_take_one_variant():
    """A run whose KV-cache dtype is unstated is the variant it serves fastest, for its
    throughput and its latencies alike: where FP8 cache buys throughput with a bigger batch
    (a slower step), the TPOT printed beside that throughput is the FP8 run's too."""
    stem = "gpustack_gptoss120b_h100_vllm_tp1_rand2000_100_"
    pair = [c for c in CASES if c.id in (stem + "total_tok_s", stem + "tpot_ms")]
    assert len(pair) == 2
    unstated = [
        dataclasses.replace(
            c,
            fields={k: v for k, v in c.fields.items() if k != "kv"},
            unstated=(*c.unstated, "kv"),
        )
        for c in pair
    ]

    def stated(kv):
        cases = [dataclasses.replace(c, fields={**c.fields, "kv": kv}) for c in pair]
        return evaluate_serving(cases).set_index("case")["predicted"]

    bf16, fp8 = stated("bf16"), stated("fp8")
    faster, other = (
        (fp8, bf16) if fp8[stem + "total_tok_s"] > bf16[stem + "total_tok_s"] else (bf16, fp8)
    )
    # the case this test is for: the faster variant has the slower TPOT
    assert faster[stem + "tpot_ms"] > other[stem + "tpot_ms"]
    got = evaluate_serving(unstated).set_index("case")["predicted"]
    assert got.to_dict() == pytest.approx(faster.to_dict(), rel=1e-12)


GOOD = """\
source: {id: test_src, citation: "A paper, Table 9", url: "https://example.org", kind: training}
defaults: {framework: megatron_core, hardware: h100_sxm, cluster: dgx_h100, seq_len: 4096}
runs:
  - {id: t1, where: "Table 9 row 1", model: llama3_8b, gpus: 8, tp: 1, pp: 1, global_batch: 64,
     micro_batch: 2, recompute: none, zero: 1, target: {kind: iter_s, value: 2.5}}
"""


def _write(tmp_path, text, name="bad.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_good_file_loads(tmp_path):
    (case,) = read_file(_write(tmp_path, GOOD))
    assert case.group == "test_src/iter_s" and case.value == 2.5
    assert case.fields["framework"] == "megatron_core"  # from defaults


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("micro_batch: 2,", "micro_batch: 2, colour: red,"), "unknown field 'colour'"),
        (("gpus: 8,", ""), "missing field 'gpus'"),
        (("kind: iter_s", "kind: seconds"), "target.kind='seconds' is not one of: iter_s"),
        (("value: 2.5", "value: -1"), "target.value must be a number > 0, got -1"),
        (("tp: 1,", "tp: one,"), "tp must be int, got 'one'"),
        (('citation: "A paper, Table 9", ', ""), "source.citation is missing"),
        (('url: "https://example.org", ', ""), "source needs a url (paper) or a commit"),
        (
            ("kind: iter_s, value: 2.5", "kind: tflops_per_gpu, value: 300"),
            "target.flops is missing: say how the source counts flops",
        ),
        (
            ("kind: iter_s, value: 2.5", "kind: mfu_pct, value: 40, flops: {attention: half}"),
            "target.flops.attention='half' is not one of: none, full, causal",
        ),
        (
            ("micro_batch: 2,", "micro_batch: 2, candidates: {recompute: [none, full]},"),
            "candidates.recompute given but recompute is stated",
        ),
        (("runs:", "runs: [oops]\nextra:"), "unknown top-level key 'extra'"),
        (
            ("micro_batch: 2,", "micro_batch: 2, hardware_overrides: {name: mi325x},"),
            "hardware_overrides cannot rename the preset",
        ),
    ],
)
def test_bad_records_give_one_line_naming_file_run_and_field(tmp_path, edit, message):
    old, new = edit
    assert old in GOOD
    with pytest.raises(CorpusError) as info:
        read_file(_write(tmp_path, GOOD.replace(old, new, 1)))
    text = str(info.value)
    assert message in text and "\n" not in text
    assert text.startswith("bad.yaml")


def test_not_yaml_names_the_line(tmp_path):
    with pytest.raises(CorpusError, match=r"bad.yaml: line \d+ not valid YAML"):
        read_file(_write(tmp_path, "source: {id: x\nruns: [\n"))


def test_duplicate_ids_and_sources_are_refused(tmp_path):
    _write(tmp_path, GOOD, "a.yaml")
    _write(tmp_path, GOOD, "b.yaml")
    with pytest.raises(CorpusError, match=r"b\.yaml: run t1: id already used in a\.yaml"):
        load_corpus("training", tmp_path)


def test_user_records_join_the_corpus(tmp_path):
    _write(tmp_path, GOOD, "mine.yaml")
    cases = load_corpus("training", tmp_path)
    assert cases[-1].id == "t1" and len(cases) == 1 + len(
        [c for c in CASES if c.kind == "training"]
    )


# ---------------------------------------------------------------------- flop conventions
def test_narayanan_eq3_is_the_full_recompute_convention():
    """F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) (Narayanan et al. SC21 eq. 3)."""
    m = load_model("gpt3_175b")
    B, s, n, h, V = 1536, 2048, m.num_layers, m.hidden_size, m.vocab_size
    eq3 = 96 * B * s * n * h**2 * (1 + s / (6 * h) + V / (16 * n * h))
    conv = {"attention": "full", "recompute": "full", "logits": True}
    assert flops_per_step(m, s, B, conv) == pytest.approx(eq3, rel=1e-12)
    no_recompute = {"attention": "full", "recompute": "none", "logits": True}
    eq3_72 = 72 * B * s * n * h**2 * (1 + s / (6 * h) + V / (12 * n * h))
    assert flops_per_step(m, s, B, no_recompute) == pytest.approx(eq3_72, rel=1e-12)


@pytest.mark.parametrize("name", ["llama3_8b", "mixtral_8x7b", "deepseek_v3"])
def test_model_flops_convention_equals_the_graphs_matmul_flops(name):
    """Full attention, no recompute, logits counted: three forward passes of every matmul the
    symbolic graph records (GQA, SwiGLU, routed + shared experts, latent attention)."""
    m = load_model(name)
    training = TrainingSpec(seq_len=4096, global_batch_size=8)
    r = evaluate_plan(m, training, ParallelPlan(dp=8, micro_batch_size=1, ep=8 if m.is_moe else 1))
    conv = {"attention": "full", "recompute": "none", "logits": True}
    assert flops_per_step(m, 4096, 8, conv) == pytest.approx(r["model_flops"], rel=2e-3)
    causal = {**conv, "attention": "causal"}
    assert flops_per_step(m, 4096, 8, causal) < flops_per_step(m, 4096, 8, conv)


# -------------------------------------------------------------------------- the harness
def test_rankings_count_only_distinct_published_pairs():
    res = pd.DataFrame(
        {
            "case": ["a", "b", "c"],
            "status": ["ok"] * 3,
            "source": ["s"] * 3,
            "framework_version": ["r1"] * 3,
            "group": ["s/iter_s"] * 3,
            "kind": ["iter_s"] * 3,
            "model": ["m"] * 3,
            "hardware": ["h"] * 3,
            "num_gpus": [8] * 3,
            "workload": ["w"] * 3,
            "plan": ["p1", "p2", "p3"],
            "published": [10.0, 12.0, 10.1],  # a vs c: a tie (1%)
            "predicted": [11.0, 9.0, 11.5],
            "err_pct": [10.0, -25.0, 13.9],
        }
    )
    pairs = ranking_pairs(res)
    assert sorted(zip(pairs["a"], pairs["b"])) == [("a", "b"), ("b", "c")]
    # published: a faster than b (10 < 12 s); predicted: b faster: disagree
    assert not pairs.set_index(["a", "b"]).loc[("a", "b"), "agrees"]
    summary = group_summary(res, pairs)
    assert summary.loc[0, "pairs"] == 2 and summary.loc[0, "pairs_agree"] == 0
    assert summary.loc[0, "mean_abs_pct"] == pytest.approx((10 + 25 + 13.9) / 3)


def test_rankings_pair_plans_only_within_one_software_release():
    res = pd.DataFrame(
        {
            "case": ["a", "b", "c", "d"],
            "status": ["ok"] * 4,
            "source": ["s"] * 4,
            "framework_version": ["r1", "r1", "r2", "r2"],
            "group": ["s/tokens_per_s_per_gpu"] * 4,
            "kind": ["tokens_per_s_per_gpu"] * 4,
            "model": ["m"] * 4,
            "hardware": ["h"] * 4,
            "num_gpus": [8] * 4,
            "workload": ["w"] * 4,
            "plan": ["p1", "p2", "p3", "p4"],
            "published": [100.0, 150.0, 200.0, 120.0],
            "predicted": [110.0, 140.0, 130.0, 125.0],
            "err_pct": [0.0] * 4,
        }
    )
    pairs = ranking_pairs(res)
    # a later release's software speed-up is not a ranking of plans
    assert sorted(zip(pairs["a"], pairs["b"])) == [("a", "b"), ("c", "d")]
    assert pairs["agrees"].tolist() == [True, True]


def _t1():
    return [c for c in CASES if c.source.id == "narayanan2021_t1"]


BLOCK = """\
source: {id: block_src, citation: "A paper, Table 1", url: "https://example.org", kind: training}
defaults: {hardware: h100_sxm, cluster: dgx_h100, seq_len: 8192, model: llama3_8b, gpus: 8,
           tp: 1, pp: 2, zero: 1, global_batch: 64, micro_batch: 1, unstated: [recompute]}
runs:
  - {id: mcore, where: "row 1", framework: megatron_core, target: {kind: iter_s, value: 9.0}}
  - {id: titan, where: "row 2", framework: torchtitan_fsdp2, target: {kind: iter_s, value: 9.0}}
"""


def test_unstated_recompute_tries_block_recompute_where_the_framework_has_it(tmp_path):
    """Megatron-Core can recompute the first N layers of each model chunk: an unstated
    recompute also ranges over a quarter, half and three quarters of a chunk's 16 layers;
    torchtitan checkpoints whole blocks only, so it keeps none/selective/full."""
    mcore, titan = read_file(_write(tmp_path, BLOCK, "block.yaml"))
    labels = {p.recompute_label for p in training_setup(mcore).plans}
    assert labels == {"none", "selective", "full", "full:4", "full:8", "full:12"}
    assert {p.recompute_label for p in training_setup(titan).plans} == {
        "none",
        "selective",
        "full",
    }


def test_stated_optimizer_precisions_reach_the_memory():
    """NeMo 24.07's Llama 2 70B SFT on 16 H100s (dp 1) ran distributed_fused_adam in bf16
    (gradients, Adam moments and stored master weights 16-bit): 2 + 2 + 2 x 2 bytes per
    parameter of the stage against 2 + 4 + 12 at the defaults, which did not fit 80 GB."""
    name = "nemo2407_sft_llama2_70b_16gpu_tp4_pp4"
    (case,) = [c for c in CASES if c.id == name]
    stated = training_setup(case).training
    assert (stated.grads_dtype.bytes, stated.optimizer_bytes_per_param) == (2, 6)
    fields = {
        k: v for k, v in case.fields.items() if k not in ("grads", "optimizer_states", "master")
    }
    default = dataclasses.replace(case, fields=fields)
    assert training_setup(default).training.optimizer_bytes_per_param == 12
    ours, theirs = Problem([case]).evaluate().iloc[0], Problem([default]).evaluate().iloc[0]
    assert (ours["status"], theirs["status"]) == ("ok", "oom")
    assert ours["mem_gib"] < theirs["mem_gib"] - 20


def test_a_tight_stage_picks_block_recompute_over_recomputing_every_layer():
    """Megatron-Bridge's 26.02.01 Llama 3 70B on 64 GB300s (pp 4, micro-batch 2, recompute not
    printed): no layer's activations stored does not fit, recomputing every layer is the
    slowest that does, and the fastest fitting plan recomputes part of each chunk."""
    name = "mbridge26_02_01_llama3_70b_gb300_64gpu_mxfp8_tp1_pp4_cp1"
    (case,) = [c for c in CASES if c.id == name]
    row = Problem([case]).evaluate().iloc[0]
    assert row["status"] == "ok" and " full:" in row["plan"]


def test_unstated_choices_take_the_fastest_plan_that_fits():
    case = _t1()[4]  # 39.1B on 512 GPUs: micro-batch and chunks unstated
    setup = training_setup(case)
    assert {p.micro_batch_size for p in setup.plans} >= {1, 2}
    assert {p.virtual_stages for p in setup.plans} >= {1, 2}
    res = Problem([case]).evaluate()
    chosen = res.loc[0, "plan"]
    hw, cl = load_hardware("a100_80gb"), load_cluster("dgx_a100", num_gpus=512)
    model = load_model(case.fields["model"])
    best = None
    for plan in setup.plans:
        r = evaluate_plan(model, setup.training, plan, hardware=hw, cluster=cl)
        if r["mem_headroom_bytes"] >= 0 and (best is None or r["step_s"] < best[0]):
            best = (r["step_s"], plan)
    assert res.loc[0, "predicted_s"] == pytest.approx(best[0], rel=1e-9)
    assert f"mb{best[1].micro_batch_size}" in chosen


def test_fit_recovers_a_known_efficiency_from_synthetic_measurements():
    """Figures the model itself produces at GEMM efficiency 0.60 are fitted back to 0.60 from
    the preset's value: the procedure finds what the data say."""
    p = Parameter("gemm_efficiency/a100", ("gemm_efficiency",), 0.5, 0.93, hardware=("a100_80gb",))
    truth = Problem(_t1()).evaluate([p], {p.name: 0.60})
    synthetic = [
        dataclasses.replace(case, value=float(v)) for case, v in zip(_t1(), truth["predicted"])
    ]
    problem = Problem(synthetic)
    assert loss(problem.evaluate()) > 0.05
    theta = fit(problem, [p], sweeps=1)
    assert theta[p.name] == pytest.approx(0.60, abs=0.004)
    assert loss(problem.evaluate([p], theta)) < 2e-3


def test_a_parameter_only_the_held_out_source_touches_keeps_its_preset_value():
    cases = _t1()[:3] + [c for c in CASES if c.source.id == "llama3_t4"][:1]
    params = [
        Parameter("gemm_efficiency/a100", ("gemm_efficiency",), 0.5, 0.93, hardware=("a100_80gb",)),
        Parameter("gemm_efficiency/h100", ("gemm_efficiency",), 0.5, 0.86, hardware=("h100_sxm",)),
    ]
    result, out = leave_one_source_out(Problem(cases), params)
    assert result.folds["llama3_t4"]["gemm_efficiency/h100"] == result.start["gemm_efficiency/h100"]
    a100 = "gemm_efficiency/a100"
    assert result.folds["narayanan2021_t1"][a100] == result.start[a100]
    assert result.start[a100] == load_hardware("a100_80gb").gemm_efficiency
    assert np.isfinite(out["loso_err_pct"]).all()


def test_a_source_no_fit_saw_is_predicted_with_the_last_fit():
    """A source added after the last fit has no fold; the last fit was made without it, so its
    parameters predict it held out. A source that fit saw but that has no fold (or one whose
    cases the model cannot express) gets no held-out figure."""
    from stage_dse.validation.fit import apply_folds

    cases = _t1()[:3] + [c for c in CASES if c.source.id == "llama3_t4"][:1]
    p = Parameter("gemm_efficiency/a100", ("gemm_efficiency",), 0.5, 0.93, hardware=("a100_80gb",))
    problem = Problem(cases)
    folds = {"llama3_t4": {p.name: 0.7}}
    unseen = {"theta": {p.name: 0.6}, "fitted_sources": ["llama3_t4"]}
    out = apply_folds(problem, [p], folds, unseen).set_index("case")
    t1 = [c.id for c in cases if c.source.id == "narayanan2021_t1"]
    expected = problem.subset(_t1()[:3]).evaluate([p], {p.name: 0.6}).set_index("case")
    assert out.loc[t1, "loso_err_pct"].to_numpy() == pytest.approx(
        expected.loc[t1, "err_pct"].to_numpy(), rel=1e-12
    )
    assert np.isfinite(out["loso_err_pct"]).all()
    seen = {**unseen, "fitted_sources": ["llama3_t4", "narayanan2021_t1"]}
    out = apply_folds(problem, [p], folds, seen).set_index("case")
    assert np.isnan(out.loc[t1, "loso_err_pct"]).all()


# ------------------------------------------------------------------------ the guard
@pytest.fixture(scope="module")
def validation():
    from stage_dse.cli.validate import read_recorded
    from stage_dse.validation.fit import apply_folds, load_parameters

    recorded = read_recorded()
    params = load_parameters()
    out = {}
    prepared = Problem(CASES)
    for timing in ("roofline", "measured") if data_root() is not None else ("roofline",):
        held = recorded["timings"][timing]
        res = apply_folds(prepared.retimed(timing), params, held["folds"], held.get("unseen"))
        out[timing] = group_summary(res).set_index("group")
    return recorded, out


def test_recorded_figures_belong_to_this_corpus(validation):
    from stage_dse.validation.run import corpus_hash

    recorded, _ = validation
    assert recorded["corpus"] == corpus_hash(), (
        "the corpus changed: rerun `stage-dse-validate --fit --record` and commit recorded.yaml"
    )


@pytest.mark.parametrize(
    "timing",
    [
        "roofline",
        pytest.param(
            "measured",
            marks=pytest.mark.skipif(
                data_root() is None,
                reason="the measured extra (aiconfigurator-core) is not installed",
            ),
        ),
    ],
)
def test_no_group_got_worse_than_recorded(validation, timing):
    """Each group's mean and leave-one-source-out error may not rise more than one point above
    the recorded value (stage_dse/validation/recorded.yaml): a change that makes fidelity worse
    fails here, naming the group; recording a better value belongs to the change earning it."""
    recorded, summaries = validation
    now = summaries[timing]
    worse = []
    for group, rec in recorded["timings"][timing]["groups"].items():
        assert group in now.index, f"group {group} disappeared"
        for col in ("mean_abs_pct", "loso_mean_abs_pct"):
            if col in rec and now.loc[group, col] > rec[col] + 1.0:
                worse.append(f"{group} {col} {rec[col]:.2f} -> {now.loc[group, col]:.2f}")
        if now.loc[group, "pairs_agree"] < rec.get("pairs_agree", 0):
            worse.append(
                f"{group} pairs_agree {rec['pairs_agree']} -> {now.loc[group, 'pairs_agree']}"
            )
    assert not worse, "timing=" + timing + ": " + "; ".join(worse)
    assert set(now.index) <= set(recorded["timings"][timing]["groups"]), "unrecorded groups"


# ------------------------------------------------------------------------ the command
def test_validate_prints_cases_groups_and_writes_rows(tmp_path, capsys):
    from stage_dse.cli.validate import main

    _write(tmp_path, GOOD, "mine.yaml")
    out = tmp_path / "cases.parquet"
    argv = ["timing=roofline", "--source", "test_src", "--source", "narayanan2021_t1"]
    assert main([*argv, "--corpus", str(tmp_path / "mine.yaml"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # one line per case with its plan, one per group, one summary per kind
    assert "narayanan2021_t1_1p7b" in text and "dp32 tp1 pp1" in text
    assert "test_src/iter_s" in text and "narayanan2021_t1/tflops_per_gpu" in text
    assert "training timing=roofline n=11 " in text
    rows = pd.read_parquet(out)
    assert len(rows) == 11 and set(rows["timing_run"]) == {"roofline"}
    assert rows.loc[rows["case"] == "t1", "published"].item() == 2.5


def test_a_serving_source_none_of_whose_cases_can_be_expressed_is_reported(capsys):
    """Every figure of this source names a deployment the model refuses: the command says so
    per case and in the summary instead of failing on the missing predictions."""
    from stage_dse.cli.validate import main

    argv = ["timing=roofline", "--kind", "serving", "--source", "vllm_blog_dsr1_gb200_part1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("cannot express: deployment not modelled") == 2
    assert "serving timing=roofline n=0 cannot_express=2" in text


def test_a_training_source_none_of_whose_cases_can_be_expressed_is_reported(tmp_path, capsys):
    """A training source whose only run names a GPU without a preset: both timings report the
    case as not expressible and print n=0, where the measured timing's note on kernel tables
    failed on the missing hardware column."""
    from stage_dse.cli.validate import main

    _write(tmp_path, GOOD.replace("hardware: h100_sxm", "hardware: mi355x"), "mine.yaml")
    argv = ["--kind", "training", "--source", "test_src", "--corpus", str(tmp_path / "mine.yaml")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "no hardware preset 'mi355x'" in text
    assert "training timing=roofline n=0 cannot_express=1" in text


def test_megatron_expert_groups_fold_over_tensor_parallel_ranks():
    """DGX Cloud's Grok-1 on 512 H100s (tp 4, pp 8, cp 2, ep 8, etp 1): Megatron-Core forms
    the expert groups from a stage's flattened tp x cp x dp ranks whenever experts are not
    tensor-split, so each expert's optimizer states are sharded over 4 x 2 x 8 / 8 = 8 ranks
    and the all-to-all stays inside a node (the group is the tp x cp ranks, 8 consecutive).
    Over the context- and data-parallel ranks alone (experts replicated over tp, 2 expert
    replicas per stage) the stage would not fit 80 GB, yet the run was measured."""
    name = "dgxc2505_grok1_314b_h100_bf16_512gpu_tp4_pp8_cp2_ep8"
    (case,) = [c for c in CASES if c.id == name]
    setup = training_setup(case)
    hw, cl, model = setup.hardware, setup.cluster, setup.model
    folded = setup.plans[0]
    assert folded.ep_over_tp and folded.ep_over_cp and folded.ep_data == 1
    apart = folded.replace(ep_over_tp=False)
    out = {
        p.ep_over_tp: evaluate_plan(model, setup.training, p, hardware=hw, cluster=cl)
        for p in (folded, apart)
    }
    # the routed experts' optimizer states (most of the stage's): 8-way against 2-way sharding
    assert out[False]["mem_optimizer_bytes"] / out[True]["mem_optimizer_bytes"] > 3
    assert out[True]["mem_headroom_bytes"] > 0 > out[False]["mem_headroom_bytes"]
    assert out[True]["ep_comm_s"] < out[False]["ep_comm_s"]
    assert Problem([case]).evaluate().iloc[0]["status"] == "ok"
