"""Joining an existing Ray cluster (``runner.address``) within a bounded time, or refusing in
one line that names the field and the fix: nothing listening at the address, a malformed
address, a cluster with token authentication joined without ``RAY_AUTH_MODE=token``, a version
mismatch. Used by :class:`stage_dse.runner.executors.RayExecutor`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["AUTH_MODE_ENV", "CONNECT_TIMEOUT_S", "resolve_address"]


CONNECT_TIMEOUT_S = 10.0
"""How long joining a cluster (``runner.address``) may take: the TCP probe of the address, then
Ray's own retries of its GCS connection (about one a second), before one line says why not."""

AUTH_MODE_ENV = "RAY_AUTH_MODE"
_GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # Ray's bound on its GCS connect retries
_AUTH_FIX = (
    "the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN (`ray get-auth-token` on the "
    "head node prints it)"
)


def resolve_address(address: str) -> tuple[str, str]:
    """The address to join for ``runner.address`` and where it came from. ``auto`` is the
    cluster ``RAY_ADDRESS`` names, else the one the last ``ray start`` on this machine recorded;
    never just any Ray process found running (Ray's own ``auto`` falls back to that, and on a
    shared machine it may be someone's embedded Ray). ``HOST:PORT`` and ``ray://HOST:PORT``
    are taken as given."""
    if address != "auto":
        return address, ""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return env, " (from RAY_ADDRESS)"
    from ray._private.utils import get_ray_address_file, read_ray_address

    recorded = read_ray_address()
    if not recorded:
        from stage_dse.errors import ConfigError

        raise ConfigError(
            "runner.address=auto: no Ray cluster was started with `ray start` on this machine "
            "(no RAY_ADDRESS, no address file); start one with `ray start --head --port 6379` "
            "or give runner.address=HOST:PORT"
        )
    return recorded, f" (recorded by `ray start` in {get_ray_address_file(None)})"


def _host_port(address: str, shown: str) -> tuple[str, int]:
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in rest or not port.isdigit() or not 0 < int(port) < 65536:
        from stage_dse.errors import ConfigError

        raise ConfigError(
            f"runner.address={shown!r} is not HOST:PORT, ray://HOST:PORT or auto; give the "
            "address `ray start --head` printed, e.g. runner.address=127.0.0.1:6379"
        )
    return host.strip("[]"), int(port)


def _probe(shown: str, host: str, port: int, timeout_s: float, origin: str) -> None:
    """Fail in one line, within ``timeout_s``, when nothing listens at the address (Ray itself
    would retry for many minutes)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        from stage_dse.errors import ConfigError

        if isinstance(exc, TimeoutError):
            why = f"no answer within {timeout_s:g} s"
        else:
            why = (exc.strerror or str(exc) or type(exc).__name__).lower()
        stale = ", a stale address file" if "ray start" in origin else ""
        flag = "--ray-client-server-port" if shown.startswith("ray://") else "--port"
        raise ConfigError(
            f"runner.address={shown}: no Ray cluster answers at {host}:{port}{origin}: {why}"
            f"{stale}; start one with `ray start --head {flag} {port}` or give the address it "
            "printed"
        ) from None


@contextlib.contextmanager
def _bounded_gcs_connect(timeout_s: float) -> Iterator[None]:
    """Ray's settings for connecting to a GCS, for the time of one join, sized to ``timeout_s``:
    an attempt costs about two RPC connect timeouts, the cluster-id wait and a one-second
    pause, and Ray makes ``gcs_server_port_wait_time_s`` attempts (by default 20 of up to
    ~40 s each, which is minutes at an address that accepts TCP but is not a Ray GCS). Settings
    the user gave in the environment are kept."""
    per_s = max(1, math.ceil(timeout_s / 10))
    wanted = {
        "RAY_gcs_server_port_wait_time_s": max(1, round(timeout_s / (3 * per_s + 1))),
        "RAY_gcs_rpc_server_connect_timeout_s": per_s,
        "RAY_py_gcs_connect_timeout_s": per_s,
    }
    added = [k for k in wanted if k not in os.environ]
    for k in added:
        os.environ[k] = str(wanted[k])
    _reload_ray_config()
    try:
        yield
    finally:
        # not read again: they only govern connecting, and the core worker now runs
        for k in added:
            os.environ.pop(k, None)


def _reload_ray_config() -> None:
    """Have Ray read its ``RAY_*`` settings from the environment again (as Ray itself does
    when it turns on token authentication); a no-op where that call does not exist."""
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # another Ray layout: its defaults apply
        pass


@contextlib.contextmanager
def _stderr_captured() -> Iterator[Callable[[], str]]:
    """Send file descriptor 2 to a temporary file (Ray's C++ core logs each failed retry
    there); yields a function returning what was written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)

        def text() -> str:
            sys.stderr.flush()
            tmp.seek(0)
            return tmp.read().decode(errors="replace")

        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _join(ray, address: str, timeout_s: float, kwargs: dict) -> str:
    """``ray.init`` on an existing cluster, bounded by ``timeout_s``; any failure is one line
    naming ``runner.address`` and the fix (token authentication: ``RAY_AUTH_MODE``)."""
    from stage_dse.errors import ConfigError

    target, origin = resolve_address(address)
    host, port = _host_port(target, address)
    _probe(address, host, port, timeout_s, origin)
    failure, logged = None, ""
    with _bounded_gcs_connect(timeout_s), _stderr_captured() as captured:
        try:
            # "auto" as such: Ray then also turns on token authentication when this machine
            # holds a token, as it does for its own clusters found this way
            ray.init(address="auto" if address == "auto" else target, **kwargs)
        except Exception as exc:  # Ray raises several types here; all end the same way
            failure, logged = exc, captured()
    if failure is not None:
        raise ConfigError(_join_error(address, target, failure, logged)) from None
    return target


def _join_error(shown: str, target: str, exc: BaseException, logged: str) -> str:
    chain, e = [], exc
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = " ".join(chain) + " " + logged
    head = f"runner.address={shown}: "
    if "no authentication token was found" in text:
        return f"{head}{AUTH_MODE_ENV}=token is set but no token was found: put {_AUTH_FIX}"
    if "InvalidAuthToken" in text or "AuthenticationError" in text:
        if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
            return (
                f"{head}the Ray cluster at {target} uses token authentication: set "
                f"{AUTH_MODE_ENV}=token, with {_AUTH_FIX}"
            )
        return f"{head}the Ray cluster at {target} refused this token: use {_AUTH_FIX}"
    version = [line for line in text.splitlines() if "version" in line.lower()]
    if "mismatch" in text.lower() and version:
        return f"{head}{version[0].strip()[:300]}; install the cluster's Ray and Python here"
    last = " ".join(str(exc).split())[:200] or type(exc).__name__
    return (
        f"{head}could not join the Ray cluster at {target} ({last}); check that `ray start "
        "--head` runs there and that its port is reachable from this machine"
    )
