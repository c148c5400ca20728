"""Fitting the model's physical parameters on the corpus, and leave-one-source-out error.

The parameters that may move are listed in ``parameters.yaml`` beside this module: each is a
symbol column (``gemm_efficiency``, ``inter_efficiency``, ...) of the rows of some hardware or
cluster presets, bounded by the range a cited measurement supports. Nothing is fitted per case.

**Procedure** (:func:`fit`), rerun with ``stage-dse-validate --fit``:

1. every case is prepared once (its candidate plans, its serving row);
2. the loss is the mean over sources of each source's mean ``|ln(predicted / published)|``
   (each source weighs the same, however many figures it has), unstated choices re-chosen by
   the fastest-plan-that-fits rule at every evaluation;
3. coordinate descent from each parameter's prior (``parameters.yaml``; the presets' value
   where none is given): for each parameter in turn, a golden-section
   search over its range on the cases it touches (the loss of the others does not change),
   kept only if it lowers the loss; two sweeps over all parameters.

**Leave one source out** (:func:`leave_one_source_out`): for every source, the fit is rerun
without its cases and the source is predicted with those parameters. A parameter that no
remaining case touches keeps its starting value. That error is the figure that counts: a change
that lowers the in-sample error and raises this one has fitted noise.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from stage_dse.cost.serving import ServingTiming
from stage_dse.errors import ConfigError
from stage_dse.validation.corpus import Case
from stage_dse.validation.serving import VARIANT, Prepared, evaluate_serving, prepare
from stage_dse.validation.training import build_table, evaluate_training

__all__ = ["FitResult", "Parameter", "Problem", "fit", "leave_one_source_out", "load_parameters"]

GOLDEN = (math.sqrt(5) - 1) / 2
RESULT_COLUMNS = ("case", "source", "group", "status", "published", "predicted", "err_pct")


@dataclass(frozen=True)
class Parameter:
    """A fitted quantity: the value of ``columns`` on the rows of some presets, or (``factor``)
    a factor on the presets' values of them (e.g. a sustained clock on both tensor-core peaks)."""

    name: str
    columns: tuple[str, ...]
    lower: float
    upper: float
    hardware: tuple[str, ...] = ()
    cluster: tuple[str, ...] = ()
    engine: tuple[str, ...] = ()
    """Serving rows on these engine profiles (:mod:`stage_dse.spec.engine`)."""
    factor: bool = False
    workload: str = ""
    """Only rows of this workload (``training`` or ``serving``; empty: both)."""
    prior: float | None = None
    """Where every fit starts (the physical prior of ``parameters.yaml``); None: the presets'
    value. A prior independent of the presets keeps the folds honest once fitted values are
    adopted into the presets (a fold never starts from a value its held-out source moved)."""

    def mask(self, table: pd.DataFrame) -> np.ndarray:
        if not len(table):
            return np.zeros(0, dtype=bool)
        m = np.zeros(len(table), dtype=bool)
        if self.hardware:
            m |= table["hardware"].isin(self.hardware).to_numpy()
        if self.cluster:
            m |= table["cluster"].isin(self.cluster).to_numpy()
        if self.engine and "engine" in table:
            m |= table["engine"].isin(self.engine).to_numpy()
        if self.workload:
            m &= (table["workload"] == self.workload).to_numpy()
        return m


def load_parameters(text: str | None = None) -> list[Parameter]:
    """The parameters of ``parameters.yaml`` (or of ``text``)."""
    if text is None:
        text = files("stage_dse.validation").joinpath("parameters.yaml").read_text()
    doc = yaml.safe_load(text) or {}
    out = []
    for p in doc.get("parameters", []):
        lo, hi = p["range"]
        if not 0 <= lo < hi:
            raise ConfigError(f"parameters.yaml: {p['name']}: range must be 0 <= low < high")
        columns = p.get("columns", [p.get("column")])
        out.append(
            Parameter(
                name=p["name"],
                columns=tuple(columns),
                lower=float(lo),
                upper=float(hi),
                hardware=tuple(p.get("hardware", ())),
                cluster=tuple(p.get("cluster", ())),
                engine=tuple(p.get("engine", ())),
                factor=bool(p.get("factor", False)),
                workload=str(p.get("workload", "")),
                prior=float(p["prior"]) if "prior" in p else None,
            )
        )
    return out


