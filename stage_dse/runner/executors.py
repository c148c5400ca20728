"""Executors: where the pure evaluation functions of :mod:`stage_dse.runner.evaluate` run.

``LocalExecutor`` runs tasks in this process (debugging, small runs, tests). ``RayExecutor``
runs each task as one Ray task: an embedded local Ray sized to this machine when no address is
given (always a new one: neither ``RAY_ADDRESS`` nor the address file a ``ray start`` left behind
is read), or an existing cluster (``address="host:port"``, ``"auto"``, ``"ray://host:port"``),
joined within ``connect_timeout_s`` or refused in one line: nothing listening there, or a
cluster with token authentication (Ray 2.x) joined without ``RAY_AUTH_MODE=token``. ``AutoExecutor``
(the default) evaluates here and measures the cost per plan, and moves the rest of a run to
Ray only where the projection from that cost and the core count says Ray finishes sooner. Ray
retries a task whose worker died; a task that still fails comes back as the exception, and the
driver records its rows as ``error`` rows with the exception text. Nothing else schedules work
across machines.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from stage_dse.cost.compile import compile_family
from stage_dse.cost.key import CostKey
from stage_dse.runner.ray_join import (
    CONNECT_TIMEOUT_S,
    _host_port,
    _join,
    resolve_address,
)

__all__ = [
    "AutoExecutor",
    "Executor",
    "LocalExecutor",
    "RayExecutor",
    "make_executor",
    "ray_projection",
    "resolve_address",
]

Task = tuple[int, tuple]


class Executor(Protocol):
    name: str

    def choose(self, plans: int, families: Sequence[CostKey] = ()) -> str: ...

    def block_rows(self, default: int, left: int) -> int: ...

    def observe(self, plans: int, cpu_s: float) -> None: ...

    def describe(self) -> str: ...

    def start(self) -> str: ...

    def compile(self, keys: Iterable[CostKey]) -> None: ...

    def share(self, obj: Any) -> Any: ...

    def map(self, fn: Callable, tasks: Iterable[Task]) -> Iterator[tuple[int, Any]]: ...

    def close(self) -> None: ...


class LocalExecutor:
    """Run tasks in this process, one after the other."""

    name = "local"

    def choose(self, plans: int, families: Sequence[CostKey] = ()) -> str:
        return "local (runner=local)"

    def block_rows(self, default: int, left: int) -> int:
        """``runner.batch_size``: the rows one block holds in memory here."""
        return default

    def observe(self, plans: int, cpu_s: float) -> None:
        pass

    def describe(self) -> str:
        return ""

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
        self._plans = 0
        self._cpu_s = 0.0
        self._rows: list[int] = []

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

    def choose(self, plans: int, families: Sequence[CostKey] = ()) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else "an embedded Ray"
        return f"ray ({where})"

    def observe(self, plans: int, cpu_s: float) -> None:
        """A finished task's plans and its CPU seconds on the worker (what block sizes go by)."""
        self._plans += plans
        self._cpu_s += cpu_s

    @property
    def plans_per_cpu_s(self) -> float | None:
        """Plans a worker evaluates per CPU second, measured on this run's tasks so far."""
        return self._plans / self._cpu_s if self._plans and self._cpu_s > 0 else None

    def block_rows(self, default: int, left: int) -> int:
        """Rows of the next task: :data:`RAY_TASK_CPU_S` of work at the measured rate (until a
        task has reported, ``runner.batch_size``), within :data:`RAY_BLOCK_ROWS`, and no more
        than leaves two tasks per CPU for what is left (so the last tasks finish together)."""
        rate = self.plans_per_cpu_s
        if rate is None or self._ray is None:
            rows = default
        else:
            lo, hi = RAY_BLOCK_ROWS
            balanced = math.ceil(left / (2 * max(1, self._num_cpus)))
            rows = max(lo, min(hi, int(rate * RAY_TASK_CPU_S), balanced))
        self._rows.append(rows)
        return rows

    def block_note(self) -> str:
        """How large the blocks were and what they were sized from ("" before any)."""
        rate = self.plans_per_cpu_s
        if rate is None or not self._rows:
            return ""
        sizes = sorted(set(self._rows))
        shown = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,} to {sizes[-1]:,}"
        return (
            f"blocks of {shown} rows, sized from the measured {rate / 1e3:,.0f}k plans per "
            "worker CPU-second"
        )

    def describe(self) -> str:
        note = self.block_note()
        return f"{self.choose(0)}; {note}" if note else self.choose(0)

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


