"""Executors: where :func:`stage_dse.runner.evaluate.evaluate_batch` runs.

``LocalExecutor`` runs batches in this process (debugging, small runs, tests). ``RayExecutor``
runs each batch as one Ray task: an embedded local Ray sized to this machine when no address is
given, or an existing cluster (``address="auto"``, ``"ray://host:port"``). Ray retries a task
whose worker died; a batch that still fails comes back as the exception, and the driver records
its rows as ``error`` rows with the exception text. Nothing else schedules work across
machines.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

import pandas as pd

from stage_dse.cost.compile import compile_family
from stage_dse.cost.derive import CostKey
from stage_dse.runner.evaluate import evaluate_batch

__all__ = ["Executor", "LocalExecutor", "RayExecutor", "make_executor"]

Batch = tuple[int, pd.DataFrame]


class Executor(Protocol):
    name: str

    def compile(self, keys: Iterable[CostKey]) -> None: ...

    def map(
        self, batches: Iterable[Batch], sweep: str
    ) -> Iterator[tuple[int, pd.DataFrame | BaseException]]: ...

    def close(self) -> None: ...


class LocalExecutor:
    """Evaluate in this process, one batch after the other."""

    name = "local"

    def compile(self, keys: Iterable[CostKey]) -> None:
        for key in keys:
            compile_family(key)

    def map(
        self, batches: Iterable[Batch], sweep: str
    ) -> Iterator[tuple[int, pd.DataFrame | BaseException]]:
        for bid, batch in batches:
            try:
                yield bid, evaluate_batch(batch, sweep)
            except Exception as exc:  # recorded as error rows by the driver
                yield bid, exc

    def close(self) -> None:
        pass


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
        import ray

        self._ray = ray
        self.started_here = False
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            kwargs = {"logging_level": logging.WARNING, "log_to_driver": False}
            if address:
                ray.init(address=address, **kwargs)
            else:
                ray.init(
                    num_cpus=num_cpus or os.cpu_count() or 1,
                    include_dashboard=False,
                    **kwargs,
                )
            self.started_here = True
        self.num_cpus = int(ray.cluster_resources().get("CPU", 1))
        self.max_in_flight = max_in_flight or 2 * self.num_cpus
        self._evaluate = ray.remote(max_retries=max_retries)(evaluate_batch)
        self._compile = ray.remote(max_retries=max_retries)(_compile_task)

    def compile(self, keys: Iterable[CostKey]) -> None:
        """Synthesize and compile families in parallel; each worker then loads them from the
        disk cache instead of deriving them again."""
        keys = list(keys)
        if len(keys) > 1:
            self._ray.get([self._compile.remote(k) for k in keys])
        for key in keys:  # the driver may need them too (memory screening)
            compile_family(key)

    def map(
        self, batches: Iterable[Batch], sweep: str
    ) -> Iterator[tuple[int, pd.DataFrame | BaseException]]:
        ray = self._ray
        pending: dict = {}
        it = iter(batches)
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < self.max_in_flight:
                try:
                    bid, batch = next(it)
                except StopIteration:
                    exhausted = True
                    break
                pending[self._evaluate.remote(batch, sweep)] = bid
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                bid = pending.pop(ref)
                try:
                    yield bid, ray.get(ref)
                except Exception as exc:  # worker died beyond retries, or the task raised
                    yield bid, exc

    def close(self) -> None:
        if self.started_here and self._ray.is_initialized():
            self._ray.shutdown()


def make_executor(kind: str, address: str | None = None, num_cpus: int | None = None) -> Executor:
    if kind == "local":
        return LocalExecutor()
    if kind == "ray":
        return RayExecutor(address=address or None, num_cpus=num_cpus)
    from stage_dse.errors import ConfigError

    raise ConfigError(f"runner.kind={kind!r} is not one of: local, ray")
