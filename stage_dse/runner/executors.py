"""Executors: where the pure evaluation functions of :mod:`stage_dse.runner.evaluate` run.

``LocalExecutor`` runs tasks in this process (debugging, small runs, tests). ``RayExecutor``
runs each task as one Ray task: an embedded local Ray sized to this machine when no address is
given, or an existing cluster (``address="auto"``, ``"ray://host:port"``). ``AutoExecutor``
(the default) picks one of the two per run from the number of plans left to evaluate. Ray
retries a task whose worker died; a task that still fails comes back as the exception, and the
driver records its rows as ``error`` rows with the exception text. Nothing else schedules work
across machines.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from stage_dse.cost.compile import compile_family
from stage_dse.cost.derive import CostKey

__all__ = ["AutoExecutor", "Executor", "LocalExecutor", "RayExecutor", "make_executor"]

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


class RayExecutor:
    """One Ray task per batch of thousands of plans."""

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        max_retries: int = 3,
        max_in_flight: int | None = None,
    ) -> None:
        self.address = address
        self._num_cpus_wanted = num_cpus
        self._max_in_flight = max_in_flight
        self.max_retries = max_retries
        self.started_here = False
        self._ray = None
        self._reaper = None
        self._remote: dict[Callable, Any] = {}

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
                ray.init(address=self.address, **kwargs)
            else:
                # an embedded Ray keeps Ray's default (token authentication on) without
                # printing, on every run, Ray's warning that this default is in force
                logging.getLogger(
                    "ray._private.authentication.authentication_token_setup"
                ).setLevel(logging.ERROR)
                ray.init(
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
        return f"Ray with {self._num_cpus} CPUs" + (f" at {self.address}" if self.address else "")

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

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        self.address = address
        self._num_cpus = num_cpus
        self._inner: LocalExecutor | RayExecutor | None = None
        self.name = "auto"

    def choose(self, plans: int) -> str:
        if self.address:
            self._inner = RayExecutor(address=self.address, num_cpus=self._num_cpus)
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


def make_executor(kind: str, address: str | None = None, num_cpus: int | None = None) -> Executor:
    if kind == "local":
        return LocalExecutor()
    if kind == "ray":
        return RayExecutor(address=address or None, num_cpus=num_cpus)
    if kind == "auto":
        return AutoExecutor(address=address or None, num_cpus=num_cpus)
    from stage_dse.errors import ConfigError

    raise ConfigError(f"runner.kind={kind!r} is not one of: auto, local, ray")
