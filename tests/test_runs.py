"""Trustworthy runs: one writer per results folder, corrupt parts, unwritable folders, runs
killed mid-way (Optuna journals)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_sweep import compose_cfg, small_spec

from stage_dse.cli import run
from stage_dse.cli.sweep import INTERRUPTED
from stage_dse.errors import StageDseError
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, build_table, run_grid

WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_sweep import small_spec
    from stage_dse.results import ResultStore
    from stage_dse.runner import LocalExecutor, run_grid
    run_grid(small_spec(gpus=(16, 32, 64)), LocalExecutor(), ResultStore({root!r}),
             batch_size=200, progress=False)
    """
)


def test_two_writers_on_one_folder_store_each_configuration_once(tmp_path):
    """Two sweeps started together on one folder: the second waits for the first (it says
    who holds the folder), then finds everything stored; no configuration twice."""
    root = tmp_path / "shared"
    code = WRITER.format(tests=os.path.dirname(__file__), root=str(root))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    df = load(root)
    table, _, _ = build_table(small_spec(gpus=(16, 32, 64)))
    assert df["config_hash"].is_unique and len(df) == len(table)
    waited = [o for o, _ in outs if "is being written by pid" in o]
    assert len(waited) == 1, outs


def test_second_writer_names_the_holder_and_waits(tmp_path):
    root = tmp_path / "held"
    holder = ResultStore(root)
    holder.acquire(log=lambda s: None)
    code = (
        "from stage_dse.results import ResultStore\n"
        f"s = ResultStore({str(root)!r}); s.acquire(); print('acquired', flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = proc.stdout.readline()
        assert f"{root} is being written by pid {os.getpid()} on " in first
        time.sleep(0.3)
        assert proc.poll() is None  # still waiting
    finally:
        holder.release()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "acquired" in out


def _damage(part: Path, damage: str) -> None:
    data = part.read_bytes()
    if damage == "empty":
        part.write_bytes(b"")
    elif damage == "truncated":
        part.write_bytes(data[: len(data) // 2])
    else:  # the pages of one column overwritten, the footer intact: only reading them fails
        import pyarrow.parquet as pq

        column = damage.split(":")[1]
        meta = pq.read_metadata(part).row_group(0)
        chunks = [meta.column(i) for i in range(meta.num_columns)]
        chunk = next(c for c in chunks if c.path_in_schema == column)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        size = chunk.total_compressed_size
        garbage = (bytes(range(251)) * (size // 251 + 1))[:size]
        part.write_bytes(data[:start] + garbage + data[start + size :])
        pq.read_metadata(part)  # still opens
        with pytest.raises(Exception):  # noqa: B017  (whichever arrow error the page gives)
            pq.read_table(part, columns=[column])


@pytest.mark.parametrize("damage", ["empty", "truncated", "pages:config_hash"])
def test_corrupt_part_is_quarantined_and_its_rows_evaluated_again(tmp_path, damage):
    root = tmp_path / "c"
    spec = small_spec()
    run_grid(spec, LocalExecutor(), ResultStore(root), batch_size=200, progress=False)
    before = load(root)
    part = sorted(root.glob("part-*.parquet"))[0]
    _damage(part, damage)
    lines: list[str] = []
    run_grid(
        spec, LocalExecutor(), ResultStore(root), batch_size=200, progress=False, log=lines.append
    )
    warning = next(line for line in lines if line.startswith("warning:"))
    assert part.name in warning and "_quarantine" in warning
    assert (root / "_quarantine" / part.name).is_file()
    after = load(root)
    assert after["config_hash"].is_unique
    assert set(after["config_hash"]) == set(before["config_hash"])


def test_unwritable_results_folder_is_refused_before_evaluating(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    store = ResultStore(blocker / "sweep")
    evaluated = []
    with pytest.raises(StageDseError, match=r"results folder .* is not writable"):
        run_grid(small_spec(), LocalExecutor(), store, progress=False, log=evaluated.append)
    assert not evaluated  # nothing was enumerated or evaluated


def test_optuna_rerun_after_a_killed_run(tmp_path):
    """A killed Optuna run leaves trials RUNNING and the journal's lock file behind: the rerun
    does not wait out the lock's grace period, fails those trials and does not count them."""
    import optuna

    base = [
        f"results_dir={tmp_path}",
        "search=optuna",
        "search.batch_size=20",
        "runner=local",
        "runner.progress=false",
        "num_gpus=[16,32]",
        "sweep_name=opt",
        "search.seed=3",
    ]
    run(compose_cfg([*base, "search.n_trials=20"]))
    journal = tmp_path / "opt" / "_optuna.journal"
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    study = optuna.load_study(study_name="opt", storage=storage)
    for _ in range(5):
        study.ask()  # as a killed run leaves them
    os.symlink(str(journal), str(journal) + ".lock")  # Optuna's lock, never released
    t0 = time.perf_counter()
    run(compose_cfg([*base, "search.n_trials=30"]))
    assert time.perf_counter() - t0 < 25  # Optuna's grace period is 30 s
    study = optuna.load_study(study_name="opt", storage=storage)
    states = [t.state.name for t in study.trials]
    assert "RUNNING" not in states
    abandoned = [t for t in study.trials if "abandoned" in str(t.user_attrs.get("reason", ""))]
    assert len(abandoned) == 5
    repeats = [t for t in study.trials if "repeat_of" in t.user_attrs]
    assert len(study.trials) - len(abandoned) - len(repeats) == 30


def test_ray_processes_end_after_the_driver_is_killed(tmp_path):
    """kill -9 of a sweep running on its embedded Ray: within seconds no process the driver
    started (GCS, raylet, agents, workers) is left."""
    from stage_dse.runner.reaper import descendants

    args = [sys.executable, "-m", "stage_dse.cli", f"results_dir={tmp_path}", "runner=ray"]
    args += ["runner.progress=false", "plan=wide", "num_gpus=[32,64]", "sweep_name=k"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    started: set[int] = set()
    while time.time() < deadline and not list((tmp_path / "k").glob("part-*.parquet")):
        started |= descendants(proc.pid)
        time.sleep(0.2)
    started |= descendants(proc.pid)
    assert any(b"raylet" in _cmdline(p) for p in started), "Ray never started"
    os.kill(proc.pid, 9)
    proc.wait()
    deadline = time.time() + 20
    while time.time() < deadline and [p for p in started if _running(p)]:
        time.sleep(0.5)
    left = [(p, _cmdline(p)[:80]) for p in started if _running(p)]
    assert not left, left


def test_nothing_to_evaluate_starts_no_ray(tmp_path):
    from stage_dse.runner import RayExecutor

    spec = small_spec(gpus=(16,))
    run_grid(spec, LocalExecutor(), ResultStore(tmp_path / "r"), progress=False)
    executor = RayExecutor(num_cpus=1)
    report = run_grid(spec, executor, ResultStore(tmp_path / "r"), progress=False)
    assert report.evaluated == 0 and executor._ray is None  # never started
    executor.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def test_multirun_jobs_are_validated_before_any_runs(tmp_path):
    """``-m 'num_gpus=[-8],[64]'``: the bad job is reported in one line and the good one is not
    started (nothing is written)."""
    proc = subprocess.run(
        ["stage-dse", "-m", "num_gpus=[-8],[64]", f"results_dir={tmp_path}", "runner=local"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "job num_gpus=[-8]" in err[0] and "num_gpus" in err[0]
    assert not list(tmp_path.rglob("part-*.parquet"))


def test_yaml_error_names_file_line_and_column(tmp_path, monkeypatch):
    from stage_dse.cli._common import precheck
    from stage_dse.config import conf_dir

    bad = Path(conf_dir()).parent / "sweeps" / "zz_broken_for_test.yaml"
    bad.write_text("num_gpus: [64\n  oops: : x\n")
    try:
        message = precheck(["+sweep=zz_broken_for_test"])
    finally:
        bad.unlink()
    assert message.startswith(f"{bad}:2:") and "expected" in message


def test_hydra_keeps_run_configs_beside_the_results_not_in_the_working_directory(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run(
        ["stage-dse", f"results_dir={tmp_path / 'res'}", "runner=local", "num_gpus=[8]",
         "runner.progress=false", "plan.micro_batch_size=[1]"],
        cwd=work, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert not list(work.iterdir())  # nothing written where the user stands
    (run_dir,) = (tmp_path / "res" / "default" / "_runs").iterdir()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "memory judged against: 78.0 GiB usable per h100_sxm GPU" in proc.stdout


def test_load_of_a_missing_folder_is_an_error(tmp_path):
    with pytest.raises(StageDseError, match="is not a results folder"):
        load(tmp_path / "typo")


def test_help_lists_groups_and_main_options():
    proc = subprocess.run(["stage-dse", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert len(lines) < 40 and lines[0].startswith("usage: stage-dse")
    for needle in ("model ", "llama3_8b", "runner ", "num_gpus=", "+sweep=NAME", "-m "):
        assert any(needle in line for line in lines), needle


def test_evaluate_plan_names_its_outputs_as_the_result_columns(tmp_path):
    """The API and the Parquet rows share names and values: a stored row re-evaluated with
    evaluate_plan gives the same numbers under the same column names."""
    from stage_dse.cli.trace import config_from_row
    from stage_dse.cost.bind import evaluate_plan
    from stage_dse.results.schema import RESULT_SCHEMA

    run_grid(small_spec(gpus=(16,)), LocalExecutor(), ResultStore(tmp_path / "r"), progress=False)
    df = load(tmp_path / "r")
    row = df[df["status"] == "ok"].sort_values("step_s").iloc[0]
    cfg = config_from_row(row)
    got = evaluate_plan(
        cfg.model, cfg.training, cfg.plan, hardware=cfg.hardware, cluster=cfg.cluster
    )
    columns = set(RESULT_SCHEMA.names)
    shared = [k for k in got if k in columns]
    for name in ("step_s", "mfu", "mem_total_bytes", "model_flops", "comm_dp_bytes", "params"):
        assert name in shared
    for old in ("time_step_s", "mem_total", "flops_model", "params_total", "comm_total"):
        assert old not in got  # the evaluator's internal names stay internal
    for name in shared:
        assert got[name] == pytest.approx(float(row[name]), rel=1e-9, nan_ok=True), name


def test_import_pulls_neither_ray_nor_optuna_nor_matplotlib():
    code = (
        "import sys, stage_dse, stage_dse.cost.bind, stage_dse.cost.table, stage_dse.runner\n"
        "print(sorted(m for m in ('ray', 'optuna', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_auto_runner_evaluates_small_sweeps_in_process_and_says_why(tmp_path, capsys):
    from test_sweep import compose_cfg as compose

    run(compose([f"results_dir={tmp_path}", "runner.progress=false", "num_gpus=[16]"]))
    out = capsys.readouterr().out
    assert "runner: local (runner=auto: " in out
    assert "all evaluated here while measuring their cost" in out and "us per plan" in out
    import ray

    assert not ray.is_initialized()


def test_auto_runner_projects_from_the_measured_cost_and_the_cores(monkeypatch):
    """Ray pays only when its start and its extra CPU per plan are repaid by the cores: never
    on one core, past some 22 s of work here on two (a million plans at ~5 us stay here),
    sooner on many; a cluster address is always Ray."""
    from stage_dse.runner.executors import (
        RAY_CPU_FACTOR,
        RAY_START_S,
        AutoExecutor,
        LocalExecutor,
        RayExecutor,
        ray_projection,
    )

    here, ray = ray_projection(1_000_000, 5e-6, cores=2)
    assert here == pytest.approx(5.0)
    assert ray == pytest.approx(RAY_START_S + 5.0 * RAY_CPU_FACTOR / 2) and ray > here
    one = ray_projection(10**9, 5e-6, cores=1)
    assert one[1] > one[0]  # one core: Ray only adds
    two = ray_projection(10_000_000, 5e-6, cores=2)
    assert two[1] < two[0]  # 50 s of work: Ray's second core repays its start
    many = ray_projection(2_000_000, 5e-6, cores=16)
    assert many[1] < many[0]

    auto = AutoExecutor(num_cpus=2)
    assert auto.choose(10**7).startswith("local (runner=auto: 10,000,000 plans: in this process")
    assert isinstance(auto.inner, LocalExecutor)
    auto.observe(100_000, 0.4)
    auto.observe(100_000, 0.4)  # 4 us per plan: 9.8M plans left, 39 s here, ~36 s on Ray
    started = []
    monkeypatch.setattr(RayExecutor, "start", lambda self: started.append(self) or "Ray")
    assert auto._decide() and isinstance(auto.inner, RayExecutor) and started
    assert "switched to Ray after 200,000: 4.0 us per plan" in auto.describe()

    stays = AutoExecutor(num_cpus=2)
    stays.choose(1_000_000)
    stays.observe(100_000, 0.4)
    stays.observe(100_000, 0.4)
    assert not stays._decide() and isinstance(stays.inner, LocalExecutor)
    assert "the 800,000 left 3.2 s here vs ~7.1 s on Ray with 2 CPUs" in stays.describe()

    joined = AutoExecutor(address="ray://head:10001")
    assert "runner.address=ray://head:10001 given" in joined.choose(10)
    assert isinstance(joined.inner, RayExecutor)


def test_ray_block_rows_follow_the_measured_rate():
    from stage_dse.runner.executors import RAY_BLOCK_ROWS, RayExecutor

    ex = RayExecutor()
    assert ex.block_rows(20_000, 10**6) == 20_000  # nothing measured (and not started)
    ex._ray, ex._num_cpus = object(), 2  # as if started, two CPUs
    ex.observe(50_000, 1.0)  # 50k plans per CPU-second: one second of work per task
    assert ex.block_rows(20_000, 10**6) == 50_000
    assert ex.block_rows(20_000, 60_000) == 15_000  # two tasks per CPU for what is left
    assert ex.block_rows(20_000, 100) == RAY_BLOCK_ROWS[0]
    ex.observe(10**7, 1.0)
    assert ex.block_rows(20_000, 10**9) == RAY_BLOCK_ROWS[1]
    assert "blocks of 5,000 to 100,000 rows" in ex.describe()


@pytest.mark.parametrize("damage", ["empty", "pages:step_s"])
def test_an_unreadable_part_never_breaks_load_or_plot(tmp_path, damage, capsys):
    """Outside a sweep, reading a folder with a zero-byte or corrupt part quarantines it (with
    a warning) and returns every other row; stage-dse-plot draws from the rest."""
    from stage_dse.cli.plot import main as plot_main

    root = tmp_path / "c"
    run_grid(small_spec(), LocalExecutor(), ResultStore(root), batch_size=400, progress=False)
    import pyarrow.parquet as pq

    parts = sorted(root.glob("part-*.parquet"))
    kept = len(load(root)) - pq.read_metadata(parts[0]).num_rows
    _damage(parts[0], damage)
    df = load(root)
    assert len(df) == kept > 0 and df["config_hash"].is_unique
    err = capsys.readouterr().err
    assert parts[0].name in err and "_quarantine" in err
    assert (root / "_quarantine" / parts[0].name).is_file()
    assert plot_main([str(root), "--out", str(tmp_path / "png")]) == 0
    assert list((tmp_path / "png").glob("*.png"))


def test_a_full_disk_ends_in_one_line_and_keeps_the_parts_written(tmp_path, monkeypatch):
    """The third part fails to write (ENOSPC): one StageDseError naming the folder and what is
    kept, no temporary left behind; the rerun resumes and stores each configuration once."""
    import errno

    import stage_dse.results.store as store_mod

    real_fsync, calls = os.fsync, []

    def full_after_two(fd):
        calls.append(fd)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    root = tmp_path / "full"
    spec = small_spec()
    monkeypatch.setattr(store_mod.os, "fsync", full_after_two)
    with pytest.raises(StageDseError) as info:
        run_grid(spec, LocalExecutor(), ResultStore(root), batch_size=200, progress=False)
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert f"cannot write a part to {root}" in message and "rerun to resume" in message
    assert not list(root.glob(".tmp-*"))
    assert len(list(root.glob("part-*.parquet"))) == 2
    monkeypatch.setattr(store_mod.os, "fsync", real_fsync)
    report = run_grid(spec, LocalExecutor(), ResultStore(root), batch_size=200, progress=False)
    df = load(root)
    assert report.skipped > 0 and len(df) == report.valid and df["config_hash"].is_unique


def test_ctrl_c_is_one_line_and_the_rerun_resumes(tmp_path):
    """SIGINT mid-sweep: exit 130 with one line on stderr; the parts written are kept and the
    rerun stores each configuration once."""
    import signal

    # ~500 parts over several seconds: the interrupt lands mid-sweep even on a loaded machine
    args = [
        "stage-dse",
        f"results_dir={tmp_path}",
        "runner=local",
        "runner.progress=false",
        "runner.batch_size=200",
        "model=llama3_70b",
        "plan=wide",
        "num_gpus=[512]",
    ]
    # the child starts with Ctrl-C's default disposition, as from a terminal: a process that
    # inherits SIGINT ignored (some library earlier in the test session may ignore it in this
    # one) keeps it ignored, and Python then never raises KeyboardInterrupt. A handler set
    # here becomes the default at exec (no preexec_fn: unsafe in a process with threads).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        if previous is not None:  # None: a handler installed outside Python, left as it was
            signal.signal(signal.SIGINT, previous)
    for line in proc.stdout:
        if "evaluating up to" in line:
            break
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("default/part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130, err[-2000:]
    assert lines == [f"stage-dse: error: {INTERRUPTED}"]
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    df = load(tmp_path / "default")
    assert df["config_hash"].is_unique and "reused" in rerun.stdout


def _stage_dse(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["stage-dse", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


SMALL = ["runner=local", "runner.progress=false", "plan.micro_batch_size=[1]"]


def test_a_refused_or_failed_run_writes_nothing(tmp_path):
    """``sweep_name=../outside`` is refused before Hydra makes its run folder; a run that fails
    once started (nothing listens at runner.address) leaves no ``_runs`` record."""
    work = tmp_path / "cwd"
    work.mkdir()
    res = tmp_path / "res"
    refused = _stage_dse(["sweep_name=../outside", f"results_dir={res}/r", *SMALL], work)
    assert refused.returncode == 2 and "sweep_name='../outside'" in refused.stderr
    assert not res.exists() and not (tmp_path / "outside").exists()
    failed = _stage_dse(
        ["runner.address=127.0.0.1:1", f"results_dir={res}", "num_gpus=[8]", *SMALL[1:]], work
    )
    assert failed.returncode == 2 and "runner.address=127.0.0.1:1" in failed.stderr
    assert not (res / "default" / "_runs").exists()
    assert not list(res.rglob("part-*.parquet")) and not list(work.iterdir())


def test_scalar_multirun_form_flags_after_overrides_and_a_non_ascii_path(tmp_path):
    """``-m num_gpus=8,16`` (each job one GPU count), written after the other overrides, into
    a results folder whose name Hydra's grammar would refuse unquoted."""
    folder = tmp_path / "résultats"
    res = _stage_dse([f"results_dir={folder}", *SMALL, "-m", "num_gpus=8,16"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    df = load(folder / "default")
    assert set(df["num_gpus"]) == {8, 16} and df["config_hash"].is_unique


def test_config_dir_presets_run_and_are_checked_in_one_line(tmp_path):
    from stage_dse.config import conf_dir

    user = tmp_path / "my_conf" / "model"
    user.mkdir(parents=True)
    text = (Path(conf_dir()) / "model" / "llama3_8b.yaml").read_text()
    (user / "mine.yaml").write_text(text.replace("name: llama3_8b", "name: mine"))
    (user / "broken.yaml").write_text("name: broken\nhidden_size: [1\n")
    base = ["--config-dir", str(tmp_path / "my_conf"), "num_gpus=[8]", *SMALL]
    ok = _stage_dse([*base, "model=mine", f"results_dir={tmp_path}/r"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert set(load(tmp_path / "r" / "default")["model"]) == {"mine"}
    for override, start in (
        ("model=broken", f"stage-dse: error: {user / 'broken.yaml'}:3:"),
        ("plan.tp=[3]", "stage-dse: error: plan.tp=3: tp(3) does not divide"),
    ):
        bad = _stage_dse([*base, "model=mine", override, f"results_dir={tmp_path}/b"], tmp_path)
        err = [line for line in bad.stderr.splitlines() if line.strip()]
        assert bad.returncode == 2 and len(err) == 1 and err[0].startswith(start), bad.stderr
    assert not (tmp_path / "b").exists()