class Problem:
    """Cases prepared once, evaluated under any parameter values."""

    def __init__(self, cases: list[Case], timing: str = "roofline") -> None:
        self.cases = cases
        self.timing = timing
        self.training = [c for c in cases if c.kind == "training"]
        self.serving = [c for c in cases if c.kind == "serving"]
        self.table, self.info = build_table(self.training)
        self.prepared = prepare(self.serving)
        self._subs: dict[str, Problem] = {}

    def retimed(self, timing: str) -> Problem:
        """The same preparation under another timing source (candidate plans and serving rows
        do not depend on it; both kinds of case are evaluated under it)."""
        new = copy.copy(self)
        new.timing = timing
        new._subs = {}
        return new

    def subset(self, cases: list[Case]) -> Problem:
        """The same preparation restricted to ``cases`` (nothing is rebuilt)."""
        ids = {c.id for c in cases}
        new = object.__new__(Problem)
        new.cases = [c for c in self.cases if c.id in ids]
        new.timing = self.timing
        new.training = [c for c in new.cases if c.kind == "training"]
        new.serving = [c for c in new.cases if c.kind == "serving"]
        new.table = self.table[self.table["case"].isin(ids)] if len(self.table) else self.table
        new.info = {k: v for k, v in self.info.items() if k in ids}
        old = self.prepared
        keep = [cid for cid in old.index if cid.split(VARIANT)[0] in ids]
        rows = [old.index[cid] for cid in keep]
        new.prepared = Prepared(
            old.table.iloc[rows].reset_index(drop=True) if rows else old.table.iloc[:0],
            [old.keys[i] for i in rows],
            {cid: j for j, cid in enumerate(keep)},
            {k: v for k, v in old.unexpressible.items() if k in ids},
            {k: v for k, v in old.variants.items() if k in ids},
            {k: v for k, v in old.runs.items() if k in ids},
        )
        new._subs = {}
        return new

    def touching(self, p: Parameter) -> Problem:
        """The cases ``p`` changes, prepared (cached)."""
        if p.name not in self._subs:
            self._subs[p.name] = self.subset(self.touched(p))
        return self._subs[p.name]

    def _apply(self, table: pd.DataFrame, params: list[Parameter], theta: dict) -> pd.DataFrame:
        if not theta or not len(table):
            return table
        table = table.copy()
        for p in params:
            if p.name in theta:
                m = p.mask(table)
                if m.any():
                    for col in p.columns:
                        value = theta[p.name]
                        table.loc[m, col] = table.loc[m, col] * value if p.factor else value
        return table

    def evaluate(self, params: list[Parameter] | None = None, theta=None) -> pd.DataFrame:
        params, theta = params or [], theta or {}
        parts = []
        if self.training:
            t = self._apply(self.table, params, theta)
            parts.append(evaluate_training(self.training, self.timing, t, self.info))
        if self.serving:
            s = self._apply(self.prepared.table, params, theta)
            parts.append(evaluate_serving(self.serving, self.prepared, s, self.serving_timing()))
        out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
        for col in RESULT_COLUMNS:  # a set of cases none of which is expressible has none
            if col not in out:
                out[col] = np.nan
        return out

    def serving_timing(self) -> ServingTiming:
        """The serving cases' timing: under ``measured``, each hardware preset on its own
        table set (``hardware.measured_gpu``), as the training cases are."""
        if self.timing != "measured" or not len(self.prepared.table):
            return ServingTiming(self.timing)
        names = tuple(sorted(set(self.prepared.table["hardware"].astype(str))))
        return ServingTiming("measured", _table_sets(names))

    def start(self, p: Parameter) -> float | None:
        """The presets' value of ``p`` (from the first row it applies to)."""
        for table in (self.table, self.prepared.table):
            m = p.mask(table)
            if m.any():
                return 1.0 if p.factor else float(table.loc[m, p.columns[0]].iloc[0])
        return None

    def touched(self, p: Parameter) -> list[Case]:
        ids = set()
        if len(self.table):
            ids |= set(self.table.loc[p.mask(self.table), "case"])
        if len(self.prepared.table):
            rows = set(np.flatnonzero(p.mask(self.prepared.table)))
            ids |= {cid.split(VARIANT)[0] for cid, i in self.prepared.index.items() if i in rows}
        return [c for c in self.cases if c.id in ids]


