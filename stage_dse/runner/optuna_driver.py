"""The Optuna driver: a study over :class:`~stage_dse.search.optuna_search.OptunaSpace`, its
trials screened for memory, evaluated in batches and written as result rows.

Optuna is driven directly with ask/tell in batches (not through Hydra's sweeper plugin). Every
trial is a valid plan (the space offers nothing else); a batch of trials becomes one plan table,
is screened with the cheap compiled memory expressions, and only the plans that fit are
evaluated in full (one executor task per batch). Trials whose plan does not fit are told
``PRUNED`` (reason in the trial's user attributes and an ``infeasible`` result row).

No configuration is evaluated twice. A trial whose configuration (by config hash) the study or
the results folder already holds is told that configuration's outcome (its objective values,
or ``PRUNED`` / ``FAIL`` as it ended) with the user attribute ``repeat_of``, and does not count
toward ``search.n_trials``: the budget is distinct configurations. TPE runs with the constant
liar, so trials asked together avoid each other. When more than half of the trials asked for a
batch repeat known configurations, the rest of the batch is filled with configurations drawn
uniformly from those not yet evaluated, so the budget is always spent on new configurations;
when none is left the run stops and says the space is exhausted.

Once a trial has completed, a quarter of each batch goes to unseen neighbours of the best
configurations so far (one plan or co-design axis changed, see
:meth:`~stage_dse.search.optuna_search.OptunaSpace.neighbors`), best first: the sampler finds
the region, the neighbour step finishes the descent that a model of a few hundred trials
leaves undone. Such trials (like the uniform ones) are enqueued with fixed parameters, so the
study holds them as ordinary trials and the sampler learns from them.

The study lives in an Optuna journal file beside the sweep's results, so a rerun resumes it
and ``optuna-dashboard results/<sweep>/_optuna.journal`` can open it. Several objectives
(e.g. ``[step_s, num_gpus, mem_total_bytes]``) make it a multi-objective study (NSGA-II).
"""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from stage_dse.cost.table import evaluate_table
from stage_dse.errors import ConfigError
from stage_dse.results.schema import config_hash
from stage_dse.results.store import ResultStore, new_run_id
from stage_dse.runner.evaluate import error_rows, evaluate_batch, finalize_rows
from stage_dse.runner.executors import Executor
from stage_dse.runner.sweep import SweepReport
from stage_dse.search.optuna_search import Choice, OptunaSpace
from stage_dse.spec.sweep import OBJECTIVES, OptunaSpec, SweepSpec

JOURNAL_LOCK_SUFFIX = ".lock"
"""Optuna's journal lock file: ``<journal>.lock`` (optuna.storages.journal)."""

__all__ = ["OBJECTIVES", "optuna_space", "run_optuna"]

GIB = 2.0**30
REPEAT_SHARE = 0.5
"""A batch whose sampler proposals repeat known configurations more often than this is
completed with configurations drawn uniformly from the unseen ones."""
LOCAL_SHARE = 0.25
"""Share of each batch spent on unseen neighbours of the best configurations found so far."""
LOCAL_FROM = 8
"""How many of the best configurations lend their neighbours."""
ENUMERATE_UNSEEN = 500_000
"""Spaces up to this many configurations are listed whole when random draws find nothing new
(so exhaustion is certain, not guessed)."""
STATE = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "fail": TrialState.FAIL}


def _objective_values(row: pd.Series, objectives: list[str]) -> list[float]:
    out = []
    for name in objectives:
        if name == "gpu_seconds":
            out.append(float(row["step_s"]) * float(row["num_gpus"]))
        else:
            out.append(float(row[name]))
    return out


def _sampler(kind: str, seed: int) -> optuna.samplers.BaseSampler:
    if kind == "tpe":
        # multivariate over the parameters every trial shares, independent for the others
        # (group=True decomposing the conditional space measured slower and no better)
        with warnings.catch_warnings():  # multivariate and constant_liar are experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError(f"search.sampler={kind!r} is not one of: tpe, nsga2, random")


def optuna_space(spec: SweepSpec, search: OptunaSpec) -> OptunaSpace:
    """The space a study of ``spec`` with ``search`` settings samples."""
    return OptunaSpace(
        spec.models[0],
        spec.training,
        spec.space,
        sorted(set(search.gpus or spec.gpu_counts)),
        {hw.name: hw for hw in (*spec.hardware, *search.hardware)},
        spec.cluster,
        hbm_gib=tuple(search.hbm_gib),
        inter_gbit_s=tuple(search.inter_gbit_s),
    )