RAY_TASK_CPU_S = 1.0
"""CPU seconds of work per Ray task once the rate is measured: long enough that dispatch and a
block's fixed costs (rebuilding its enumeration's masks, some 10-30 ms) stay a few percent,
short enough for a progress bar and for a killed run to lose little."""
RAY_BLOCK_ROWS = (5_000, 100_000)
"""Bounds of a Ray block: below, per-task overhead dominates; above, a worker holds several
hundred MB for one block."""
RAY_START_S = 4.5
"""Wall seconds an embedded Ray takes before its first task (start, workers importing
stage_dse), measured on the 2-core reference machine (``benchmarks/bench_sweep.py --ray``)."""
RAY_CPU_FACTOR = 1.6
"""CPU seconds per plan through Ray over those in this process, on the same sweep (Ray's
workers each load the plan families, results travel through the object store): 1.6 measured
on the 2-core reference machine with 1,020,624 plans (``benchmarks/bench_sweep.py --ray``)."""
AUTO_MEASURE_CPU_S = 0.5
"""``runner=auto`` evaluates in this process until it has measured this much CPU time (and two
blocks) before it projects whether Ray would finish sooner."""


def ray_projection(plans: int, per_plan_s: float, cores: int) -> tuple[float, float]:
    """Projected wall seconds for ``plans`` at ``per_plan_s`` CPU-seconds each (measured in
    this process): here, and on an embedded Ray over ``cores`` CPUs (:data:`RAY_START_S`,
    :data:`RAY_CPU_FACTOR`)."""
    here = plans * per_plan_s
    return here, RAY_START_S + here * RAY_CPU_FACTOR / max(1, cores)