@lru_cache(maxsize=16)
def _table_sets(hardware: tuple[str, ...]) -> dict[str, str | None]:
    from stage_dse.config import load_hardware
    from stage_dse.kernels.tables import table_set

    return {name: table_set(load_hardware(name)) for name in hardware}


def loss(results: pd.DataFrame, exclude: str | None = None) -> float:
    """Mean over sources of the mean ``|ln(predicted/published)|`` (``exclude``: a source
    left out)."""
    have = results[results["status"].isin(("ok", "oom")) & (results["source"] != exclude)]
    if have.empty:
        return 0.0
    err = np.abs(np.log1p(have["err_pct"].to_numpy(dtype=float) / 100))
    per_source = pd.Series(err, index=have["source"].to_numpy()).groupby(level=0).mean()
    return float(per_source.sum())


@dataclass
class FitResult:
    timing: str
    params: list[Parameter]
    start: dict[str, float]
    theta: dict[str, float]
    folds: dict[str, dict[str, float]] = field(default_factory=dict)


def fit(
    problem: Problem,
    params: list[Parameter],
    exclude: str | None = None,
    sweeps: int = 2,
    memo: dict | None = None,
) -> dict[str, float]:
    """Parameter values minimizing :func:`loss` without source ``exclude`` (see the module
    docstring). ``memo``: the outcomes of earlier searches, shared by the folds (see
    :func:`_coupled`); a search is reused only where it would repeat exactly."""
    theta: dict[str, float] = {}
    subs: dict[str, Problem] = {}
    for p in params:
        start = problem.start(p)
        if start is None:
            continue  # no case uses it
        start = p.prior if p.prior is not None else start
        theta[p.name] = min(max(start, p.lower), p.upper)
        sub = problem.touching(p)
        if any(c.source.id != exclude for c in sub.cases):
            subs[p.name] = sub
    coupled = _coupled(problem, params) if memo is not None else {}
    for _ in range(sweeps):
        for p in params:
            sub = subs.get(p.name)
            if sub is None:
                continue
            key = None
            if memo is not None:
                names, sources = coupled[p.name]
                held = exclude if exclude in sources else None
                key = (p.name, held, tuple(theta[q] for q in names))
                if key in memo:
                    theta[p.name] = memo[key]
                    continue

            def f(v: float, p=p, sub=sub) -> float:
                return loss(sub.evaluate(params, {**theta, p.name: v}), exclude)

            theta[p.name] = _golden(f, p.lower, p.upper, theta[p.name])
            if key is not None:
                memo[key] = theta[p.name]
    return theta


def _coupled(problem: Problem, params: list[Parameter]) -> dict[str, tuple[tuple, frozenset]]:
    """Per parameter, what its search depends on: the parameters that change any case it
    touches (itself included) and the sources of those cases. A search reads nothing else (the
    loss of its cases under their values, without the held-out source if it is among them),
    so a fold whose values of those parameters equal an earlier search's, and which holds out
    no source among them or the same one, would repeat it step for step."""
    touched = {p.name: frozenset(c.id for c in problem.touching(p).cases) for p in params}
    out = {}
    for p in params:
        if not touched[p.name]:
            continue
        names = tuple(q.name for q in params if touched[q.name] & touched[p.name])
        sources = frozenset(c.source.id for c in problem.touching(p).cases)
        out[p.name] = (names, sources)
    return out


