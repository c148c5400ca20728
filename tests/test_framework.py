"""Framework profiles: what they hold, how a sweep ranges over them, how rows name them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import sympy

from stage_dse.cli._common import compose
from stage_dse.config import load_cluster, load_framework, load_hardware, load_model
from stage_dse.config.schema import to_sweep
from stage_dse.cost.table import evaluate_plans
from stage_dse.errors import ConfigError
from stage_dse.results.schema import config_hash
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.spec import DType, TrainingSpec
from stage_dse.spec.framework import PLAN_FLAGS, FrameworkSpec

PROFILES = sorted(p.stem for p in Path(__file__).parents[1].glob("conf/framework/*.yaml"))


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_loads_and_cites_its_behaviour(name):
    fw = load_framework(name)
    assert fw.name == name
    text = (Path(__file__).parents[1] / "conf" / "framework" / f"{name}.yaml").read_text()
    assert text.lstrip().startswith("#"), f"{name}: a profile cites its behaviour"
    assert set(fw.plan_flags()) == set(PLAN_FLAGS)


def test_gradient_precision_is_the_documented_one():
    # Megatron-LM (bf16 forces fp32 accumulation and all-reduce), torchtitan's FSDP2 policy,
    # Composer's DEFAULT mixed precision and the Llama 3 paper all reduce in fp32
    for name in ("megatron_core", "torchtitan_fsdp2", "composer_fsdp", "meta_llama3"):
        assert load_framework(name).grads(DType.BF16) is DType.FP32
    # a profile that does not fix it leaves the step's precision
    assert load_framework("megatron_2021").grads(DType.FP16) is DType.FP16


def test_bad_profiles_name_the_field():
    with pytest.raises(ConfigError, match=r"framework\.tp_comm_overlap"):
        FrameworkSpec(tp_comm_overlap="yes")
    with pytest.raises(ConfigError, match=r"framework\.grads_dtype"):
        FrameworkSpec(grads_dtype="fp8")
    with pytest.raises(ConfigError, match=r"framework\.attention"):
        FrameworkSpec(attention="magic")
    with pytest.raises(ConfigError, match=r"plan\.framework"):
        SearchSpace(frameworks=())
    with pytest.raises(ConfigError, match="at most once"):
        SearchSpace(frameworks=(FrameworkSpec(), FrameworkSpec()))


def test_forcing_a_flag_renames_the_profile_only_when_it_changes_something():
    fw = load_framework("megatron_core")
    assert fw.with_flags(tp_comm_overlap=None, tp_dgrad_overlap=True) is fw
    forced = fw.with_flags(tp_comm_overlap=True)
    assert forced.tp_comm_overlap and forced.name == "megatron_core[tp_comm_overlap=true]"


def _table(frameworks, num_gpus=16, training=None):
    model = load_model("llama3_8b")
    training = training or TrainingSpec(seq_len=4096, global_batch_size=64)
    space = SearchSpace(
        tp=(1, 2, 4),
        pp=(1, 2),
        zero_stage=(1, 3),
        recompute=("none",),
        micro_batch_size=(1,),
        frameworks=frameworks,
    )
    hardware, cluster = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=num_gpus)
    return enumerate_plans(model, training, hardware, cluster, space).table


def test_a_sweep_over_frameworks_gives_each_plan_once_per_framework():
    names = ("megatron_core", "torchtitan_fsdp2", "megatron_2021")
    frameworks = tuple(load_framework(n) for n in names)
    table = _table(frameworks)
    alone = _table(frameworks[:1])
    assert len(table) == len(names) * len(alone)
    assert list(table["framework"].cat.categories) == list(names)
    for fw in frameworks:
        rows = table[table["framework"] == fw.name]
        for flag, value in fw.plan_flags().items():
            assert (rows[flag] == value).all(), (fw.name, flag)
        assert (rows["grad_bytes"] == fw.grads(DType.BF16).bytes).all()
    # every (plan, framework) is its own configuration
    assert config_hash(table).nunique() == len(table)


def test_the_framework_changes_the_answer_where_its_behaviour_matters():
    core, titan = load_framework("megatron_core"), load_framework("torchtitan_fsdp2")
    costs = evaluate_plans(_table((core, titan)))
    # the framework is the outermost axis: each framework's rows list the same plans in order
    a, b = (costs[costs["framework"] == fw.name] for fw in (core, titan))
    plan_cols = ["tp", "pp", "dp", "zero_stage", "sequence_parallel", "micro_batch"]
    assert np.array_equal(a[plan_cols].to_numpy(), b[plan_cols].to_numpy())
    ta, tb, tp = a["step_s"].to_numpy(), b["step_s"].to_numpy(), a["tp"].to_numpy()
    # torchtitan's backward tensor-parallel collectives wait for their GEMMs (no asynchronous
    # reduction under the weight-gradient GEMM): never faster, slower wherever tp > 1
    assert np.all(tb >= ta * (1 - 1e-12))
    assert np.all(tb[tp > 1] > ta[tp > 1])


def test_two_profiles_with_the_same_behaviours_give_the_same_costs_under_their_own_names():
    core = load_framework("megatron_core")
    twin = dataclasses.replace(core, name="my_megatron_fork")
    table = _table((core, twin))
    costs = evaluate_plans(table)
    half = len(table) // 2
    assert np.array_equal(costs["step_s"].to_numpy()[:half], costs["step_s"].to_numpy()[half:])
    assert config_hash(table).nunique() == len(table)


def test_a_stated_gradient_precision_holds_under_every_framework():
    spec = to_sweep(compose(["plan.framework=[megatron_core,nemo]"]))
    assert [f.grads(spec.training.grads_dtype) for f in spec.space.frameworks] == [
        DType.FP32,
        DType.BF16,  # NeMo's recipes leave it to the step (bf16 by default)
    ]
    spec = to_sweep(compose(["plan.framework=[megatron_core,nemo]", "training.grads_dtype=bf16"]))
    assert {f.grads(spec.training.grads_dtype) for f in spec.space.frameworks} == {DType.BF16}


def test_plan_flags_given_in_the_sweep_force_every_framework():
    spec = to_sweep(compose(["plan.framework=[megatron_core,torchtitan_fsdp2]",
                             "plan.tp_comm_overlap=true"]))  # fmt: skip
    assert [f.name for f in spec.space.frameworks] == [
        "megatron_core[tp_comm_overlap=true]",
        "torchtitan_fsdp2[tp_comm_overlap=true]",
    ]
    assert all(f.tp_comm_overlap for f in spec.space.frameworks)


def test_plan_presets_name_their_framework():
    assert [f.name for f in to_sweep(compose([])).space.frameworks] == ["megatron_core"]
    spec = to_sweep(compose(["plan=megatron_2021"]))
    assert [f.name for f in spec.space.frameworks] == ["megatron_2021"]
    assert not spec.space.frameworks[0].overlap_grad_reduce


def test_corpus_records_take_the_gradient_precision_of_their_framework_unless_they_state_it():
    from stage_dse.validation.corpus import load_corpus
    from stage_dse.validation.training import training_setup

    cases = {c.id: c for c in load_corpus("training")}
    # llm-foundry states no precision for gradients: Composer's DEFAULT reduces in fp32
    composer = training_setup(cases["llmfoundry_mpt_7b_h100_sxm_8gpu_seq2048_amp_bf16_full_shard"])
    assert composer.training.grads_dtype is DType.FP32
    # AutoModel's records state bf16 (its FSDP2Manager policy) under torchtitan's profile
    automodel = training_setup(cases["automodel_llama3_70b_64gpu_pp1_cp2"])
    assert automodel.training.grads_dtype is DType.BF16
    # the plans carry the profile's flags
    assert not composer.plans[0].tp_dgrad_overlap


def test_a_corpus_record_may_state_its_recipes_own_switches():
    import dataclasses

    from stage_dse.validation.corpus import CorpusError, load_corpus
    from stage_dse.validation.training import training_setup

    cases = {c.id: c for c in load_corpus("training")}
    # Megatron-Bridge's DeepSeek-V3 MXFP8 recipe on B200: DeepEP dispatch, all-to-alls
    # overlapped with another micro-batch; the other records keep megatron_core's switches
    dsv3 = training_setup(cases["mbridge26_04_01_deepseekv3_b200_256gpu_mxfp8_tp1_pp8_cp1_ep32"])
    assert dsv3.plans[0].ep_comm_overlap and dsv3.plans[0].ep_dispatch_dedup
    case = cases["mbridge26_04_01_qwen3_235b_a22b_b200_256gpu_mxfp8_tp1_pp8_cp1_ep8"]
    qwen = training_setup(case)
    assert not qwen.plans[0].ep_comm_overlap and not qwen.plans[0].ep_dispatch_dedup
    bad = dataclasses.replace(case, fields={**case.fields, "framework_flags": {"fast": True}})
    with pytest.raises(CorpusError, match=r"framework\.fast is not a plan flag"):
        training_setup(bad)


def test_a_profile_written_inline_in_the_sweep():
    spec = to_sweep(compose(["plan.framework=[megatron_core,{name: my_fsdp, "
                             "tp_dgrad_overlap: false, grads_dtype: bf16}]"]))  # fmt: skip
    mine = spec.space.frameworks[1]
    assert (mine.name, mine.tp_dgrad_overlap, mine.grads_dtype) == ("my_fsdp", False, DType.BF16)
    assert mine.overlap_grad_reduce  # unset fields: Megatron-Core's behaviour
    with pytest.raises(ConfigError, match=r"framework\.name"):
        to_sweep(compose(["plan.framework=[{tp_dgrad_overlap: false}]"]))


def test_a_framework_hashes_alike_as_a_constant_and_as_a_column():
    model, training = load_model("llama3_8b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    space = SearchSpace(tp=(1, 2), pp=(1,), frameworks=(load_framework("megatron_core"),))
    hardware, cluster = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=8)
    columns = enumerate_plans(model, training, hardware, cluster, space).columns
    assert columns.columns["framework"] == "megatron_core"  # a constant of the columns
    assert list(config_hash(columns)) == list(config_hash(columns.frame()))


def test_zero2_gradients_reduced_once_per_step_hold_full_gradient_memory():
    """grad_sync_per_step (FSDP's no_sync): ZeRO-2 gradients accumulate unsharded and are
    reduce-scattered once per step instead of once per micro-batch; the other stages keep
    their schedule."""
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.spec import ParallelPlan

    model = load_model("llama3_8b")
    t = TrainingSpec(seq_len=2048, global_batch_size=64)
    hw, cl = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=16)

    def run(zero, once):
        plan = ParallelPlan(dp=16, zero_stage=zero, micro_batch_size=1, grad_sync_per_step=once)
        return evaluate_plan(model, t, plan, hardware=hw, cluster=cl)

    per_mb, once, z1 = run(2, False), run(2, True), run(1, False)
    m = 64 // 16  # micro-batches per step
    grads = "comm_reduce_scatter_bytes"
    assert per_mb[grads] == pytest.approx(m * once[grads], rel=1e-12)
    assert once[grads] == pytest.approx(z1[grads], rel=1e-12)  # as ZeRO-1 reduces
    assert once["mem_grads_bytes"] == pytest.approx(z1["mem_grads_bytes"], rel=1e-12)
    assert once["mem_grads_bytes"] == pytest.approx(16 * per_mb["mem_grads_bytes"], rel=1e-9)
    assert once["step_s"] < per_mb["step_s"]
    for zero in (0, 1, 3):  # no effect beyond ZeRO-2
        a, b = run(zero, False), run(zero, True)
        assert a["step_s"] == b["step_s"] and a["mem_total_bytes"] == b["mem_total_bytes"]


def _llama3_8b_block_ops(flag: str) -> dict[bool, dict]:
    """A Llama 3 8B block's ops by name, with a plan ``flag`` on (True) and off (False)."""
    from stage_dse.graph import build_graphs
    from stage_dse.spec import ParallelPlan

    model, t = load_model("llama3_8b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    ops = {}
    for on in (True, False):
        plan = ParallelPlan(dp=8, micro_batch_size=1, **{flag: on})
        ops[on] = {op.name: op for op in build_graphs(model, plan, t).block.ops}
    return ops


def test_eager_element_wise_ops_move_the_bytes_of_their_reference_code():
    """Without torch.compile, torchtitan's RMSNorm runs as 8 kernels moving 36 bytes per
    element in forward (4 fused) and 12 moving 84 in backward (6 fused); rotary embedding 20
    bytes in 3 kernels each way (4 fused); SwiGLU 10 and 18 bytes (6 and 10 fused)."""
    ops = _llama3_8b_block_ops("fused_elementwise")
    for name, factor, kernels in (
        ("input_norm", 9, 8),
        ("d_input_norm", 14, 12),
        ("q_rope", 5, 3),
        ("d_k_rope", 5, 3),
        ("swiglu", sympy.Rational(10, 6), 2),
        ("d_swiglu", sympy.Rational(18, 10), 3),
        ("attention_residual", 1, 1),  # one kernel either way
    ):
        fused, eager = ops[True][name], ops[False][name]
        assert sympy.simplify(eager.bytes - factor * fused.bytes) == 0, name
        assert (fused.kernels, eager.kernels) == (1, kernels), name


def _assert_off_hashes_apart(table, flag: str) -> None:
    """Rows with ``flag`` on hash as rows written before the column existed; off, apart."""
    before = config_hash(table.drop(columns=flag))
    assert list(config_hash(table)) == list(before)
    assert not set(config_hash(table.assign(**{flag: False}))) & set(before)


def test_eager_element_wise_ops_slow_a_step_and_keep_fused_rows_hashes():
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.spec import ParallelPlan

    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    hw, cl = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=8)
    for name in ("llama3_8b", "gpt3_175b"):
        steps = [
            evaluate_plan(
                load_model(name),
                t,
                ParallelPlan(tp=8, sequence_parallel=True, fused_elementwise=fused),
                hardware=hw,
                cluster=cl,
            )["step_s"]
            for fused in (True, False)
        ]
        # nothing fuses eagerly; Llama's RMSNorm, rotary and SwiGLU add most
        assert steps[1] > steps[0] * (1.05 if name == "llama3_8b" else 1.0)
    _assert_off_hashes_apart(_table((load_framework("torchtitan_fsdp2"),)), "fused_elementwise")


def test_the_weighted_moe_activation_changes_only_moe_rows_hashes():
    """The flag has no effect on a dense model: its rows hash as they did without the column
    (a resumed dense sweep under megatron_core finds its stored rows); MoE rows hash apart."""
    dense = _table((load_framework("megatron_core"),))
    assert dense["moe_weighted_activation"].all()
    before = config_hash(dense.drop(columns="moe_weighted_activation"))
    assert list(config_hash(dense)) == list(before)
    moe = dense.assign(moe=True)
    assert not set(config_hash(moe)) & set(config_hash(moe.assign(moe_weighted_activation=False)))


def test_torchtitan_records_without_torch_compile_run_element_wise_ops_eagerly():
    from stage_dse.validation.corpus import load_corpus
    from stage_dse.validation.training import training_setup

    cases = {c.id: c for c in load_corpus("training")}
    plan = {
        name: training_setup(cases[name]).plans[0]
        for name in (
            "torchtitan_llama31_8b_8gpu_fsdp",  # torch_compile: false
            "torchtitan_llama31_8b_8gpu_fsdp_compile",
            "mbridge25_11_llama3_8b_h100_8gpu_fp8-cs_tp1_pp1_cp1_fsdp",  # TE's fused kernels
        )
    }
    assert [p.fused_elementwise for p in plan.values()] == [False, True, True]
    assert load_framework("torchtitan_fsdp2").compile_fuses_elementwise
    assert not load_framework("megatron_core").compile_fuses_elementwise


def test_an_eager_activation_alone_scales_only_the_swiglu_ops():
    """``fused_activation=False`` (nanotron's ``GLUActivation``): the SwiGLU ops move the eager
    bytes in eager kernels; norms and rotary embedding keep their fused kernels. It changes
    nothing where everything already runs eagerly, or where the MLP is not gated (the graph
    key folds it away there)."""
    from stage_dse.graph.key import graph_key
    from stage_dse.spec import ParallelPlan

    model, t = load_model("llama3_8b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    ops = _llama3_8b_block_ops("fused_activation")
    for name, factor, kernels in (
        ("swiglu", sympy.Rational(10, 6), 2),
        ("d_swiglu", sympy.Rational(18, 10), 3),
        ("input_norm", 1, 1),
        ("d_input_norm", 1, 1),
        ("q_rope", 1, 1),
        ("attention_residual", 1, 1),
    ):
        fused, eager = ops[True][name], ops[False][name]
        assert sympy.simplify(eager.bytes - factor * fused.bytes) == 0, name
        assert (fused.kernels, eager.kernels) == (1, kernels), name
    all_eager = ParallelPlan(dp=8, fused_elementwise=False)
    assert graph_key(model, all_eager, t) == graph_key(
        model, dataclasses.replace(all_eager, fused_activation=False), t
    )
    gelu = load_model("gpt3_175b")
    assert graph_key(gelu, ParallelPlan(dp=8), t) == graph_key(
        gelu, ParallelPlan(dp=8, fused_activation=False), t
    )
    assert graph_key(model, ParallelPlan(dp=8), t) != graph_key(
        model, ParallelPlan(dp=8, fused_activation=False), t
    )


def test_an_eager_activation_slows_a_step_a_little_and_hashes_apart():
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.spec import ParallelPlan

    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    hw, cl = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=8)
    model = load_model("llama3_8b")
    step = {
        (elementwise, act): evaluate_plan(
            model,
            t,
            ParallelPlan(dp=8, fused_elementwise=elementwise, fused_activation=act),
            hardware=hw,
            cluster=cl,
        )["step_s"]
        for elementwise, act in ((True, True), (True, False), (False, True))
    }
    # more than fused, less than everything eager
    assert step[True, True] < step[True, False] < step[False, True]
    _assert_off_hashes_apart(_table((load_framework("megatron_core"),)), "fused_activation")


def test_the_ultrascale_playbook_runs_name_nanotron_s_eager_activation():
    from stage_dse.validation.corpus import load_corpus
    from stage_dse.validation.training import training_setup

    cases = [c for c in load_corpus("training") if c.source.id == "ultrascale_playbook_2025_best"]
    plans = [training_setup(c).plans[0] for c in cases]
    assert plans and all(p.fused_elementwise and not p.fused_activation for p in plans)