def run_optuna(
    spec: SweepSpec,
    search: OptunaSpec,
    executor: Executor,
    store: ResultStore,
    progress: bool = True,
    log=print,
) -> SweepReport:
    t0 = time.perf_counter()
    space = optuna_space(spec, search)
    replaced = store.prepare(log)
    try:
        store.check_workload("training")
        return _Study(spec, search, executor, store, space, progress, log).run(replaced, t0)
    finally:
        store.release()


class _Study:
    def __init__(self, spec, search, executor, store, space, progress, log) -> None:
        self.spec, self.search, self.executor, self.store = spec, search, executor, store
        self.space, self.progress, self.log = space, progress, log
        self.objectives = list(search.objectives)
        self.states: Counter = Counter()
        self.origins: Counter = Counter()
        self.rng = np.random.default_rng(int(search.seed))
        self.measured_gpu = None
        if spec.timing == "measured":
            from stage_dse.kernels.tables import table_set

            self.measured_gpu = {name: table_set(hw) for name, hw in space.hardware.items()}

    def _open(self) -> None:
        journal = self.store.root / "_optuna.journal"
        # this process holds the folder's writer lock: a journal lock file left now belongs to
        # a run that was killed, and waiting out Optuna's grace period would gain nothing
        Path(str(journal) + JOURNAL_LOCK_SUFFIX).unlink(missing_ok=True)
        self.storage = JournalStorage(JournalFileBackend(str(journal)))
        self.sampler_kind = self.search.sampler if len(self.objectives) == 1 else "nsga2"
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # before the "created" line
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=self.spec.name,
            sampler=_sampler(self.sampler_kind, int(self.search.seed)),
            directions=["minimize"] * len(self.objectives),
            load_if_exists=True,
        )

    def run(self, replaced: int, t0: float) -> SweepReport:
        spec, log = self.spec, self.log
        if replaced:
            log(f"removed {replaced} part files of another stage_dse version (replace_stale)")
        self._open()
        study = self.study
        # trials a killed run left RUNNING are failed and not counted toward n_trials
        abandoned = 0
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.storage.set_trial_user_attr(
                trial._trial_id, "reason", "abandoned by a run that ended"
            )
            self.storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            abandoned += 1
        if abandoned:
            log(f"{abandoned} trials left running by an earlier run were marked failed")
        # what the study knows: config hash -> (outcome, objective values, reason)
        self.known: dict[str, tuple[str, list[float] | None, str]] = {}
        counted = 0
        for t in study.get_trials(deepcopy=False):
            reason = str(t.user_attrs.get("reason", ""))
            if "abandoned" in reason or "repeat_of" in t.user_attrs:
                continue
            counted += 1
            h = t.user_attrs.get("config_hash")
            if h and t.state in STATE.values():
                state = next(k for k, v in STATE.items() if v == t.state)
                self.known[h] = (state, t.values, reason)
        self.stored = self.store.hashes()  # configurations in the folder (any run, any search)
        self.stored_outcomes: dict | None = None
        remaining = max(0, int(self.search.n_trials) - counted)
        space = self.space
        if space.without_plans:
            log(f"  no valid plan on num_gpus={space.without_plans}: not sampled")
        log(
            f"sweep {spec.name}: optuna {self.sampler_kind} over {', '.join(space.axes)} "
            f"({space.total:,} valid configurations); objectives {self.objectives}; "
            f"{counted} trials in {self.store.root / '_optuna.journal'}, asking {remaining}"
        )
        report = self.report = SweepReport(name=spec.name, run_id=new_run_id())
        report.runner = self.executor.choose(remaining)
        if remaining:
            log(f"  evaluating up to {remaining:,} trials on {report.runner}")
        self.stop = ""
        while remaining > 0 and not self.stop:
            remaining -= self._batch(min(int(self.search.batch_size), remaining))
            if self.progress:
                log(
                    f"  trials {len(study.trials)}: "
                    + ", ".join(f"{k} {v}" for k, v in self.states.items())
                )
        if self.origins:
            log(
                "  trials asked by origin: "
                + ", ".join(f"{k} {v}" for k, v in self.origins.items())
            )
        if self.stop:
            log(f"  {self.stop}; stopped with {remaining:,} of search.n_trials left")
        report.trial_states = self.states
        report.valid = report.evaluated
        report.seconds = time.perf_counter() - t0
        return report

    # -- one batch ---------------------------------------------------------------------------

    def _batch(self, k: int) -> int:
        """Ask until ``k`` new configurations are found (or none is left), evaluate them, tell
        every trial; returns how many new configurations were evaluated."""
        fresh: list = []  # trials of new configurations
        parts: list[pd.DataFrame] = []  # their plan-table rows, in the same order
        repeats: list = []  # (trial, config hash)
        batch_hashes: set[str] = set()
        fill = False
        for step in range(16):  # each round asks the shortfall; drawing unseen ones ends it
            short = k - len(fresh)
            if short <= 0:
                break
            sampled = False
            if step == 0 and (choices := self._local(int(k * LOCAL_SHARE), batch_hashes)):
                trials = self._enqueued(choices)
                self.origins["one step from the best"] += len(choices)
            elif fill:
                choices = self._unseen(short, batch_hashes)
                if not choices:
                    break
                trials = self._enqueued(choices)
                self.origins["drawn uniformly from the unseen"] += len(choices)
            else:
                trials = [self.study.ask() for _ in range(short)]
                choices = [self.space.suggest(t) for t in trials]
                self.origins[f"{self.sampler_kind} sampler"] += len(choices)
                sampled = True
            table = self._table(choices)
            new = []
            for i, (trial, h) in enumerate(zip(trials, table["config_hash"])):
                if h in batch_hashes or h in self.known or h in self.stored:
                    repeats.append((trial, h))
                else:
                    trial.set_user_attr("config_hash", h)
                    batch_hashes.add(h)
                    fresh.append(trial)
                    new.append(i)
            parts.append(table.iloc[new])
            if sampled:  # the sampler mostly repeats itself: fill the batch with unseen ones
                fill = fill or len(new) < REPEAT_SHARE * len(choices)
        if fresh:
            self._evaluate(fresh, pd.concat(parts, ignore_index=True))
        for trial, h in repeats:
            self._tell_repeat(trial, h)
        return len(fresh)

    def _enqueued(self, choices: list[Choice]) -> list:
        """Trials fixed to ``choices`` (enqueued, then asked: the sampler does not choose)."""
        trials = []
        for c in choices:
            self.study.enqueue_trial(self.space.params(c))
            trials.append(self.study.ask())
            assert self.space.suggest(trials[-1]) == c
        return trials

    def _local(self, n: int, taken: set[str]) -> list[Choice]:
        """Up to ``n`` unseen configurations one step from the best ones so far (the best
        first), or [] before any trial completed."""
        done = [
            t
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if "repeat_of" not in t.user_attrs
        ]
        if n <= 0 or not done:
            return []
        if len(self.objectives) == 1:
            best = sorted(done, key=lambda t: t.values[0])[:LOCAL_FROM]
        else:
            front = self.study.best_trials
            best = [front[i] for i in self.rng.permutation(len(front))[:LOCAL_FROM]]
        out: dict[str, Choice] = {}
        for t in best:
            try:
                here = self.space.walk(lambda name, values, p=t.params: p[name])
            except (KeyError, ValueError):  # a trial of another space (an edited sweep)
                continue
            near = self.space.neighbors(here)
            if not near:
                continue
            near = [near[i] for i in self.rng.permutation(len(near))]
            for c, h in zip(near, self._table(near)["config_hash"]):
                if not (h in taken or h in self.known or h in self.stored or h in out):
                    out[h] = c
            if len(out) >= n:
                break
        return list(out.values())[:n]

    def _table(self, choices: list[Choice]) -> pd.DataFrame:
        table = self.space.table(choices)
        if self.spec.memory_limit_bytes is not None:
            table["usable_memory"] = float(self.spec.memory_limit_bytes)
        table["timing"] = self.spec.timing
        return table.assign(config_hash=config_hash(table).to_numpy())

    def _unseen(self, n: int, taken: set[str]) -> list[Choice]:
        """Up to ``n`` configurations not yet evaluated, drawn uniformly; [] when none is left."""
        seen = lambda h: h in taken or h in self.known or h in self.stored  # noqa: E731
        out: dict[str, Choice] = {}
        for _ in range(4):
            draw = self.space.random(self.rng, max(4 * n, 64))
            for c, h in zip(draw, self._table(draw)["config_hash"]):
                if not seen(h) and h not in out:
                    out[h] = c
            if len(out) >= n:
                return list(out.values())[:n]
        if self.space.total <= ENUMERATE_UNSEEN:
            every = self.space.every()
            left = [c for c, h in zip(every, self._table(every)["config_hash"]) if not seen(h)]
            if not left:
                self.stop = (
                    f"search space exhausted: all {self.space.total:,} valid configurations "
                    "are evaluated"
                )
            return [left[i] for i in self.rng.permutation(len(left))[:n]]
        if not out:
            self.stop = (
                f"no configuration left unevaluated in {4 * max(4 * n, 64):,} uniform draws "
                f"from {self.space.total:,}"
            )
        return list(out.values())

    def _tell_repeat(self, trial, h: str) -> None:
        outcome = self.known.get(h) or self._stored_outcome(h)
        trial.set_user_attr("repeat_of", h)  # the reason, if any, is the first trial's
        state, values, _ = outcome
        if state == "complete":
            self.study.tell(trial, values)
        else:
            self.study.tell(trial, state=STATE[state])
        self.states["repeat (stored outcome told, not evaluated)"] += 1

    def _stored_outcome(self, h: str) -> tuple[str, list[float] | None, str]:
        """The outcome of a configuration the folder holds but the study does not (the
        folder's outcomes are read once, when the first such repeat comes)."""
        if self.stored_outcomes is None:
            cols = ["config_hash", "status", "reason", "step_s", "num_gpus", "mem_total_bytes"]
            self.stored_outcomes = {}
            for _, row in self.store.read(columns=cols).iterrows():
                reason = "" if pd.isna(row["reason"]) else str(row["reason"])
                if row["status"] == "ok":
                    outcome = ("complete", _objective_values(row, self.objectives), "")
                elif row["status"] == "infeasible":
                    outcome = ("pruned", None, reason or "does not fit in memory")
                else:
                    outcome = ("fail", None, reason or str(row["status"]))
                self.stored_outcomes[row["config_hash"]] = outcome
        outcome = self.stored_outcomes.get(h, ("fail", None, "stored row could not be read"))
        self.known[h] = outcome
        return outcome

    def _evaluate(self, trials: list, table: pd.DataFrame) -> None:
        """Screen memory, evaluate what fits, write the rows, tell each trial."""
        spec, report = self.spec, self.report
        mem = evaluate_table(table, subset="memory")
        fits = (mem["mem_headroom_bytes"] >= 0).to_numpy()
        written, tells = [], []
        # infeasible: told PRUNED, never fully evaluated
        if (~fits).any():
            rows = finalize_rows(table[~fits], mem[~fits], spec.name, report.run_id)
            need = mem["mem_total"].to_numpy()[~fits] / GIB
            have = table["usable_memory"].to_numpy()[~fits] / GIB
            reasons = [
                f"needs {n:.1f} GiB > usable {h:.1f} GiB (short {n - h:.1f} GiB)"
                for n, h in zip(need, have)
            ]
            rows["status"] = "infeasible"
            rows["reason"] = reasons
            for i, reason in zip(np.flatnonzero(~fits), reasons):
                tells.append((trials[i], table["config_hash"].iat[i], "pruned", None, reason))
                self.states["pruned (does not fit in memory)"] += 1
            written.append(rows)
        if fits.any():
            batch = table[fits].reset_index(drop=True)
            fit_trials = [t for t, f in zip(trials, fits) if f]
            ((_, result),) = list(
                self.executor.map(
                    evaluate_batch, [(0, (batch, spec.name, report.run_id, self.measured_gpu))]
                )
            )
            if isinstance(result, BaseException):
                msg = f"{type(result).__name__}: {result}"
                for t, h in zip(fit_trials, batch["config_hash"]):
                    tells.append((t, h, "fail", None, msg))
                    self.states["fail (error)"] += 1
                written.append(error_rows(batch, msg, spec.name, report.run_id))
            else:
                for t, (_, r) in zip(fit_trials, result.iterrows()):
                    values = _objective_values(r, self.objectives)
                    if r["status"] == "ok" and all(math.isfinite(v) for v in values):
                        tells.append((t, r["config_hash"], "complete", values, ""))
                        self.states["complete"] += 1
                    else:
                        why = str(r["reason"] or "") or "no finite objective value"
                        tells.append((t, r["config_hash"], "fail", None, why))
                        self.states["fail (evaluated without a result)"] += 1
                written.append(result)
        rows = pd.concat(written, ignore_index=True)
        rows = rows[~rows["config_hash"].isin(self.stored)].drop_duplicates("config_hash")
        self.stored.update(rows["config_hash"])
        self.store.write(rows)  # before the tells: a run killed between them leaves the
        # trials RUNNING (abandoned on rerun) and the rows stored (repeats on rerun)
        report.evaluated += len(rows)
        report.status.update(rows["status"].value_counts().to_dict())
        for tell in tells:
            self._tell(*tell)

    def _tell(self, trial, h: str, state: str, values, reason: str) -> None:
        if reason:
            trial.set_user_attr("reason", reason)
        if state == "complete":
            self.study.tell(trial, values)
        else:
            self.study.tell(trial, state=STATE[state])
        self.known[h] = (state, values, reason)