def _golden(f, lo: float, hi: float, current: float, tol: float = 5e-3) -> float:
    """Minimum of ``f`` on ``[lo, hi]`` by golden-section search to ``tol`` (at most 1/80 of
    the range: parameters in seconds span far less than efficiencies do); ``current``
    unless the search finds lower."""
    tol = min(tol, (hi - lo) / 80)
    best_v, best = current, f(current)
    a, b = lo, hi
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for v, fv in ((c, fc), (d, fd)):
        if fv < best:
            best_v, best = v, fv
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = f(c)
            v, fv = c, fc
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = f(d)
            v, fv = d, fd
        if fv < best:
            best_v, best = v, fv
    return float(best_v)


def leave_one_source_out(
    problem: Problem,
    params: list[Parameter],
    workers: int | None = None,
    checkpoint: Path | None = None,
    progress=None,
) -> tuple[FitResult, pd.DataFrame]:
    """The all-source fit and, per source, the fit without it; returns them and the cases'
    results with ``fit_err_pct`` (all-source parameters) and ``loso_err_pct``.

    ``checkpoint``: a folder where each finished fit is written as it ends and read back by a
    later call with the same folder (see :func:`checkpoint_dir`), so an interrupted refit
    resumes where it stopped. ``progress(done, total, name)``: called for each fit as it is
    collected (in source order) or read back, ``name`` the held-out source or
    :data:`ALL_SOURCES`."""
    start = {p.name: v for p in params if (v := problem.start(p)) is not None}
    memo: dict = {}
    theta = _saved(checkpoint, ALL_SOURCES)
    if theta is None:
        theta = fit(problem, params, memo=memo)  # also compiles every family the folds need
        _save(checkpoint, ALL_SOURCES, theta)
    report = progress or (lambda done, total, name: None)
    result = FitResult(problem.timing, params, start, theta)
    base = problem.evaluate()
    fitted = problem.evaluate(params, theta)
    loso = pd.Series(np.nan, index=base["case"].to_numpy())
    # a source none of whose cases the model can express has no fold (nothing to predict)
    have = base[base["status"].isin(("ok", "oom"))]
    sources = sorted(have["source"].unique())
    total = len(sources) + 1
    report(1, total, ALL_SOURCES)
    done = {s: f for s in sources if (f := _saved(checkpoint, s)) is not None}
    todo = [s for s in sources if s not in done]
    for i, source in enumerate(done):
        report(2 + i, total, source)
    # the generator first: it runs to its end (closing its worker pool) when the last fold is in
    for fold, source in zip(_folds(problem, params, todo, workers, memo, checkpoint), todo):
        done[source] = fold
        report(1 + len(done), total, source)
    for source in sources:
        fold = result.folds[source] = done[source]
        held = problem.subset([c for c in problem.cases if c.source.id == source])
        held = held.evaluate(params, fold)
        loso.loc[held["case"].to_numpy()] = held["err_pct"].to_numpy()
    out = base.copy()
    out["fit_err_pct"] = fitted["err_pct"].to_numpy()
    out["loso_err_pct"] = loso.loc[out["case"].to_numpy()].to_numpy()
    return result, out


ALL_SOURCES = "all-sources"
"""The checkpoint entry of the fit on every source (no source id is spelled so)."""


