"""Optuna search for spaces too large to enumerate (GPU counts x plans x hardware co-design).

Optuna is driven directly with ask/tell in batches (not through Hydra's sweeper plugin): a
batch of trials is asked, turned into plans, screened with the cheap compiled memory
expressions, and only the plans that fit are evaluated in full (one executor task per batch).
Trials whose plan does not fit are told ``PRUNED`` (reason in the trial's user attributes and
in the result row); plans that break a divisibility rule are told ``FAIL``. The study lives in
an Optuna journal file beside the sweep's results, so a rerun resumes it and
``optuna-dashboard results/<sweep>/_optuna.journal`` can open it. Several objectives (e.g.
``[step_s, num_gpus, mem_total_bytes]``) make it a multi-objective study (NSGA-II).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from stage_dse.cost.table import evaluate_table, plan_row
from stage_dse.errors import ConfigError
from stage_dse.results.schema import config_hash
from stage_dse.results.store import ResultStore, new_run_id
from stage_dse.runner.evaluate import error_rows, evaluate_batch, finalize_rows, invalid_rows
from stage_dse.runner.executors import Executor
from stage_dse.runner.sweep import SweepReport
from stage_dse.spec import ParallelPlan
from stage_dse.spec.stages import STAGE_SYMBOLS, stage_values
from stage_dse.spec.sweep import OBJECTIVES, OptunaSpec, SweepSpec, divisors

JOURNAL_LOCK_SUFFIX = ".lock"
"""Optuna's journal lock file: ``<journal>.lock`` (optuna.storages.journal)."""

__all__ = ["OBJECTIVES", "run_optuna"]

GIB = 2.0**30


def _objective_values(row: pd.Series, objectives: list[str]) -> list[float]:
    out = []
    for name in objectives:
        if name == "gpu_seconds":
            out.append(float(row["step_s"]) * float(row["num_gpus"]))
        else:
            out.append(float(row[name]))
    return out


def _sampler(kind: str, seed: int, n_obj: int) -> optuna.samplers.BaseSampler:
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError(f"search.sampler={kind!r} is not one of: tpe, nsga2, random")


def run_optuna(
    spec: SweepSpec,
    search: OptunaSpec,
    executor: Executor,
    store: ResultStore,
    progress: bool = True,
    log=print,
) -> SweepReport:
    t0 = time.perf_counter()
    model = spec.models[0]
    hardware = {hw.name: hw for hw in (*spec.hardware, *search.hardware)}
    gpus = sorted(set(search.gpus or spec.gpu_counts))
    space = spec.space
    top = max(gpus)

    def choices(name: str, limit: int | None = None, divides: tuple[int, ...] = ()) -> list[int]:
        """The axis's values that can be valid whatever the GPU count: not above ``limit`` and
        dividing each of ``divides`` (the rules that depend on the model alone), so that the
        sampler does not spend trials on plans the model rules out."""
        values = space.degrees(name, top)
        return [
            v for v in values if (limit is None or v <= limit) and all(d % v == 0 for d in divides)
        ] or values

    batch = spec.training.global_batch_size
    axes: dict[str, list] = {
        "num_gpus": gpus,
        "hardware": sorted(hardware),
        "tp": choices(
            "tp", model.num_heads, (model.num_heads, model.num_kv_heads, model.vocab_size)
        ),
        "pp": choices("pp", model.num_layers),
        "cp": choices("cp", divides=(spec.training.seq_len,)),
        "micro_batch_size": [b for b in sorted(set(space.micro_batch_size)) if batch % b == 0]
        or sorted(set(space.micro_batch_size)),
        "zero_stage": sorted(set(space.zero_stage)),
        "recompute": list(space.recompute),
        "sequence_parallel": list(space.sequence_parallel),
        "attention": list(space.attention),
        "virtual_stages": sorted(set(space.virtual_stages)),
        "stage_layers": list(space.stage_layers),
        "rank_order": list(space.rank_order),
    }
    if model.is_moe:
        axes["ep"] = divisors(model.num_experts) if space.ep == "auto" else sorted(set(space.ep))
        axes["expert_tensor_parallel"] = list(dict.fromkeys(space.expert_tensor_parallel))
    if search.hbm_gib:
        axes["hbm_gib"] = sorted(float(x) for x in search.hbm_gib)
    if search.inter_gbit_s:
        axes["inter_gbit_s"] = sorted(float(x) for x in search.inter_gbit_s)

    replaced = store.prepare(log)
    try:
        store.check_workload("training")
        return _run_study(spec, search, executor, store, progress, log, replaced, axes, t0)
    finally:
        store.release()


