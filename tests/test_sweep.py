"""The sweep orchestrator end to end: runners, resume, kill -9, Optuna, Hydra configs, CLI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from stage_dse.cli import run
from stage_dse.config import conf_dir, load_cluster, load_hardware, load_model
from stage_dse.config.schema import to_sweep
from stage_dse.errors import StageDseError
from stage_dse.results import ResultStore, best_per, load, pareto
from stage_dse.runner import LocalExecutor, RayExecutor, SweepSpec, build_table, run_grid, top_table
from stage_dse.search import SearchSpace
from stage_dse.spec import TrainingSpec

SWEEPS = sorted(p.stem for p in (Path(conf_dir()) / "sweep").glob("*.yaml"))


def small_spec(name="small", gpus=(16, 32)) -> SweepSpec:
    return SweepSpec(
        name=name,
        models=(load_model("llama3_8b"),),
        training=TrainingSpec(seq_len=4096, global_batch_size=128),
        hardware=(load_hardware("h100_sxm"),),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=gpus,
        space=SearchSpace(micro_batch_size=(1, 2), virtual_stages=(1, 2)),
    )


def sorted_rows(path) -> pd.DataFrame:
    df = load(path)
    return df.sort_values("config_hash").reset_index(drop=True)


def compose_cfg(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture
def ray_shutdown():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def test_local_and_ray_runners_write_identical_results(tmp_path, ray_shutdown):
    spec = small_spec()
    local = ResultStore(tmp_path / "local")
    run_grid(spec, LocalExecutor(), local, batch_size=500, progress=False)
    executor = RayExecutor(num_cpus=2)
    try:
        remote = ResultStore(tmp_path / "ray")
        report = run_grid(spec, executor, remote, batch_size=500, progress=False)
    finally:
        executor.close()
    a, b = sorted_rows(local.root), sorted_rows(remote.root)
    assert len(a) == report.valid > 1000
    assert len(local.parts()) > 1 and len(remote.parts()) == len(local.parts())
    # one run id per run, recorded on every row it evaluated; everything else identical
    assert a["run_id"].nunique() == b["run_id"].nunique() == 1
    assert a["run_id"].iloc[0] != b["run_id"].iloc[0]
    pd.testing.assert_frame_equal(a.drop(columns="run_id"), b.drop(columns="run_id"))
    assert set(a["status"]) <= {"ok", "infeasible"} and (a["status"] == "ok").any()


def test_ray_retries_a_block_whose_worker_dies(tmp_path, ray_shutdown, monkeypatch):
    """The worker running the first block exits hard (as if OOM-killed); Ray retries the task
    on a fresh worker and the sweep ends with every row, none as an error."""
    import stage_dse.runner.sweep as sweep_mod

    real = sweep_mod.evaluate_part
    marker = tmp_path / "died"

    def dies_once(block, *args):
        if block.start == 0 and not marker.exists():
            marker.touch()
            os._exit(1)
        return real(block, *args)

    monkeypatch.setattr(sweep_mod, "evaluate_part", dies_once)
    executor = RayExecutor(num_cpus=2)
    try:
        store = ResultStore(tmp_path / "r")
        report = run_grid(small_spec(gpus=(16,)), executor, store, batch_size=400, progress=False)
    finally:
        executor.close()
    df = load(store.root)
    assert marker.exists() and "error" not in report.status
    assert len(df) == report.valid == report.evaluated > 400 and df["config_hash"].is_unique


def test_sweep_through_a_two_node_ray_cluster(tmp_path, ray_shutdown):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        cfg = compose_cfg(
            [
                f"results_dir={tmp_path}",
                f"runner.address={cluster.address}",
                "runner.batch_size=300",
                "runner.progress=false",
                "num_gpus=[16]",
            ]
        )
        import ray

        evaluated = run(cfg)
        assert not ray.is_initialized()  # the executor disconnected after the sweep
    finally:
        cluster.shutdown()
    local = ResultStore(tmp_path / "local")
    cfg_local = compose_cfg([f"results_dir={tmp_path / 'x'}", "runner=local", "num_gpus=[16]"])
    spec = to_sweep(cfg_local)
    run_grid(spec, LocalExecutor(), local, batch_size=300, progress=False)
    got = sorted_rows(tmp_path / "default").drop(columns="run_id")
    assert evaluated == len(got) > 0
    pd.testing.assert_frame_equal(got, sorted_rows(local.root).drop(columns="run_id"))


def test_rerun_skips_everything(tmp_path):
    spec = small_spec()
    store = ResultStore(tmp_path / "s")
    first = run_grid(spec, LocalExecutor(), store, batch_size=700, progress=False)
    parts = store.parts()
    second = run_grid(spec, LocalExecutor(), store, batch_size=700, progress=False)
    assert first.evaluated == first.valid > 0
    assert second.evaluated == 0 and second.skipped == first.valid
    assert store.parts() == parts


def test_resume_refuses_rows_hashed_by_another_scheme(tmp_path):
    """Parts written under an older config-hash definition are not silently re-evaluated (that
    would store every plan twice); trace selection still rewrites them under their scheme."""
    import pyarrow.parquet as pq

    from stage_dse.errors import StageDseError

    spec = small_spec(gpus=(16,))
    store = ResultStore(tmp_path / "s")
    run_grid(spec, LocalExecutor(), store, progress=False)
    part = store.parts()[0]
    table = pq.read_table(part)
    old = table.replace_schema_metadata({b"stage_dse.hash_scheme": b"1"})
    pq.write_table(old, part)
    h = table.column("config_hash")[0].as_py()
    assert store.set_column("trace_dir", {h: "x"}) == 1
    assert pq.read_schema(part).metadata[b"stage_dse.hash_scheme"] == b"1"
    from stage_dse.results.schema import HASH_SCHEME

    with pytest.raises(StageDseError, match=rf"hash scheme 1, this one uses {HASH_SCHEME}.*name"):
        run_grid(spec, LocalExecutor(), store, progress=False)
    assert store.parts() == [part]


def test_rows_of_another_cost_model_are_refused_or_replaced(tmp_path):
    """Parts record the cost model that evaluated them: resuming over rows of another version
    stops (they would sit beside new numbers); replace_stale deletes those parts and evaluates
    their configurations again, with no duplicate and no row of the old model left."""
    import pyarrow.parquet as pq

    from stage_dse.cost.compile import model_digest
    from stage_dse.errors import StageDseError

    spec = small_spec(gpus=(16, 32))
    store = ResultStore(tmp_path / "s")
    first = run_grid(spec, LocalExecutor(), store, batch_size=400, progress=False)
    parts = store.parts()
    old = parts[0]
    table = pq.read_table(old)
    meta = {**table.schema.metadata, b"stage_dse.cost_model": b"0123456789abcdef"}
    pq.write_table(table.replace_schema_metadata(meta), old)
    with pytest.raises(StageDseError, match=r"cost model 0123456789abcdef.*replace_stale=true"):
        run_grid(spec, LocalExecutor(), store, progress=False)
    fresh = ResultStore(tmp_path / "s", replace_stale=True)
    again = run_grid(spec, LocalExecutor(), fresh, batch_size=400, progress=False)
    assert again.evaluated == len(table) and again.skipped == first.valid - len(table)
    df = load(store.root)
    assert len(df) == first.valid and df["config_hash"].is_unique
    digests = {pq.read_schema(p).metadata[b"stage_dse.cost_model"] for p in store.parts()}
    assert digests == {model_digest().encode()} and old not in store.parts()


def test_sigkill_mid_sweep_then_rerun_loses_and_duplicates_nothing(tmp_path):
    args = [
        sys.executable,
        "-m",
        "stage_dse.cli",
        f"results_dir={tmp_path}",
        "runner=local",
        "runner.batch_size=400",
        "runner.progress=false",
        "plan=wide",
        "num_gpus=[32,64]",
        "sweep_name=killed",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = tmp_path / "killed"
    deadline = time.time() + 240
    while time.time() < deadline and len(list(root.glob("part-*.parquet"))) < 3:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    parts_at_kill = len(list(root.glob("part-*.parquet")))
    assert parts_at_kill >= 3
    cfg = compose_cfg(
        [f"results_dir={tmp_path}", "plan=wide", "num_gpus=[32,64]", "sweep_name=killed"]
    )
    table, _, _ = build_table(to_sweep(cfg))
    assert parts_at_kill < len(table) / 400  # it was killed mid-way
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    df = load(root)
    from stage_dse.results import config_hash

    assert df["config_hash"].is_unique
    assert set(df["config_hash"]) == set(config_hash(table))
    assert not list(root.glob(".tmp-*"))


def test_optuna_prunes_infeasible_trials_and_resumes(tmp_path):
    import optuna

    base = [
        f"results_dir={tmp_path}",
        "search=optuna",
        "search.batch_size=40",
        "runner=local",
        "runner.progress=false",
        "model=llama3_70b",
        "num_gpus=[64,128,256]",
        "sweep_name=opt",
        "training.global_batch_size=512",
        "search.seed=1",
    ]
    run(compose_cfg([*base, "search.n_trials=120"]))
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "opt" / "_optuna.journal"))
    )
    study = optuna.load_study(study_name="opt", storage=storage)
    new = [t for t in study.trials if "repeat_of" not in t.user_attrs]
    states = pd.Series([t.state.name for t in new]).value_counts()
    # the budget counts distinct configurations; a repeated proposal is told, not evaluated
    assert len(new) == 120
    assert len({t.user_attrs["config_hash"] for t in new}) == 120
    assert states.get("PRUNED", 0) > 0 and states.get("COMPLETE", 0) > 0
    # every trial is a valid plan: the space offers each axis only the values that keep a
    # valid plan of the enumeration (26% of trials were invalid plans on a wide space before)
    assert states.get("FAIL", 0) == 0
    pruned = [t for t in new if t.state.name == "PRUNED"]
    assert all("GiB > usable" in t.user_attrs["reason"] for t in pruned)
    df = load(tmp_path / "opt")
    assert df["config_hash"].is_unique and len(df) == 120
    assert set(df["config_hash"]) == {t.user_attrs["config_hash"] for t in new}
    assert set(df["status"]) == {"ok", "infeasible"}
    assert (df["num_gpus"] % (df["tp"] * df["pp"] * df["cp"]) == 0).all()
    assert (512 % (df["dp"] * df["micro_batch"]) == 0).all()
    infeasible = df[df["status"] == "infeasible"]
    assert len(infeasible) > 0 and infeasible["step_s"].isna().all()  # never fully evaluated
    assert (df.loc[df["status"] == "ok", "step_s"] > 0).all()
    # resume: the same study continues to 160 distinct configurations
    run(compose_cfg([*base, "search.n_trials=160"]))
    study = optuna.load_study(study_name="opt", storage=storage)
    assert sum("repeat_of" not in t.user_attrs for t in study.trials) == 160
    df = load(tmp_path / "opt")
    assert df["config_hash"].is_unique and len(df) == 160


def test_multi_objective_optuna_uses_nsga2(tmp_path, capsys):
    import optuna

    cfg = compose_cfg(
        [
            f"results_dir={tmp_path}",
            "search=optuna",
            "search.n_trials=40",
            "search.batch_size=20",
            "search.objectives=[step_s,num_gpus,mem_total_bytes]",
            "num_gpus=[16,32,64]",
            "runner=local",
            "runner.progress=false",
            "sweep_name=mo",
        ]
    )
    run(cfg)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "mo" / "_optuna.journal"))
    )
    study = optuna.load_study(study_name="mo", storage=storage)
    assert len(study.directions) == 3 and len(study.best_trials) >= 1
    # the summary answers with the Pareto front (no plan in it dominated by another)
    out = capsys.readouterr().out
    assert "Pareto front over step_s, num_gpus, mem_total_bytes" in out
    assert "top 10 fastest" not in out


@pytest.mark.parametrize("name", SWEEPS)
def test_every_named_sweep_composes(name):
    cfg = compose_cfg([f"+sweep={name}"])
    spec = to_sweep(cfg)
    assert spec.name == name
    table, candidates, _ = build_table(spec)
    assert candidates > 0 and len(table) > 0


def test_at_least_three_named_sweeps():
    assert {"llama3_70b_h100_1024", "gpt3_175b_budget", "llama3_405b_16k"} <= set(SWEEPS)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (["model=llama3_70b", "plan.tp=3"], "plan.tp=3: tp(3) does not divide heads(64)"),
        (["model=llama5_1t"], "Could not find 'model/llama5_1t'; valid model: "),
        (["num_gpus=[-8]"], "num_gpus values must be integers > 0, got -8"),
        (["cluster.num_gpus=abc"], "cluster.num_gpus=abc"),
        (["hardware.hbm_tb_s=0"], "hardware.hbm_tb_s must be > 0"),
        (["runner.kind=slurm"], "runner.kind='slurm' is not one of: auto, local, ray"),
        (["+plan.tpp=[2]"], "plan.tpp is not a plan option (known: tp, pp, cp"),
        (["+foo=1"], "foo is not an option (top-level options: budget"),
    ],
)
def test_bad_overrides_exit_with_one_line(tmp_path, override, needle):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stage_dse.cli",
            f"results_dir={tmp_path}",
            "runner=local",
            *override,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("stage-dse: error: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_default_sweep_output_and_parquet(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stage_dse.cli",
            f"results_dir={tmp_path}",
            "runner=local",
            "runner.progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "valid plans of" in proc.stdout and "top 10 fastest feasible plans" in proc.stdout
    assert "plans rejected before evaluation, by rule" in proc.stdout
    df = pd.read_parquet(tmp_path / "default")
    assert len(df) > 1000 and df["config_hash"].is_unique
    assert {"step_s", "mfu", "mem_total_bytes", "trace_dir", "package_version"} <= set(df.columns)


def test_budget_mode_reports_closest_misses(tmp_path, capsys):
    cfg = compose_cfg(
        [
            f"results_dir={tmp_path}",
            "runner=local",
            "runner.progress=false",
            "model=llama3_70b",
            "mode=budget",
            "budget.memory_gib=40",
            "budget.max_gpus=64",
            "budget.rank_by=gpu_seconds",
            "sweep_name=budget",
        ]
    )
    spec = to_sweep(cfg)
    assert spec.gpu_counts == (1, 2, 4, 8, 16, 32, 64)
    run(cfg)
    df = load(tmp_path / "budget")
    assert (df["usable_memory"] == 40 * 2**30).all()
    ok = df[df["status"] == "ok"]
    assert (ok["mem_total_bytes"] <= 40 * 2**30).all() and len(ok) > 0
    assert (df["status"] == "infeasible").any()
    out = capsys.readouterr().out
    assert "cheapest (GPU-seconds per step)" in out and " gpu_s " in out  # the key is shown
    assert "memory judged against: 40.0 GiB usable" in out
    assert "GPU counts tried (budget.max_gpus=64): 1, 2, 4, 8, 16, 32, 64 (powers of two" in out


def test_analysis_helpers(tmp_path):
    spec = small_spec(gpus=(8, 16, 32))
    store = ResultStore(tmp_path / "a")
    run_grid(spec, LocalExecutor(), store, progress=False)
    ok = load(store.root, filters=[("status", "==", "ok")])
    assert set(ok["status"]) == {"ok"}
    front = pareto(ok, ["step_s", "mem_total_bytes"])
    for r in front.itertuples():  # nothing is at least as good on both and better on one
        better = ok[(ok.step_s <= r.step_s) & (ok.mem_total_bytes <= r.mem_total_bytes)]
        strictly = better[(better.step_s < r.step_s) | (better.mem_total_bytes < r.mem_total_bytes)]
        assert len(strictly) == 0
    assert front["step_s"].is_monotonic_increasing
    best = best_per(ok, "num_gpus")
    assert list(best["num_gpus"]) == [8, 16, 32]
    for r in best.itertuples():
        assert r.step_s == ok[ok.num_gpus == r.num_gpus]["step_s"].min()


def test_plot_writes_pngs(tmp_path):
    from stage_dse.cli.plot import main as plot_main

    store = ResultStore(tmp_path / "p")
    run_grid(small_spec(), LocalExecutor(), store, progress=False)
    assert plot_main([str(store.root), "--out", str(tmp_path / "png")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert pngs == ["memory_breakdown.png", "pareto_time_memory.png", "step_time_vs_gpus.png"]
    for p in (tmp_path / "png").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_error_rows_when_a_batch_fails(tmp_path, monkeypatch):
    """A batch whose evaluation raises is recorded as error rows with the exception text."""
    import stage_dse.runner.sweep as sweep_mod

    calls = {"n": 0, "failed_rows": 0}
    real = sweep_mod.evaluate_part

    def flaky(block, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            calls["failed_rows"] = block.stop - block.start
            raise RuntimeError("worker exploded")
        return real(block, *args)

    monkeypatch.setattr(sweep_mod, "evaluate_part", flaky)
    store = ResultStore(tmp_path / "e")
    report = run_grid(small_spec(), LocalExecutor(), store, batch_size=500, progress=False)
    df = load(store.root)
    errors = df[df["status"] == "error"]
    failed = calls["failed_rows"]
    assert failed > 0 and len(errors) == failed and report.status["error"] == failed
    assert (errors["reason"] == "RuntimeError: worker exploded").all()
    assert len(df) == report.valid and df["config_hash"].is_unique


def test_summary_covers_only_the_rows_of_this_run(tmp_path, capsys):
    """Two runs into one results folder (Llama-3-8B, then Llama-3-70B): the second run's top
    table lists only 70B plans and says how many other rows it left out."""
    common = [
        f"results_dir={tmp_path}",
        "runner=local",
        "runner.progress=false",
        "sweep_name=shared",
        "num_gpus=[64]",
        "plan.tp=[8]",
        "plan.micro_batch_size=[1]",
        "plan.zero_stage=[1]",
    ]
    run(compose_cfg([*common, "model=llama3_8b"]))
    capsys.readouterr()
    run(compose_cfg([*common, "model=llama3_70b"]))
    out = capsys.readouterr().out
    top = out.split("feasible plans:")[1].strip().splitlines()
    rows = [line for line in top[1:] if line.strip() and not line.startswith("tie:")]
    assert rows and all(line.split()[0] == "llama3_70b" for line in rows)
    df = load(tmp_path / "shared")
    others = int((df["model"] == "llama3_8b").sum())
    assert others > 0 and f"{others:,} other rows in the folder are not shown" in out


def test_plot_keeps_questions_apart_and_serving_rows_in_their_own_figure(tmp_path):
    """Training runs of two sequence lengths and a serving run in one folder: the plots draw
    one series per question and do not trip over serving rows (which have no step time)."""
    from stage_dse.results.plots import plot_results

    common = [f"results_dir={tmp_path}", "runner=local", "runner.progress=false"]
    common += ["sweep_name=mixed", "num_gpus=[8]", "plan.micro_batch_size=[1]"]
    for seq in (2048, 4096):
        run(compose_cfg([*common, f"training.seq_len={seq}"]))
    serving = [*common, "workload=serving", "serving.batch_size=[1]"]
    with pytest.raises(StageDseError, match="holds training results; serving results go"):
        run(compose_cfg(serving))  # a sweep never mixes them
    run(compose_cfg([*serving, "sweep_name=srv"]))
    for part in (tmp_path / "srv").glob("part-*.parquet"):  # a user merging folders by hand
        shutil.copy(part, tmp_path / "mixed" / part.name)
    df = load(tmp_path / "mixed")
    assert set(df["workload"].astype(str)) == {"training", "serving"}
    files = plot_results(tmp_path / "mixed", tmp_path / "png")
    assert [f.name for f in files] == [
        "serving_pareto.png",  # serving rows get their own figure
        "step_time_vs_gpus.png",
        "pareto_time_memory.png",
        "memory_breakdown.png",
    ]
    assert all(f.stat().st_size > 0 for f in files)


def test_repeated_axis_values_are_one_value(tmp_path, capsys):
    """``num_gpus=[16,16]`` stores each configuration once (not every row twice) and the
    summary says the repeat was merged; a repeated serving axis likewise; through the Python
    API, a repeated GPU count, model or hardware is evaluated once."""
    common = [f"results_dir={tmp_path}", "runner=local", "runner.progress=false"]
    once = run(compose_cfg([*common, "sweep_name=once", "num_gpus=[16]"]))
    capsys.readouterr()
    twice = run(compose_cfg([*common, "sweep_name=twice", "num_gpus=[16,16]", "top_k=3"]))
    out = capsys.readouterr().out
    assert twice == once > 0
    df = load(tmp_path / "twice")
    assert len(df) == once and df["config_hash"].is_unique
    assert "repeated values are one value: num_gpus=[16,16] is [16]" in out
    assert f"evaluated {once:,} in" in out

    run(compose_cfg([*common, "sweep_name=sv", "workload=serving", "serving.batch_size=[8,8,1]"]))
    out = capsys.readouterr().out
    assert "serving.batch_size=[8,8,1] is [8,1]" in out
    sv = load(tmp_path / "sv")
    assert sv["config_hash"].is_unique and set(sv["global_batch"]) == {8, 1}

    spec = small_spec(gpus=(16, 16))
    spec = replace(spec, models=spec.models * 2, hardware=spec.hardware * 2)
    logged: list[str] = []
    report = run_grid(
        spec, LocalExecutor(), ResultStore(tmp_path / "api"), progress=False, log=logged.append
    )
    single = run_grid(
        small_spec(gpus=(16,)), LocalExecutor(), ResultStore(tmp_path / "api1"), progress=False
    )
    assert report.valid == report.evaluated == single.valid
    assert load(tmp_path / "api")["config_hash"].is_unique
    assert any(line.startswith("note: repeated values are one value: num_gpus") for line in logged)


def test_memory_line_of_an_optuna_codesign_run_names_each_capacity(tmp_path, capsys):
    run(
        compose_cfg(
            [
                f"results_dir={tmp_path}",
                "search=optuna",
                "search.n_trials=8",
                "search.batch_size=8",
                "search.hbm_gib=[40,141]",
                "num_gpus=[16]",
                "runner=local",
                "runner.progress=false",
            ]
        )
    )
    out = capsys.readouterr().out
    hw = load_hardware("h100_sxm")
    shown = ", ".join(f"{g - hw.memory_reserve_bytes / 2**30:.1f}" for g in (40, 141))
    line = f"memory judged against: {shown} GiB usable per h100_sxm GPU (search.hbm_gib=[40,141])"
    assert line in out


def test_top_table_marks_ties_and_lists_more_headroom_first(tmp_path):
    """Step times within 0.1% tie (a shared rank, ``2=``); among them the plan with more memory
    headroom comes first; plans further apart keep their order and no tie mark."""
    from stage_dse.runner.sweep import TIE_REL

    spec = small_spec(gpus=(16,))
    run_grid(spec, LocalExecutor(), ResultStore(tmp_path / "r"), progress=False)
    ok = load(tmp_path / "r").query("status == 'ok'").head(5).copy()
    ok["step_s"] = [1.0, 1.5, 1.5 * (1 + TIE_REL / 2), 1.5 * (1 + TIE_REL * 0.9), 2.0]
    ok["mem_headroom_bytes"] = [g * 2**30 for g in (5.0, 1.0, 3.0, 2.0, 9.0)]
    table = top_table(ok, 5)
    assert list(table["tie"]) == ["", "2=", "2=", "2=", ""]
    assert list(table["headroom_gib"]) == [5.0, 3.0, 2.0, 1.0, 9.0]
    assert list(top_table(ok, 2)["tie"]) == ["", "2="]  # the group's best by headroom
    apart = ok.assign(step_s=[1.0, 1.1, 1.2, 1.3, 1.4])
    assert "tie" not in top_table(apart, 5).columns


def test_auto_moves_the_rest_of_a_run_to_ray_when_the_projection_says_so(
    tmp_path, ray_shutdown, monkeypatch
):
    """With Ray's start and extra CPU per plan projected as free, runner=auto measures two
    blocks here and evaluates the rest on Ray (the stored hashes of a resumed run travel
    through the object store): every configuration is stored once, and the summary says
    where and why."""
    import stage_dse.runner.executors as ex

    monkeypatch.setattr(ex, "RAY_START_S", 0.0)
    monkeypatch.setattr(ex, "RAY_CPU_FACTOR", 0.01)
    monkeypatch.setattr(ex, "AUTO_MEASURE_CPU_S", 0.0)
    store = ResultStore(tmp_path / "a")
    run_grid(small_spec(gpus=(16,)), LocalExecutor(), store, batch_size=300, progress=False)
    executor = ex.AutoExecutor(num_cpus=2)
    try:
        report = run_grid(small_spec(), executor, store, batch_size=300, progress=False)
    finally:
        executor.close()
    df = load(store.root)
    assert isinstance(executor.inner, ex.RayExecutor)
    assert (
        report.runner.startswith("ray (runner=auto: ")
        and "switched to Ray after 600" in report.runner
    )
    assert len(df) == report.valid and df["config_hash"].is_unique
    assert report.summary.rows == report.valid and report.summary.reused > 0
    pd.testing.assert_frame_equal(top_table(report.summary.candidates(), 10), top_table(df, 10))
