"""Executors: where the pure evaluation functions of :mod:`stage_dse.runner.evaluate` run.

``LocalExecutor`` runs tasks in this process (debugging, small runs, tests). ``RayExecutor``
runs each task as one Ray task: an embedded local Ray sized to this machine when no address is
given (always a new one: neither ``RAY_ADDRESS`` nor the address file a ``ray start`` left behind
is read), or an existing cluster (``address="host:port"``, ``"auto"``, ``"ray://host:port"``),
joined within ``connect_timeout_s`` or refused in one line: nothing listening there, or a
cluster with token authentication (Ray 2.x) joined without ``RAY_AUTH_MODE=token``. ``AutoExecutor``
(the default) picks one of the two per run from the number of plans left to evaluate. Ray
retries a task whose worker died; a task that still fails comes back as the exception, and the
driver records its rows as ``error`` rows with the exception text. Nothing else schedules work
across machines.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from stage_dse.cost.compile import compile_family
from stage_dse.cost.derive import CostKey

__all__ = [
    "AutoExecutor",
    "Executor",
    "LocalExecutor",
    "RayExecutor",
    "make_executor",
    "resolve_address",
]

Task = tuple[int, tuple]


class Executor(Protocol):
    name: str

    def choose(self, plans: int) -> str: ...

    def start(self) -> str: ...

    def compile(self, keys: Iterable[CostKey]) -> None: ...

    def share(self, obj: Any) -> Any: ...

    def map(self, fn: Callable, tasks: Iterable[Task]) -> Iterator[tuple[int, Any]]: ...

    def close(self) -> None: ...


class LocalExecutor:
    """Run tasks in this process, one after the other."""

    name = "local"

    def choose(self, plans: int) -> str:
        return "local (runner=local)"

    def start(self) -> str:
        return ""

    def compile(self, keys: Iterable[CostKey]) -> None:
        """Nothing ahead of time: each family is built when its first rows arrive, interpreted
        or compiled by its number of rows (:func:`stage_dse.cost.compile.family_for`)."""

    def share(self, obj: Any) -> Any:
        return obj

    def map(self, fn: Callable, tasks: Iterable[Task]) -> Iterator[tuple[int, Any]]:
        for tid, args in tasks:
            try:
                yield tid, fn(*args)
            except Exception as exc:  # recorded as error rows by the driver
                yield tid, exc

    def close(self) -> None:
        pass


def _import_evaluator() -> int:
    import stage_dse.runner.evaluate  # noqa: F401  (what every sweep task runs)

    return os.getpid()


def _compile_task(key: CostKey) -> str:
    compile_family(key)
    return repr(key)


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


class RayExecutor:
    """One Ray task per batch of thousands of plans."""

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        max_retries: int = 3,
        max_in_flight: int | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self._num_cpus_wanted = num_cpus
        self._max_in_flight = max_in_flight
        self.max_retries = max_retries
        self.started_here = False
        self._ray = None
        self._reaper = None
        self._remote: dict[Callable, Any] = {}
        self._joined = ""

    def _ensure(self) -> None:
        """Start (or join) Ray on first use, so that a sweep with nothing to evaluate never
        pays for it."""
        if self._ray is not None:
            return
        import ray

        self._ray = ray
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            kwargs = {"logging_level": logging.WARNING, "log_to_driver": False}
            if self.address:
                self._joined = _join(ray, self.address, self.connect_timeout_s, kwargs)
            else:
                # an embedded Ray keeps Ray's default (token authentication on) without
                # printing, on every run, Ray's warning that this default is in force
                logging.getLogger(
                    "ray._private.authentication.authentication_token_setup"
                ).setLevel(logging.ERROR)
                # address="local": always a new Ray of our own, never the cluster that
                # RAY_ADDRESS or a (possibly stale) `ray start` address file points to
                ray.init(
                    address="local",
                    num_cpus=self._num_cpus_wanted or os.cpu_count() or 1,
                    include_dashboard=False,
                    **kwargs,
                )
                # the local Ray processes end with this process, even after SIGKILL
                from stage_dse.runner.reaper import start_reaper

                self._reaper = start_reaper()
            self.started_here = True
        self._num_cpus = int(ray.cluster_resources().get("CPU", 1))
        self.max_in_flight = self._max_in_flight or 2 * self._num_cpus
        self._warm_up()

    @property
    def num_cpus(self) -> int:
        self._ensure()
        return self._num_cpus

    def _warm_up(self) -> None:
        """Have the workers import the evaluator now (about half a second each), so start-up
        cost is paid here and not by the first batches of a sweep."""
        remote = self._as_remote(_import_evaluator)
        try:
            self._ray.get([remote.remote() for _ in range(min(self.num_cpus, 256))])
        except Exception as exc:
            from stage_dse.errors import StageDseError

            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise StageDseError(
                f"Ray workers cannot run stage_dse ({first}); install the same stage_dse "
                "version on every node of the cluster"
            ) from exc

    def _as_remote(self, fn: Callable):
        if fn not in self._remote:
            self._remote[fn] = self._ray.remote(max_retries=self.max_retries)(fn)
        return self._remote[fn]

    def choose(self, plans: int) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else "an embedded Ray"
        return f"ray ({where})"

    def start(self) -> str:
        """Start or join Ray now (otherwise on first use); what was started."""
        self._ensure()
        where = ""
        if self.address:
            where = f" at {self._joined or self.address}"
            if self._joined and self._joined != self.address:
                where += f" (runner.address={self.address})"
        return f"Ray with {self._num_cpus} CPUs{where}"

    def compile(self, keys: Iterable[CostKey]) -> None:
        """Synthesize and compile families in parallel; each worker then loads them from the
        disk cache instead of deriving them again."""
        keys = list(keys)
        if len(keys) > 1:
            self._ensure()
            remote = self._as_remote(_compile_task)
            self._ray.get([remote.remote(k) for k in keys])

    def share(self, obj: Any) -> Any:
        """Put a large read-only argument in the object store once."""
        self._ensure()
        return self._ray.put(obj)

    def map(self, fn: Callable, tasks: Iterable[Task]) -> Iterator[tuple[int, Any]]:
        it = iter(tasks)
        first = next(it, None)
        if first is None:
            return
        self._ensure()
        ray = self._ray
        remote = self._as_remote(fn)
        pending: dict = {}
        it = itertools.chain([first], it)
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < self.max_in_flight:
                try:
                    tid, args = next(it)
                except StopIteration:
                    exhausted = True
                    break
                pending[remote.remote(*args)] = tid
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                tid = pending.pop(ref)
                try:
                    yield tid, ray.get(ref)
                except Exception as exc:  # worker died beyond retries, or the task raised
                    yield tid, exc

    def close(self) -> None:
        if self.started_here and self._ray is not None and self._ray.is_initialized():
            self._ray.shutdown()


AUTO_RAY_MIN_PLANS = 300_000
"""``runner=auto`` evaluates in this process below this many plans left to evaluate. An embedded
Ray costs 4-5 s of wall time to start and compiles every family ahead; its second core pays
that back only on large sweeps. Measured on the 2-core reference machine, Llama-3-70B over the
``llama3_70b_h100_1024`` plan space, empty compile cache, wall seconds in-process vs Ray:
162,240 plans 12.1 vs 13.9; 286,584 plans 14.0 vs 14.4 (break-even near 300,000)."""


class AutoExecutor:
    """In this process for small runs, Ray for large ones or when a cluster address is given;
    :meth:`choose` decides once per run, before anything is evaluated, and says why."""

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self._num_cpus = num_cpus
        self._connect_timeout_s = connect_timeout_s
        self._inner: LocalExecutor | RayExecutor | None = None
        self.name = "auto"

    def choose(self, plans: int) -> str:
        if self.address:
            self._inner = RayExecutor(
                address=self.address,
                num_cpus=self._num_cpus,
                connect_timeout_s=self._connect_timeout_s,
            )
            why = f"runner.address={self.address} given"
        elif plans >= AUTO_RAY_MIN_PLANS:
            self._inner = RayExecutor(num_cpus=self._num_cpus)
            why = f"{plans:,} plans >= {AUTO_RAY_MIN_PLANS:,}: worth starting Ray"
        else:
            self._inner = LocalExecutor()
            why = f"{plans:,} plans < {AUTO_RAY_MIN_PLANS:,}: faster than starting Ray"
        self.name = self._inner.name
        return f"{self._inner.choose(plans).split(' (')[0]} (runner=auto: {why})"

    @property
    def inner(self) -> LocalExecutor | RayExecutor:
        if self._inner is None:
            self.choose(0)
        assert self._inner is not None
        return self._inner

    def start(self) -> str:
        return self.inner.start()

    def compile(self, keys: Iterable[CostKey]) -> None:
        self.inner.compile(keys)

    def share(self, obj: Any) -> Any:
        return self.inner.share(obj)

    def map(self, fn: Callable, tasks: Iterable[Task]) -> Iterator[tuple[int, Any]]:
        return self.inner.map(fn, tasks)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


def make_executor(
    kind: str,
    address: str | None = None,
    num_cpus: int | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> Executor:
    if kind == "local":
        return LocalExecutor()
    if address and kind in ("ray", "auto"):
        target, _ = resolve_address(address)
        _host_port(target, address)  # a malformed address is refused before any evaluation
    if kind == "ray":
        return RayExecutor(
            address=address or None, num_cpus=num_cpus, connect_timeout_s=connect_timeout_s
        )
    if kind == "auto":
        return AutoExecutor(
            address=address or None, num_cpus=num_cpus, connect_timeout_s=connect_timeout_s
        )
    from stage_dse.errors import ConfigError

    raise ConfigError(f"runner.kind={kind!r} is not one of: auto, local, ray")
