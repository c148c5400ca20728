"""Joining an existing Ray cluster as the README says: a real head node started with
``ray start --head`` on localhost, token authentication, an address where nothing listens, a
stale address file, and the embedded runner beside a running cluster.

The head node runs in its own ``HOME`` (its token) and ``RAY_TMPDIR`` (its address file and
sockets), so no other Ray on the machine sees it, and is stopped by its pid (``ray stop`` would
end every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("ray") is None, reason="the `ray` command line is not installed (pip install ray)"
)

SWEEP = ["model=llama3_8b", "runner.progress=false", "runner.connect_timeout_s=5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HYDRA_"))}
    cache = os.environ.get("STAGE_DSE_CACHE", str(Path.home() / ".cache" / "stage_dse"))
    env.update(
        HOME=str(root / "home"),
        RAY_TMPDIR=str(root / "tmp"),
        RAY_USAGE_STATS_ENABLED="0",
        STAGE_DSE_CACHE=cache,  # the compiled families of the real home, not a cold cache
        PYTHONWARNINGS="ignore",
    )
    env.update(extra)
    return env


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the head's ``ray start --block`` (it ends its GCS, raylet and workers);
    whatever of its own session is left after 30 s gets SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started


@pytest.fixture(scope="module")
def head():
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths
    (root / "home").mkdir()
    (root / "tmp").mkdir()
    env = _env(root, RAY_AUTH_MODE="token")
    # the README's commands: a token, then the head node with token authentication
    subprocess.run(
        ["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True
    )
    port = _free_port()
    with open(root / "head.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            ["ray", "start", "--head", "--port", str(port), "--num-cpus", "1", "--block"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    address_file = root / "tmp" / "ray" / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 120
        while not address_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not start: {(root / 'head.log').read_text()}")
            time.sleep(0.5)
        time.sleep(1)  # the raylet registers just after the address file is written
        yield SimpleNamespace(port=port, root=root, env=env, address_file=address_file)
    finally:
        _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def _stage_dse(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stage_dse.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _rows(folder: Path):
    from stage_dse.results import load

    return load(folder).sort_values("config_hash").reset_index(drop=True)


def test_a_sweep_joins_a_ray_start_head_node_as_the_readme_says(head, tmp_path):
    """``RAY_AUTH_MODE=token stage-dse runner.address=127.0.0.1:PORT``: every plan evaluated
    on the cluster, the same rows as in this process; ``runner.address=auto`` finds the head
    from its address file."""
    address = f"127.0.0.1:{head.port}"
    res = _stage_dse(
        [*SWEEP, "num_gpus=[16]", f"runner.address={address}", f"results_dir={tmp_path}/ray"],
        head.env,
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"runner: ray (runner=auto: runner.address={address} given)" in res.stdout
    assert f"started Ray with 1 CPUs at {address}" in res.stdout
    local = _stage_dse(
        [*SWEEP, "num_gpus=[16]", "runner=local", f"results_dir={tmp_path}/local"],
        head.env,
        tmp_path,
    )
    assert local.returncode == 0, local.stderr[-2000:]
    a, b = _rows(tmp_path / "ray" / "default"), _rows(tmp_path / "local" / "default")
    assert len(a) == len(b) > 1000
    pd.testing.assert_frame_equal(a.drop(columns="run_id"), b.drop(columns="run_id"))

    auto = _stage_dse(
        [*SWEEP, "num_gpus=[32]", "runner.address=auto", f"results_dir={tmp_path}/auto"],
        head.env,
        tmp_path,
    )
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "runner: ray (runner=auto: runner.address=auto given)" in auto.stdout
    assert "CPUs at " in auto.stdout and "(runner.address=auto)" in auto.stdout
    assert len(_rows(tmp_path / "auto" / "default")) > 1000


def test_joining_without_the_auth_setting_is_one_line_naming_it(head, tmp_path):
    env = {k: v for k, v in head.env.items() if k != "RAY_AUTH_MODE"}
    res = _stage_dse(
        [
            *SWEEP,
            "num_gpus=[16]",
            f"runner.address=127.0.0.1:{head.port}",
            "runner.connect_timeout_s=2",
            f"results_dir={tmp_path}",
        ],
        env,
        tmp_path,
    )
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert err[0].startswith(f"stage-dse: error: runner.address=127.0.0.1:{head.port}: ")
    assert "token authentication: set RAY_AUTH_MODE=token" in err[0]
    assert "ray get-auth-token" in err[0]
    assert not list(tmp_path.glob("default/part-*.parquet"))


def test_the_embedded_runner_never_joins_a_running_cluster(head, tmp_path, run_python):
    """``runner=ray`` without an address starts its own Ray, though a ``ray start`` cluster
    runs, its address file is there and ``RAY_ADDRESS`` names it."""
    script = (
        "import ray\n"
        "from stage_dse.runner.executors import RayExecutor\n"
        "ex = RayExecutor(num_cpus=1)\n"
        "ex.start()\n"
        "print(ray.get_runtime_context().gcs_address, ex.started_here)\n"
        "ex.close()\n"
    )
    env = {**head.env, "RAY_ADDRESS": f"127.0.0.1:{head.port}"}
    gcs, started_here = run_python(script, env, cwd=tmp_path)[-2:]
    assert started_here == "True"
    assert not gcs.endswith(f":{head.port}")  # its own GCS, not the head's


def test_a_stale_address_file_is_one_line_for_auto(tmp_path):
    """A ``ray start`` that ended without ``ray stop`` leaves its address file: joining
    ``auto`` names the file and the dead address at once (no Ray retries)."""
    root = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    try:
        dead = f"127.0.0.1:{_free_port()}"
        (root / "tmp" / "ray").mkdir(parents=True)
        (root / "tmp" / "ray" / "ray_current_cluster").write_text(dead)
        res = _stage_dse(
            [*SWEEP, "num_gpus=[16]", "runner.address=auto", f"results_dir={tmp_path}"],
            _env(root),
            tmp_path,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert f"runner.address=auto: no Ray cluster answers at {dead}" in err[0]
    assert "ray_current_cluster" in err[0] and "stale" in err[0]