def _run_study(spec, search, executor, store, progress, log, replaced, axes, t0) -> SweepReport:
    objectives = list(search.objectives)
    model = spec.models[0]
    hardware = {hw.name: hw for hw in (*spec.hardware, *search.hardware)}
    cluster0 = spec.cluster
    space = spec.space
    if replaced:
        log(f"removed {replaced} part files of another stage_dse version (replace_stale)")
    journal = store.root / "_optuna.journal"
    # this process holds the folder's writer lock: a journal lock file left now belongs to a
    # run that was killed, and waiting out Optuna's grace period would gain nothing
    Path(str(journal) + JOURNAL_LOCK_SUFFIX).unlink(missing_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    directions = ["minimize"] * len(objectives)
    sampler_kind = search.sampler if len(objectives) == 1 else "nsga2"
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # before the study's "created" line
    study = optuna.create_study(
        storage=storage,
        study_name=spec.name,
        sampler=_sampler(sampler_kind, int(search.seed), len(objectives)),
        directions=directions,
        load_if_exists=True,
    )
    # trials a killed run left RUNNING are failed and not counted toward n_trials
    abandoned = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_user_attr(trial._trial_id, "reason", "abandoned by a run that ended")
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        abandoned += 1
    if abandoned:
        log(f"{abandoned} trials left running by an earlier run were marked failed")
    counted = [
        t
        for t in study.get_trials(deepcopy=False)
        if "abandoned" not in str(t.user_attrs.get("reason", ""))
    ]
    existing = len(counted)
    remaining = max(0, int(search.n_trials) - existing)
    log(
        f"sweep {spec.name}: optuna {sampler_kind} over {', '.join(axes)}; objectives "
        f"{objectives}; {existing} trials in {store.root / '_optuna.journal'}, asking {remaining}"
    )
    report = SweepReport(name=spec.name, run_id=new_run_id())
    measured_gpu = None
    if spec.timing == "measured":
        from stage_dse.kernels.tables import table_set

        measured_gpu = {name: table_set(hw) for name, hw in hardware.items()}
    report.runner = executor.choose(remaining)
    if remaining:
        log(f"  evaluating up to {remaining:,} trials on {report.runner}")
    done = store.hashes()
    states: Counter = Counter()
    while remaining > 0:
        k = min(int(search.batch_size), remaining)
        remaining -= k
        trials = [study.ask() for _ in range(k)]
        valid_rows, valid_trials, bad_rows, bad_reasons = [], [], [], []
        for trial in trials:
            p = _suggest(trial, axes, model, spec.training)
            hw = hardware[p["hardware"]]
            if "hbm_gib" in p:
                hw = hw.replace(hbm_bytes=p["hbm_gib"] * GIB, name=f"{hw.name}@{p['hbm_gib']:g}GiB")
            cluster = cluster0.replace(num_gpus=p["num_gpus"])
            if "inter_gbit_s" in p:
                cluster = cluster.replace(inter_bandwidth_bytes_per_s=p["inter_gbit_s"] * 1e9 / 8)
            mp = p["tp"] * p["pp"] * p["cp"]
            try:
                if p["num_gpus"] % mp:
                    raise ConfigError(f"tp*pp*cp({mp}) does not divide num_gpus({p['num_gpus']})")
                v = p["virtual_stages"]
                plan = ParallelPlan(
                    dp=p["num_gpus"] // mp,
                    ep=p.get("ep", 1),
                    expert_tensor_parallel=p.get("expert_tensor_parallel", False),
                    tp=p["tp"],
                    pp=p["pp"],
                    cp=p["cp"],
                    micro_batch_size=p["micro_batch_size"],
                    zero_stage=p["zero_stage"],
                    recompute=p["recompute"],
                    sequence_parallel=p["sequence_parallel"],
                    attention=p["attention"],
                    schedule="interleaved" if v > 1 else "1f1b",
                    virtual_stages=v,
                    stage_layers=p["stage_layers"],
                    rank_order=p["rank_order"],
                    overlap_grad_reduce=space.overlap_grad_reduce,
                    overlap_param_gather=space.overlap_param_gather,
                    tp_comm_overlap=space.tp_comm_overlap,
                    tp_dgrad_overlap=space.tp_dgrad_overlap,
                    ep_comm_overlap=space.ep_comm_overlap,
                )
                row = plan_row(model, spec.training, plan, hw, cluster)
            except ConfigError as exc:
                trial.set_user_attr("reason", str(exc))
                study.tell(trial, state=TrialState.FAIL)
                states["fail (invalid plan)"] += 1
                bad_rows.append(_invalid_config(model, spec, hw, cluster, p))
                bad_reasons.append(str(exc))
                continue
            if spec.memory_limit_bytes is not None:
                row["usable_memory"] = spec.memory_limit_bytes
            row["timing"] = spec.timing
            valid_rows.append(row)
            valid_trials.append(trial)
        written = []
        if bad_rows:
            cfg = pd.DataFrame(bad_rows)
            written.append(invalid_rows(cfg, bad_reasons, spec.name, report.run_id))
        if valid_rows:
            table = pd.DataFrame(valid_rows)
            table["config_hash"] = config_hash(table).to_numpy()
            mem = evaluate_table(table, subset="memory")
            fits = (mem["mem_headroom_bytes"] >= 0).to_numpy()
            # infeasible: told PRUNED, never fully evaluated
            for i in np.flatnonzero(~fits):
                need = mem["mem_total"].iat[i] / GIB
                have = table["usable_memory"].iat[i] / GIB
                reason = (
                    f"needs {need:.1f} GiB > usable {have:.1f} GiB (short {need - have:.1f} GiB)"
                )
                valid_trials[i].set_user_attr("reason", reason)
                study.tell(valid_trials[i], state=TrialState.PRUNED)
                states["pruned (does not fit in memory)"] += 1
            if (~fits).any():
                rows = finalize_rows(table[~fits], mem[~fits], spec.name, report.run_id)
                rows["status"] = "infeasible"
                need = mem["mem_total"].to_numpy()[~fits] / GIB
                have = table["usable_memory"].to_numpy()[~fits] / GIB
                rows["reason"] = [
                    f"needs {n:.1f} GiB > usable {h:.1f} GiB (short {n - h:.1f} GiB)"
                    for n, h in zip(need, have)
                ]
                written.append(rows)
            if fits.any():
                batch = table[fits].reset_index(drop=True)
                fit_trials = [t for t, f in zip(valid_trials, fits) if f]
                ((_, result),) = list(
                    executor.map(
                        evaluate_batch, [(0, (batch, spec.name, report.run_id, measured_gpu))]
                    )
                )
                if isinstance(result, BaseException):
                    msg = f"{type(result).__name__}: {result}"
                    for t in fit_trials:
                        t.set_user_attr("reason", msg)
                        study.tell(t, state=TrialState.FAIL)
                        states["fail (error)"] += 1
                    written.append(error_rows(batch, msg, spec.name, report.run_id))
                else:
                    for t, (_, r) in zip(fit_trials, result.iterrows()):
                        study.tell(t, _objective_values(r, objectives))
                        states["complete"] += 1
                    written.append(result)
        if written:
            rows = pd.concat(written, ignore_index=True)
            rows = rows.drop_duplicates("config_hash")
            rows = rows[~rows["config_hash"].isin(done)]
            done.update(rows["config_hash"])
            store.write(rows)
            report.evaluated += len(rows)
            report.status.update(rows["status"].value_counts().to_dict())
        if progress:
            log(
                f"  trials {len(study.trials)}: " + ", ".join(f"{k} {v}" for k, v in states.items())
            )
    report.trial_states = states
    report.seconds = time.perf_counter() - t0
    report.valid = report.evaluated
    return report


def _suggest(trial, axes: dict[str, list], model, training) -> dict:
    """One trial's choices. The axes whose valid values depend on earlier choices are sampled
    under a name that carries what they depend on, so every choice offered is valid: the
    (tp, pp, cp) layout under the GPU count (``tp_pp_cp@64``: tp*pp*cp divides it), the
    micro-batch under the data-parallel degree (``micro_batch_size@dp16``: dp*micro_batch
    divides the global batch), virtual stages under pp (only pp > 1 interleaves), sequence
    parallelism only when tp > 1. TPE and NSGA-II treat such conditional names as they treat
    any conditional parameter; an axis with no valid value is sampled unconditioned and the
    plan is refused with the rule's reason."""
    plain = ("num_gpus", "tp", "pp", "cp", "micro_batch_size", "sequence_parallel")
    p = {n: trial.suggest_categorical(n, v) for n, v in axes.items() if n not in plain}
    p.pop("virtual_stages")
    g = p["num_gpus"] = trial.suggest_categorical("num_gpus", axes["num_gpus"])
    layouts = [
        f"{t}-{q}-{c}"
        for t in axes["tp"]
        for q in axes["pp"]
        for c in axes["cp"]
        if g % (t * q * c) == 0 and (t > 1 or False in axes["sequence_parallel"])
    ]
    if layouts:
        t, q, c = map(int, trial.suggest_categorical(f"tp_pp_cp@{g}", layouts).split("-"))
    else:
        t, q, c = (trial.suggest_categorical(n, axes[n]) for n in ("tp", "pp", "cp"))
    p.update(tp=t, pp=q, cp=c)
    dp = max(1, g // (t * q * c))
    batch = training.global_batch_size
    mbs = [b for b in axes["micro_batch_size"] if batch % (dp * b) == 0]
    p["micro_batch_size"] = (
        trial.suggest_categorical(f"micro_batch_size@dp{dp}", mbs)
        if mbs
        else trial.suggest_categorical("micro_batch_size", axes["micro_batch_size"])
    )
    sp = [x for x in axes["sequence_parallel"] if t > 1 or not x]
    p["sequence_parallel"] = (
        trial.suggest_categorical("sequence_parallel", axes["sequence_parallel"])
        if t > 1 or not sp
        else False
    )
    chunks = [v for v in axes["virtual_stages"] if v == 1 or q > 1]
    chunks = [v for v in chunks if v == 1 or model.num_layers % (q * v) == 0] or chunks
    p["virtual_stages"] = (
        trial.suggest_categorical(f"virtual_stages@pp{q}", chunks)
        if len(chunks) > 1
        else (chunks or axes["virtual_stages"])[0]
    )
    return p


def _stage_values_or_zero(model, p: dict) -> dict[str, int]:
    """The split's symbol values, zeros where the trial's split does not fit its stages."""
    try:
        return stage_values(model.num_layers, p["pp"], p["virtual_stages"], p["stage_layers"])
    except ConfigError:
        return dict.fromkeys(STAGE_SYMBOLS, 0)


def _invalid_config(model, spec, hw, cluster, p: dict) -> dict:
    """Configuration columns of a plan that failed validation (recorded as an invalid row)."""
    from stage_dse.cost.bind import bind_hardware, model_values
    from stage_dse.cost.table import model_columns

    mp = p["tp"] * p["pp"] * p["cp"]
    row: dict = {
        **model_columns(model, spec.training),
        "hardware": hw.name,
        "cluster": cluster.name,
    }
    row.update(
        {
            "num_gpus": p["num_gpus"],
            "micro_batch": p["micro_batch_size"],
            **model_values(model, spec.training),
            "dp": p["num_gpus"] // mp if p["num_gpus"] % mp == 0 else 0,
            "tp": p["tp"],
            "pp": p["pp"],
            "cp": p["cp"],
            "ep": p.get("ep", 1),
            "expert_tensor_parallel": p.get("expert_tensor_parallel", False),
            "virtual_stages": p["virtual_stages"],
            "stage_layers": p["stage_layers"],
            **_stage_values_or_zero(model, p),
            **bind_hardware(hw, cluster),
            "sequence_parallel": p["sequence_parallel"],
            "attention": p["attention"],
            "zero_stage": p["zero_stage"],
            "recompute": p["recompute"],
            "schedule": "interleaved" if p["virtual_stages"] > 1 else "1f1b",
            "rank_order": p["rank_order"],
            "overlap_grad_reduce": spec.space.overlap_grad_reduce,
            "overlap_param_gather": spec.space.overlap_param_gather,
            "tp_comm_overlap": spec.space.tp_comm_overlap,
            "tp_dgrad_overlap": spec.space.tp_dgrad_overlap,
            "ep_comm_overlap": spec.space.ep_comm_overlap,
            "zero_sync_per_tensor": False,
        }
    )
    return row