def checkpoint_dir(problem: Problem, params: list[Parameter], corpus: str) -> Path:
    """Where :func:`leave_one_source_out` keeps finished fits for this problem: under the
    disk cache, named by everything a fit depends on (the timing, the cases and ``corpus``, a
    digest of their records; the parameters; the package's code and presets; under measured
    timing the kernel tables' release), so a checkpoint is never read by a run it does not
    describe."""
    from stage_dse.config.presets import conf_dir
    from stage_dse.diskcache import cache_dir

    h = hashlib.sha256()
    h.update(f"{problem.timing}|{corpus}|{params!r}".encode())
    if problem.timing == "measured":  # the kernel tables' release
        from importlib.metadata import PackageNotFoundError, version

        with contextlib.suppress(PackageNotFoundError):
            h.update(version("aiconfigurator-core").encode())
    h.update("|".join(sorted(c.id for c in problem.cases)).encode())
    here = Path(__file__).resolve().parent
    for root, pattern in ((here.parent, "*.py"), (conf_dir(), "*.yaml"), (here, "parameters.yaml")):
        for path in sorted(root.rglob(pattern)):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return cache_dir() / f"fit-{h.hexdigest()[:24]}"


def _saved(checkpoint: Path | None, name: str) -> dict[str, float] | None:
    if checkpoint is None:
        return None
    path = checkpoint / f"{name}.yaml"
    try:
        return {str(k): float(v) for k, v in yaml.safe_load(path.read_text()).items()}
    except (OSError, AttributeError, TypeError, ValueError, yaml.YAMLError):
        return None  # absent or unreadable: refitted


def _save(checkpoint: Path | None, name: str, theta: dict[str, float]) -> None:
    if checkpoint is None:
        return
    checkpoint.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(yaml.safe_dump({k: float(v) for k, v in theta.items()}))
    tmp.replace(checkpoint / f"{name}.yaml")  # whole or absent, never half written


_SHARED: tuple = ()


def _fold(source: str) -> dict[str, float]:
    problem, params, memo, checkpoint = _SHARED
    theta = fit(problem, params, exclude=source, memo=memo)
    _save(checkpoint, source, theta)
    return theta


def _folds(
    problem: Problem,
    params,
    sources: list[str],
    workers: int | None,
    memo: dict | None = None,
    checkpoint: Path | None = None,
) -> Iterator[dict]:
    """The fits without each source, in forked worker processes (one per core; the prepared
    problem and its compiled families are inherited, nothing is pickled but the answers),
    yielded in the order of ``sources``, each once it and those before it have ended."""
    import multiprocessing as mp

    global _SHARED
    _SHARED = (problem, params, memo, checkpoint)
    workers = min(workers or os.cpu_count() or 1, len(sources))
    try:
        if workers <= 1 or "fork" not in mp.get_all_start_methods():
            for s in sources:
                yield _fold(s)
            return
        with mp.get_context("fork").Pool(workers) as pool:
            yield from pool.imap(_fold, sources, chunksize=1)
    finally:
        _SHARED = ()


def apply_folds(
    problem: Problem, params: list[Parameter], folds: dict, unseen: dict | None = None
) -> pd.DataFrame:
    """Every case predicted with the recorded parameters fitted without its source
    (``loso_err_pct``). ``unseen``: the parameters of the last fit (``theta``) and the sources
    it saw (``fitted_sources``); a source added since has no fold of its own, and that fit is
    one made without it, so it predicts the source held out by construction. NaN for a source
    with neither (or none of whose cases the model can express)."""
    base = problem.evaluate()
    loso = pd.Series(np.nan, index=base["case"].to_numpy())
    have = set(base.loc[base["status"].isin(("ok", "oom")), "source"])
    thetas = dict(folds)
    if unseen:
        seen = set(unseen.get("fitted_sources", ()))
        thetas.update({s: unseen["theta"] for s in sorted(have - set(folds) - seen)})
    for source, theta in thetas.items():
        if source not in have:  # not in this run, or none of its cases expressible
            continue
        held = problem.subset([c for c in problem.cases if c.source.id == source])
        held = held.evaluate(params, theta)
        loso.loc[held["case"].to_numpy()] = held["err_pct"].to_numpy()
    base["loso_err_pct"] = loso.loc[base["case"].to_numpy()].to_numpy()
    return base
