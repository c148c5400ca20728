"""The Optuna search: it samples only valid plans (the enumeration's), never evaluates one
configuration twice, stops when the space is exhausted, and resumes from a results folder."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import optuna
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.errors import ConfigError
from stage_dse.results import ResultStore, config_hash, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.runner.optuna_driver import optuna_space, run_optuna
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.search.optuna_search import OptunaSpace
from stage_dse.spec import TrainingSpec
from stage_dse.spec.sweep import OptunaSpec


def tiny_spec(name="tiny", gpus=(16, 32)) -> SweepSpec:
    return SweepSpec(
        name=name,
        models=(load_model("llama3_8b"),),
        training=TrainingSpec(seq_len=4096, global_batch_size=64),
        hardware=(load_hardware("h100_sxm"),),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=gpus,
        space=SearchSpace(micro_batch_size=(1, 2), zero_stage=(1, 3), recompute=("none", "full")),
    )


def enumerated_hashes(model, training, space, gpus, hw, cluster) -> set[str]:
    out: set[str] = set()
    for g in gpus:
        e = enumerate_plans(model, training, hw, cluster.replace(num_gpus=g), space)
        out.update(config_hash(e.table))
    return out


def study_of(store_root, name):
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(store_root / "_optuna.journal"))
    )
    return optuna.load_study(study_name=name, storage=storage)


@pytest.mark.parametrize(
    ("model", "training", "space", "gpus"),
    [
        (
            "llama3_70b",
            TrainingSpec(seq_len=8192, global_batch_size=96),
            SearchSpace(
                cp="auto",
                micro_batch_size=(1, 2, 4),
                virtual_stages=(1, 2, 5),
                stage_layers=("balanced", "ceil"),
                attention=("flash", "materialized"),
            ),
            (48, 64),
        ),
        (
            "mixtral_8x7b",
            TrainingSpec(seq_len=4096, global_batch_size=64),
            SearchSpace(ep="auto", expert_tensor_parallel=(False, True), zero_stage=(1,)),
            (16, 32),
        ),
    ],
)
def test_the_space_reaches_exactly_the_enumerated_plans(model, training, space, gpus):
    """Every configuration a trial can reach is a valid plan of the enumeration (same config
    hash) and every enumerated plan can be reached, for a dense model with context and
    interleaved pipelines and for an MoE model with expert parallelism."""
    m, hw, cluster = load_model(model), load_hardware("h100_sxm"), load_cluster("dgx_h100")
    s = OptunaSpace(m, training, space, list(gpus), {hw.name: hw}, cluster)
    expected = enumerated_hashes(m, training, space, gpus, hw, cluster)
    every = s.every()
    assert s.total == len(every) == len(expected)
    assert set(config_hash(s.table(every))) == expected
    for c in every[:: max(1, len(every) // 300)]:
        params = s.params(c)
        assert s.walk(lambda name, values, p=params: p[name]) == c  # reachable
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    sampled = [s.suggest(study.ask()) for _ in range(300)]
    assert set(config_hash(s.table(sampled))) <= expected
    # a parameter keeps its choices for the whole study (names carry the values offered)
    seen: dict[str, tuple] = {}
    for t in study.trials:
        for name, dist in t.distributions.items():
            assert seen.setdefault(name, dist.choices) == dist.choices


def test_neighbours_are_valid_plans_one_step_away():
    """A neighbour changes one plan axis (or trades two of tp, pp, cp at the same dp) or one
    co-design axis, and is a valid plan of the enumeration."""
    spec = tiny_spec()
    s = optuna_space(spec, OptunaSpec(hbm_gib=(40, 80)))
    m, hw = spec.models[0], spec.hardware[0]
    expected = enumerated_hashes(m, spec.training, spec.space, (16, 32), hw, spec.cluster)
    axes = ["tp", "pp", "cp", "micro_batch", "zero_stage", "recompute", "sequence_parallel"]
    for c in s.random(np.random.default_rng(1), 20):
        near = s.neighbors(c)
        assert near and c not in near
        here = s.table([c])
        rows = s.table(near)
        hw_of = {f"h100_sxm@{g:g}GiB": g for g in (40, 80)}
        for (_, r), n in zip(rows.iterrows(), near):
            changed = [a for a in axes if r[a] != here[a].iat[0]]
            if n.hbm_gib != c.hbm_gib:
                assert not changed and hw_of[r["hardware"]] == n.hbm_gib
            elif len(changed) == 2:
                assert set(changed) <= {"tp", "pp", "cp"} and r["dp"] == here["dp"].iat[0]
            else:
                assert len(changed) == 1, changed
        # the same plans on the base hardware are plans of the enumeration
        base = [replace(n, hbm_gib=None) for n in near if n.hbm_gib == c.hbm_gib]
        plain = OptunaSpace(m, spec.training, spec.space, [16, 32], {hw.name: hw}, spec.cluster)
        assert set(config_hash(plain.table(base))) <= expected


def test_codesign_rows_hash_like_one_configuration_at_a_time():
    """A batch mixing GPU counts, HBM sizes and scale-out bandwidths gives each row the
    hardware columns of its own variant."""
    spec = tiny_spec()
    search = OptunaSpec(hbm_gib=(40, 80), inter_gbit_s=(200, 400))
    s = optuna_space(spec, search)
    assert s.total == 4 * sum(g.valid for g in s.grids.values())
    picks = s.random(np.random.default_rng(0), 200)
    hw_names = set(s.table(picks)["hardware"])
    assert hw_names == {"h100_sxm@40GiB", "h100_sxm@80GiB"}
    one_by_one = []
    for c in picks:
        hw, cluster = s.variant(c)
        cols = s.grids[c.num_gpus].columns(np.array([c.position]), hw, cluster)
        one_by_one.append(config_hash(cols).iat[0])
    assert list(config_hash(s.table(picks))) == one_by_one
    assert len(set(one_by_one)) > 100


def test_no_configuration_twice_and_stop_when_exhausted(tmp_path):
    """A budget above the space's size evaluates every configuration once, says the space is
    exhausted, and a rerun evaluates nothing."""
    spec = tiny_spec(gpus=(16,))
    total = optuna_space(spec, OptunaSpec()).total
    search = OptunaSpec(n_trials=total + 50, batch_size=32, seed=2, sampler="random")
    logged: list[str] = []
    report = run_optuna(
        spec, search, LocalExecutor(), ResultStore(tmp_path / "t"), progress=False,
        log=logged.append,
    )  # fmt: skip
    assert report.evaluated == total
    assert any("search space exhausted" in line for line in logged)
    df = load(tmp_path / "t")
    assert len(df) == total and df["config_hash"].is_unique
    assert set(df["status"]) <= {"ok", "infeasible"}  # no invalid plan was sampled
    expected = enumerated_hashes(
        spec.models[0], spec.training, spec.space, spec.gpu_counts, spec.hardware[0],
        spec.cluster,
    )  # fmt: skip
    assert set(df["config_hash"]) == expected
    study = study_of(tmp_path / "t", "tiny")
    new = [t for t in study.trials if "repeat_of" not in t.user_attrs]
    assert len(new) == total
    assert len({t.user_attrs["config_hash"] for t in new}) == total
    # a repeated proposal is told the first trial's outcome, never evaluated again
    first = {t.user_attrs["config_hash"]: t for t in new}
    for t in study.trials:
        if "repeat_of" in t.user_attrs:
            orig = first[t.user_attrs["repeat_of"]]
            assert t.state == orig.state and t.values == orig.values
    again = run_optuna(
        spec, search, LocalExecutor(), ResultStore(tmp_path / "t"), progress=False,
        log=logged.append,
    )  # fmt: skip
    assert again.evaluated == 0 and len(load(tmp_path / "t")) == total


def test_a_folder_filled_by_a_grid_sweep_is_not_evaluated_again(tmp_path):
    """Configurations stored by another run (here the enumerated sweep) are repeats: their
    stored outcome is told to the study and nothing is evaluated again."""
    spec = tiny_spec(gpus=(16,))
    run_grid(spec, LocalExecutor(), ResultStore(tmp_path / "g"), progress=False)
    stored = load(tmp_path / "g")
    report = run_optuna(
        spec, OptunaSpec(n_trials=12, batch_size=6, seed=0), LocalExecutor(),
        ResultStore(tmp_path / "g"), progress=False, log=lambda _: None,
    )  # fmt: skip
    assert report.evaluated == 0
    assert len(load(tmp_path / "g")) == len(stored)
    step = dict(zip(stored["config_hash"], stored["step_s"]))
    status = dict(zip(stored["config_hash"], stored["status"]))
    study = study_of(tmp_path / "g", "tiny")
    assert study.trials and all("repeat_of" in t.user_attrs for t in study.trials)
    for t in study.trials:
        h = t.user_attrs["repeat_of"]
        if status[h] == "ok":
            assert t.values == [pytest.approx(step[h])]
        else:
            assert t.state.name == "PRUNED"


def test_a_space_without_valid_plans_is_refused():
    spec = replace(tiny_spec(gpus=(16,)), space=SearchSpace(tp=(3,)))
    with pytest.raises(ConfigError, match=r"no valid plan for any of num_gpus=\[16\].*tp\*pp\*cp"):
        optuna_space(spec, OptunaSpec())


def test_a_resumed_study_may_widen_its_space(tmp_path):
    """Parameters are named by the values they offer, so rerunning the study with more GPU
    counts adds parameters instead of failing on changed choices, and stores no repeat."""
    store = tmp_path / "w"
    quiet = {"progress": False, "log": lambda _: None}
    first = OptunaSpec(n_trials=16, batch_size=8, seed=4)
    run_optuna(tiny_spec(gpus=(16,)), first, LocalExecutor(), ResultStore(store), **quiet)
    wider = OptunaSpec(n_trials=40, batch_size=8, seed=4)
    run_optuna(tiny_spec(gpus=(16, 32)), wider, LocalExecutor(), ResultStore(store), **quiet)
    df = load(store)
    assert len(df) == 40 and df["config_hash"].is_unique
    assert set(df["num_gpus"]) == {16, 32}
    names = {k for t in study_of(store, "tiny").trials for k in t.params}
    assert "num_gpus[16,32]" in names