class _Shared:
    """A read-only task argument :class:`AutoExecutor` hands over as it is (in this process)
    or through Ray's object store once (after a switch)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class AutoExecutor:
    """Ray when a cluster address is given; otherwise this process, measuring the cost per
    plan on the first blocks, and Ray for the rest of the run only where the projection says
    it finishes sooner on this machine's cores.

    Projection for ``R`` plans left at ``c`` CPU-seconds each measured here, ``n`` cores:
    in this process ``R c``; on an embedded Ray :data:`RAY_START_S` ``+ R c``
    :data:`RAY_CPU_FACTOR` ``/ n``. On 2 cores Ray pays only past ``R c`` of about 22 s (some
    five million plans of a dense model); on 1 core never; on 8 cores past about 6 s."""

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
        self._families: list[CostKey] = []
        self._plans = 0
        self._measured = [0, 0.0, 0]  # plans, CPU seconds, tasks (in this process)
        self._deciding = False
        self._why = ""
        self._shared: dict[int, Any] = {}
        self.name = "auto"

    @property
    def cores(self) -> int:
        if self._num_cpus:
            return int(self._num_cpus)
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            return os.cpu_count() or 1

    def choose(self, plans: int, families: Sequence[CostKey] = ()) -> str:
        self._plans, self._families = plans, list(families)
        if self.address:
            self._inner = RayExecutor(
                address=self.address,
                num_cpus=self._num_cpus,
                connect_timeout_s=self._connect_timeout_s,
            )
            self._why = f"runner.address={self.address} given"
            self._deciding = False
        elif plans == 0:
            self._inner = LocalExecutor()
            self._why = "nothing to evaluate"
            self._deciding = False
        else:
            self._inner = LocalExecutor()
            self._why = (
                f"{plans:,} plans: in this process while the cost per plan is measured on the "
                f"first blocks, Ray for the rest if it would finish sooner on {self.cores} CPUs"
            )
            self._deciding = plans > 0
        self.name = self._inner.name
        return self.describe()

    def describe(self) -> str:
        inner = self.inner
        shown = f"{inner.choose(self._plans).split(' (')[0]} (runner=auto: {self._why})"
        more = inner.block_note() if isinstance(inner, RayExecutor) else ""
        return f"{shown}; {more}" if more else shown

    @property
    def inner(self) -> LocalExecutor | RayExecutor:
        if self._inner is None:
            self.choose(0)
        assert self._inner is not None
        return self._inner

    def observe(self, plans: int, cpu_s: float) -> None:
        if isinstance(self.inner, LocalExecutor):
            self._measured[0] += plans
            self._measured[1] += cpu_s
            self._measured[2] += 1
        self.inner.observe(plans, cpu_s)

    def block_rows(self, default: int, left: int) -> int:
        return self.inner.block_rows(default, left)

    def _decide(self) -> bool:
        """Once enough is measured: project both ways, keep the faster; True to switch."""
        plans, cpu_s, tasks = self._measured
        if cpu_s < AUTO_MEASURE_CPU_S or tasks < 2:
            return False
        self._deciding = False
        left = max(0, self._plans - plans)
        per_plan = cpu_s / plans
        here, ray = ray_projection(left, per_plan, self.cores)
        measured = (
            f"{per_plan * 1e6:.1f} us per plan measured on {plans:,}: the {left:,} left "
            f"{here:.1f} s here vs ~{ray:.1f} s on Ray with {self.cores} CPUs (start "
            f"{RAY_START_S:g} s, {RAY_CPU_FACTOR:g}x CPU per plan)"
        )
        if ray >= here:
            self._why = f"{self._plans:,} plans, {measured}"
            return False
        self._why = f"{self._plans:,} plans, switched to Ray after {plans:,}: {measured}"
        self._inner = RayExecutor(num_cpus=self._num_cpus)
        self.name = "ray"
        self._inner.start()
        self._inner.observe(plans, cpu_s)  # the first Ray blocks are sized from this rate
        from stage_dse.cost.compile import LLVM_MIN_ROWS

        if self._families and left / len(self._families) >= LLVM_MIN_ROWS:
            self._inner.compile(self._families)
        return True

    def _finished_here(self) -> None:
        """The run ended in this process before a projection was made."""
        self._deciding = False
        plans, cpu_s, _ = self._measured
        if not plans:  # a driver that reports no cost (an Optuna study)
            self._why = f"{self._plans:,} plans: in this process (no cost per plan measured)"
        else:
            self._why = (
                f"{self._plans:,} plans, all evaluated here while measuring their cost "
                f"({cpu_s:.1f} CPU-s, {cpu_s / plans * 1e6:.1f} us per plan; an embedded Ray "
                f"takes {RAY_START_S:g} s to start)"
            )

    def start(self) -> str:
        return self.inner.start()

    def compile(self, keys: Iterable[CostKey]) -> None:
        self.inner.compile(keys)

    def share(self, obj: Any) -> Any:
        if isinstance(self.inner, RayExecutor):
            return self.inner.share(obj)
        return _Shared(obj)

    def _resolve(self, task: Task) -> Task:
        tid, args = task
        if not any(isinstance(a, _Shared) for a in args):
            return task
        ray = isinstance(self.inner, RayExecutor)
        out = []
        for a in args:
            if isinstance(a, _Shared) and ray:
                if id(a) not in self._shared:
                    self._shared[id(a)] = self.inner.share(a.obj)
                a = self._shared[id(a)]
            elif isinstance(a, _Shared):
                a = a.obj
            out.append(a)
        return tid, tuple(out)

    def map(self, fn: Callable, tasks: Iterable[Task]) -> Iterator[tuple[int, Any]]:
        it = iter(tasks)
        if isinstance(self.inner, LocalExecutor):
            for task in it:
                # the driver observes each result before the next task is drawn
                yield from self.inner.map(fn, [self._resolve(task)])
                if self._deciding and self._decide():
                    break
            else:
                if self._deciding:
                    self._finished_here()
                return
        yield from self.inner.map(fn, (self._resolve(t) for t in it))

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
