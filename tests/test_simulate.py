"""The simulator farm: ``stage-dse-trace simulate`` over small results folders.

The replay backend always; simulators that crash, hang, print nothing or lose ranks as fake
binaries (failed rows with their reasons, never lost rows); resumability without duplicates;
the generated ASTRA-sim inputs; and, when ``STAGE_DSE_ASTRA_BIN`` names a folder of built
ASTRA-sim binaries, two small sets through both analytical backends."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import gpt
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.cli.trace import main as trace_main
from stage_dse.config import load_cluster, load_hardware
from stage_dse.errors import ConfigError
from stage_dse.results import ResultStore, load
from stage_dse.results.sim import SimStore, load_sim
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import TrainingSpec
from stage_dse.trace.astra_config import (
    ASTRA_BACKENDS,
    astra_config,
    mistimed_neighbours,
    network_dims,
    network_yaml,
)
from stage_dse.trace.simulate import ASTRA_BIN_ENV, simulate

H100 = load_hardware("h100_sxm")
DGX = load_cluster("dgx_h100")
QUIET = {"log": lambda s: None}


def _results(path: Path, gpus: int) -> Path:
    spec = SweepSpec(
        name="sim",
        models=(gpt(layers=4, hidden=256, heads=4, vocab=1024),),
        training=TrainingSpec(seq_len=128, global_batch_size=8),
        hardware=(H100,),
        cluster=DGX,
        gpu_counts=(gpus,),
        space=SearchSpace(micro_batch_size=(1,), virtual_stages=(1,), recompute=("none",)),
    )
    store = ResultStore(path)
    run_grid(spec, LocalExecutor(), store, batch_size=100, progress=False)
    return store.root


@pytest.fixture(autouse=True)
def _no_astra_from_the_environment(monkeypatch):
    """The default backends depend on the environment: the tests say which they mean."""
    monkeypatch.delenv(ASTRA_BIN_ENV, raising=False)


@pytest.fixture(scope="module")
def results8(tmp_path_factory):
    return _results(tmp_path_factory.mktemp("r8") / "sim", 8)


@pytest.fixture
def fresh8(tmp_path):
    return _results(tmp_path / "sim", 8)


# ------------------------------------------------------------------------ the replay backend
def test_replay_backend_stores_one_row_per_selected_row(fresh8):
    summary = simulate(fresh8, top=3, **QUIET)
    assert summary.ok == 3 and summary.failed == 0 and summary.written_sets == 3
    df = load_sim(fresh8)
    assert len(df) == 3 and set(df["sim_backend"]) == {"replay"}
    best3 = load(fresh8).query("status == 'ok'").sort_values("step_s").head(3)
    assert set(df["config_hash"]) == set(best3["config_hash"])
    assert (df["sim_status"] == "ok").all() and df["sim_reason"].isna().all()
    assert (df["sim_finished_ranks"] == 8).all() and (df["sim_ranks"] == 8).all()
    assert (df["sim_ratio"] - df["sim_step_s"] / df["step_s"]).abs().max() < 1e-12
    # the trace sets are recorded on the result rows as `select` records them
    assert (df["trace_dir"] == "_traces/" + df["config_hash"]).all()
    assert (df["trace_replay_s"] == df["sim_step_s"]).all()
    for log_path in df["sim_log_path"]:
        assert (fresh8 / log_path).read_text().startswith("replay_step_s=")
    # the dataset stays out of the results folder's own reading
    assert len(load(fresh8)) == len(ResultStore(fresh8).read())


def test_rerun_skips_what_is_stored_and_never_duplicates(fresh8):
    simulate(fresh8, top=2, **QUIET)
    lines: list[str] = []
    again = simulate(fresh8, top=4, log=lines.append)
    assert again.skipped == 2 and again.ok == 2 and again.written_sets == 2
    assert any("2 (row, backend) runs already stored" in ln for ln in lines)
    third = simulate(fresh8, top=4, **QUIET)
    assert third.skipped == 4 and third.ok == 0
    sim = SimStore(fresh8).read()
    assert len(sim) == 4 and not sim.duplicated(["config_hash", "sim_backend"]).any()
    assert len(load_sim(fresh8)) == 4


def test_an_existing_trace_set_is_reused(fresh8):
    from stage_dse.trace.select import select_and_write

    (h,) = select_and_write(fresh8, top=1, **QUIET)
    before = (fresh8 / "_traces" / h / "trace.0.et").stat().st_mtime_ns
    summary = simulate(fresh8, hashes=[h], **QUIET)
    assert summary.written_sets == 0 and summary.ok == 1
    assert (fresh8 / "_traces" / h / "trace.0.et").stat().st_mtime_ns == before


def test_a_set_that_does_not_replay_is_a_failed_row(fresh8):
    from stage_dse.trace.select import select_and_write

    (h,) = select_and_write(fresh8, top=1, **QUIET)
    (fresh8 / "_traces" / h / "trace.5.et").unlink()
    summary = simulate(fresh8, hashes=[h], **QUIET)
    assert summary.failed == 1
    (row,) = SimStore(fresh8).read().to_dict("records")
    assert row["sim_status"] == "failed" and "rank files missing" in row["sim_reason"]
    assert row["sim_step_s"] is None or row["sim_step_s"] != row["sim_step_s"]  # None / NaN


def test_simulation_refuses_sets_above_max_bytes(fresh8):
    with pytest.raises(ConfigError, match="above --max-bytes"):
        simulate(fresh8, top=5, max_bytes=1000, **QUIET)
    assert not (fresh8 / "_traces").exists() and SimStore(fresh8).read().empty


def test_simulation_on_ray_workers(fresh8):
    from stage_dse.runner.executors import RayExecutor

    executor = RayExecutor(num_cpus=os.cpu_count() or 1)
    try:
        summary = simulate(fresh8, top=3, executor=executor, **QUIET)
    finally:
        executor.close()
    assert summary.ok == 3 and summary.task_cpu_s > 0
    assert len(SimStore(fresh8).read()) == 3


# ------------------------------------------------------------------- simulators that go wrong
FAKE = {
    "crash": "print('sys[0] finished, 1000 cycles, exposed communication 0 cycles.')\n"
    "print('malloc(): corrupted top size', file=sys.stderr)\nsys.stdout.flush()\n"
    "os.kill(os.getpid(), signal.SIGABRT)\n",
    "hang": "time.sleep(120)\n",
    "nothing": "sys.exit(0)\n",
    "partial": "for r in range(ranks // 2):\n"
    "    print(f'sys[{r}] finished, {1000 + r} cycles, exposed communication 0 cycles.')\n",
    "good": "for r in range(ranks):\n"
    "    print(f'[workload] [info] sys[{r}] finished, {2000000 + r} cycles, exposed "
    "communication 0 cycles.')\n",
}
FAKE_HEAD = (
    f"#!{sys.executable}\nimport os, signal, sys, time\nfrom pathlib import Path\n"
    "w = next(a for a in sys.argv if a.startswith('--workload-configuration='))\n"
    "prefix = Path(w.split('=', 1)[1])\n"
    "ranks = len(list(prefix.parent.glob(prefix.name + '.*.et')))\n"
)


def fake_astra(folder: Path, behaviour: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for exe in ASTRA_BACKENDS.values():
        p = folder / exe
        p.write_text(FAKE_HEAD + FAKE[behaviour])
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.mark.parametrize(
    "behaviour,words",
    [
        ("crash", ["signal SIGABRT after 1 of 8 ranks finished", "malloc"]),
        ("hang", ["timed out after 1 s (0 of 8 ranks finished)"]),
        ("nothing", ["printed nothing (exit code 0)"]),
        ("partial", ["4 of 8 ranks finished", "exits 0 on a deadlock"]),
    ],
)
def test_a_failing_simulator_is_a_failed_row_with_its_reason(results8, tmp_path, behaviour, words):
    import shutil

    res = tmp_path / "res"
    shutil.copytree(results8, res, ignore=shutil.ignore_patterns("_sim", ".writer.lock"))
    folder = fake_astra(tmp_path / "bin", behaviour)
    summary = simulate(
        res, top=2, backends=["replay", "astra_unaware"], astra_bin=str(folder), timeout_s=1,
        **QUIET,
    )  # fmt: skip
    assert summary.failed == 2 and summary.ok == 2
    sim = load_sim(res)
    assert len(sim) == 4
    bad = sim[sim["sim_backend"] == "astra_unaware"]
    assert (bad["sim_status"] == "failed").all() and bad["sim_ratio"].isna().all()
    for reason, log_path in zip(bad["sim_reason"], bad["sim_log_path"]):
        for w in words:
            assert w in reason
        assert (res / log_path).is_file()
    assert (sim.loc[sim["sim_backend"] == "replay", "sim_status"] == "ok").all()


def test_retry_failed_replaces_the_failed_rows(results8, tmp_path):
    import shutil

    res = tmp_path / "res"
    shutil.copytree(results8, res, ignore=shutil.ignore_patterns("_sim", ".writer.lock"))
    crash = fake_astra(tmp_path / "crash", "crash")
    simulate(res, top=2, backends=["astra_aware"], astra_bin=str(crash), **QUIET)
    good = fake_astra(tmp_path / "good", "good")
    kept = simulate(res, top=2, backends=["astra_aware"], astra_bin=str(good), **QUIET)
    assert kept.skipped == 2 and kept.ok == 0  # failed rows count as simulated
    redo = simulate(
        res, top=2, backends=["astra_aware"], astra_bin=str(good), retry_failed=True, **QUIET
    )
    assert redo.ok == 2
    sim = SimStore(res).read()
    assert len(sim) == 2 and (sim["sim_status"] == "ok").all()
    assert (
        sim["sim_step_s"].tolist() == pytest.approx([2000007e-9] * 2)
        and (sim["sim_finished_ranks"] == 8).all()
    )


def test_default_backends_are_replay_and_each_binary_found(results8, tmp_path, monkeypatch):
    import shutil

    res = tmp_path / "res"
    shutil.copytree(results8, res, ignore=shutil.ignore_patterns("_sim", ".writer.lock"))
    folder = fake_astra(tmp_path / "bin", "good")
    (folder / ASTRA_BACKENDS["astra_aware"]).unlink()
    monkeypatch.setenv(ASTRA_BIN_ENV, str(folder))
    simulate(res, top=1, **QUIET)
    assert set(SimStore(res).read()["sim_backend"]) == {"replay", "astra_unaware"}
    run = next((res / "_sim" / "_runs").iterdir()) / "astra_unaware"
    assert {"network.yml", "system.json", "memory.json", "run.log"} <= {
        p.name for p in run.iterdir()
    }


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "args,words",
    [
        (["--backend", "astra_unaware"], "needs ASTRA-sim: give --astra-bin"),
        (["--backend", "ns3"], "--backend 'ns3' is not one of: replay"),
        (["--astra-bin", "/nonexistent/bin"], "not a folder"),
        (["--timeout-s", "0"], "--timeout-s must be > 0"),
        (["--top", "0"], "--top must be >= 1"),
        (["--max-bytes", "-3"], "--max-bytes '-3'"),
        (["--local", "--address", "auto"], "not allowed with argument"),
    ],
)
def test_simulate_bad_inputs_are_one_line(results8, capsys, args, words):
    argv = ["simulate", str(results8), *args]
    if "--address" not in args:
        argv.append("--local")
    assert trace_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stage-dse-trace: error: ") and words in err[0]


def test_simulate_cli(fresh8, capsys):
    assert trace_main(["simulate", str(fresh8), "--top", "2", "--local"]) == 0
    out = capsys.readouterr().out
    assert "2 runs ok, 0 failed" in out and "ratio" in out
    assert len(SimStore(fresh8).read()) == 2


# ---------------------------------------------------------------------- the generated inputs
def test_network_has_one_dimension_per_tier_in_the_simulators_units():
    one_node = network_dims(DGX, 8, "astra_unaware")
    assert [d.npus for d in one_node] == [8]
    two = network_dims(DGX, 32, "astra_unaware")
    assert [(d.tier, d.npus) for d in two] == [("nvlink", 8), ("scale_out", 4)]
    assert two[0].bandwidth_bytes_per_s == DGX.intra_bandwidth_bytes_per_s * DGX.intra_efficiency
    assert two[1].bandwidth_bytes_per_s == DGX.inter_bandwidth_bytes_per_s * DGX.inter_efficiency
    # a switch message crosses two links: each carries half the per-step latency
    assert two[0].latency_s * 2 == pytest.approx(DGX.intra_latency_s)
    text = network_yaml(two)
    gib = DGX.intra_bandwidth_bytes_per_s * DGX.intra_efficiency / 2**30
    assert f"bandwidth: [ {gib:.6f}," in text and "topology: [ Switch, Switch ]" in text
    assert f"latency: [ {DGX.intra_latency_s * 1e9 / 2:.3f}," in text
    # congestion-aware: one dimension, store and forward on two links at twice the rate
    (aware,) = network_dims(DGX, 32, "astra_aware")
    assert aware.npus == 32 and aware.tier == "scale_out"
    assert aware.bandwidth_bytes_per_s == 2 * two[1].bandwidth_bytes_per_s
    with pytest.raises(ConfigError, match="not whole nodes"):
        network_dims(DGX, 12, "astra_unaware")


def test_system_file_avoids_ring_all_to_all_and_takes_the_hardware_rates():
    conf = astra_config(H100, DGX, 16, "astra_unaware", compute="roofline")
    s = conf.system
    assert s["all-to-all-implementation"] == ["direct1", "direct1"]
    assert s["all-reduce-implementation"] == ["ring", "ring"]
    assert s["roofline-enabled"] == 1
    want = H100.peak_flops * H100.gemm_efficiency * H100.sustained_clock / 1e12
    assert s["peak-perf"] == pytest.approx(want)
    assert s["local-mem-bw"] == pytest.approx(
        H100.hbm_bandwidth_bytes_per_s * H100.memory_efficiency / 1e9
    )
    assert astra_config(H100, DGX, 16, "astra_unaware").system["roofline-enabled"] == 0


def test_notes_name_what_the_backend_cannot_place():
    groups = {1: list(range(16)), 2: list(range(8)), 3: [0, 2, 4, 6, 8, 10, 12, 14], 4: [0, 8]}
    notes = astra_config(H100, DGX, 16, "astra_unaware", groups=groups).notes
    assert any(n.startswith("2 communicator groups span nodes") for n in notes)
    assert any(n.startswith("1 groups have ring neighbours on different nodes") for n in notes)
    assert astra_config(H100, DGX, 8, "astra_unaware", groups={1: list(range(8))}).notes == []


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(2, 8),
    per_node=st.sampled_from([2, 4, 8]),
    local=st.integers(0, 7),
    node=st.integers(0, 7),
)
def test_groups_inside_a_node_or_at_one_local_index_are_timed_on_their_tier(
    nodes, per_node, local, node
):
    local, node = local % per_node, node % nodes
    ranks = nodes * per_node
    column = [n * per_node + local for n in range(nodes)]  # one GPU per node: the NIC
    row = [node * per_node + i for i in range(per_node)]  # one node: NVLink
    assert mistimed_neighbours({1: column, 2: row}, ranks, per_node) == 0
    if per_node > 1:
        skew = [n * per_node + (n + local) % per_node for n in range(nodes)]
        if len(set(skew)) == len(skew) and len(skew) < ranks:
            assert mistimed_neighbours({1: skew}, ranks, per_node) == 1


# --------------------------------------------------------------------------- with ASTRA-sim
ASTRA_BIN = os.environ.get(ASTRA_BIN_ENV)
needs_astra = pytest.mark.skipif(
    not ASTRA_BIN or not all((Path(ASTRA_BIN) / exe).is_file() for exe in ASTRA_BACKENDS.values()),
    reason=f"{ASTRA_BIN_ENV} does not name a folder of built ASTRA-sim analytical binaries "
    "(see README, Simulating selected rows)",
)


@needs_astra
@pytest.mark.parametrize("gpus", [8, 16])
def test_astra_sim_runs_two_small_sets(tmp_path, gpus):
    res = _results(tmp_path / "sim", gpus)
    summary = simulate(res, top=1, astra_bin=ASTRA_BIN, timeout_s=120, **QUIET)
    assert summary.failed == 0 and summary.ok == 3
    sim = load_sim(res)
    assert set(sim["sim_backend"]) == {"replay", "astra_unaware", "astra_aware"}
    assert (sim["sim_finished_ranks"] == gpus).all()
    unaware = sim[sim["sim_backend"] == "astra_unaware"].iloc[0]
    # a tiny model: latency-bound collectives without NCCL's base latency or protocols
    assert 0.5 < unaware["sim_ratio"] < 2.0
    log = (res / unaware["sim_log_path"]).read_text()
    assert log.count("finished,") == gpus
    run = (res / unaware["sim_log_path"]).parent
    assert json.loads((run / "system.json").read_text())["all-to-all-implementation"][0] == (
        "direct1"
    )
