"""``stage-dse``: run a sweep.

``stage-dse`` is a Hydra app over ``conf/`` (and the experiments in ``sweeps/``): one job is one
inner sweep, ``-m`` fans out over outer axes. The app composes the config, converts it to specs
(:mod:`stage_dse.config.schema`), runs the sweep on the configured executor and prints a summary;
bad input ends with a one-line message naming the field and exit code 2.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import hydra
from omegaconf import DictConfig

from stage_dse.cli._common import check_jobs, fail, split_args
from stage_dse.cli.serve import check_serving_job, run_serving_job
from stage_dse.config.presets import conf_dir
from stage_dse.config.schema import check_top_level, register_schemas, to_optuna, to_sweep
from stage_dse.errors import ConfigError, StageDseError

__all__ = ["main", "run"]

GIB = 2.0**30

register_schemas()


def _fmt_counter(c: Counter, indent: str = "  ") -> str:
    return "\n".join(f"{indent}{n:>12,}  {reason}" for reason, n in c.most_common())


def _rows_of_run(
    df,
    workload: str,
    models,
    hardware,
    cluster: str,
    gpus=None,
    training=None,
    run_id=None,
    timing: str = "roofline",
):
    """The rows of one run's configurations (:func:`stage_dse.runner.sweep.rows_of_run`),
    saying how many other rows the folder holds and how many were reused."""
    from stage_dse.runner.sweep import rows_of_run

    rows = rows_of_run(df, workload, models, hardware, cluster, gpus, training, timing)
    earlier = 0 if run_id is None else int((rows["run_id"].astype(str) != run_id).sum())
    print_run_rows(len(rows), len(df), earlier)
    return rows


def print_run_rows(rows: int, folder_rows: int, earlier: int) -> None:
    """What a summary covers: this run's configurations among the folder's rows, and how many
    of them earlier runs evaluated."""
    if rows < folder_rows:
        print(
            f"(summary over the {rows:,} rows of this run's configurations; "
            f"{folder_rows - rows:,} other rows in the folder are not shown)"
        )
    if earlier:
        print(f"({earlier:,} of them were evaluated by earlier runs and reused)")


def _print_outcomes(root, folder_rows: int, report, rejected_title: str, repeats=()) -> None:
    print(
        f"\nresults: {root} ({folder_rows:,} rows; this run, {report.run_id}, evaluated "
        f"{report.evaluated:,} in {report.seconds:.1f} s)"
    )
    if repeats:
        print(f"repeated values are one value: {'; '.join(repeats)}")
    if report.runner:
        print(f"runner: {report.runner}")
    if report.status:
        print("outcomes of this run:")
        print(_fmt_counter(report.status))
    if report.rejected:
        print(rejected_title)
        print(_fmt_counter(report.rejected))


AXES = (
    "num_gpus",
    *(
        f"plan.{a}"
        for a in (
            "tp", "pp", "cp", "ep", "expert_tensor_parallel", "ep_over_tp", "micro_batch_size",
            "zero_stage", "shard_group",
            "recompute", "sequence_parallel", "attention", "virtual_stages", "stage_layers",
            "rank_order",
        )
    ),
    *(
        f"serving.{a}"
        for a in ("tp", "pp", "ep", "batch_size", "prompt_len", "prefill_budget", "hardware")
    ),
    *(f"search.{a}" for a in ("gpus", "hardware", "hbm_gib", "inter_gbit_s", "objectives")),
)  # fmt: skip
"""The list-valued options that are sets of values to sweep (a repeated value is one value)."""


def check_run_options(cfg: DictConfig) -> None:
    """The options of the run itself (where results go, how many rows to show, where and how
    to evaluate), checked before anything is written."""
    check_results_folder(cfg.results_dir, cfg.sweep_name)
    top_k = cfg.top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be an integer >= 1 (rows of the top table), got {top_k!r}")
    if cfg.search.kind not in ("grid", "optuna"):
        raise ConfigError(f"search.kind={cfg.search.kind!r} is not one of: grid, optuna")
    if cfg.runner.batch_size <= 0:
        raise ConfigError(f"runner.batch_size must be > 0, got {cfg.runner.batch_size}")
    if not 0 < cfg.runner.connect_timeout_s < float("inf"):
        raise ConfigError(
            f"runner.connect_timeout_s must be a number of seconds > 0, got "
            f"{cfg.runner.connect_timeout_s}"
        )


def check_results_folder(results_dir: object, sweep_name: object) -> None:
    """``results_dir/sweep_name`` must be a folder this process can create or write: a plain
    sweep name, a results_dir that is not empty (that would write into the working directory)
    and, at the nearest folder that exists, a writable directory."""
    import os

    name = sweep_name
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ConfigError(
            f"sweep_name={name!r} must be a plain folder name (no '/', no leading '.')"
        )
    if not isinstance(results_dir, str) or not results_dir.strip():
        raise ConfigError(
            f"results_dir={results_dir!r} must name a folder (empty would write into the working "
            "directory); e.g. results_dir=results"
        )
    nearest = Path(results_dir) / name
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ConfigError(f"results_dir={results_dir}: {nearest} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(
            f"results_dir={results_dir} is not writable ({nearest}: permission denied or a "
            "read-only file system); choose another results_dir or fix its permissions"
        )


def merge_repeats(cfg: DictConfig) -> list[str]:
    """Make each repeated value of a swept axis one value, in place (``num_gpus=[64,64]`` is
    ``[64]``: the same configurations twice would be evaluated and stored twice); one note per
    axis changed. ``plan.stage_layers`` given as one split (a list of integers) is left alone:
    its repeats are layer counts."""
    from omegaconf import ListConfig, OmegaConf

    notes = []
    for key in AXES:
        node = OmegaConf.select(cfg, key)
        if not isinstance(node, ListConfig):
            continue
        values = OmegaConf.to_container(node, resolve=True)
        if key == "plan.stage_layers" and all(isinstance(v, int) for v in values):
            continue
        unique: list = []
        for v in values:
            if not any(type(v) is type(u) and v == u for u in unique):
                unique.append(v)
        if len(unique) < len(values):
            OmegaConf.update(cfg, key, unique, merge=False)
            notes.append(f"{key}={_flat(values)} is {_flat(unique)}")
    return notes


def _flat(values: list) -> str:
    return "[" + ",".join(str(v).replace(" ", "") for v in values) + "]"


def run(cfg: DictConfig) -> int:
    """One Hydra job: the whole sweep; returns the number of rows evaluated."""
    from stage_dse.results.store import ResultStore
    from stage_dse.runner.executors import make_executor
    from stage_dse.runner.sweep import run_grid

    check_top_level(cfg)
    check_run_options(cfg)
    repeats = merge_repeats(cfg)
    if cfg.workload == "serving" or cfg.mode == "recommend":
        return run_serving_job(cfg, repeats)
    if cfg.workload != "training":
        raise StageDseError(f"workload={cfg.workload!r} is not one of: training, serving")
    spec = to_sweep(cfg)
    search = to_optuna(cfg) if cfg.search.kind == "optuna" else None
    store = ResultStore(Path(cfg.results_dir) / spec.name, replace_stale=cfg.replace_stale)
    executor = make_executor(
        cfg.runner.kind, cfg.runner.address, cfg.runner.num_cpus, cfg.runner.connect_timeout_s
    )
    try:
        if search is not None:
            from stage_dse.runner.optuna_driver import run_optuna

            report = run_optuna(spec, search, executor, store, progress=cfg.runner.progress)
        else:
            report = run_grid(
                spec,
                executor,
                store,
                batch_size=cfg.runner.batch_size,
                progress=cfg.runner.progress,
                top_k=cfg.top_k,
            )
    finally:
        executor.close()
    if search is None and report.valid == 0:
        rules = "; ".join(f"{r} ({n:,})" for r, n in report.rejected.most_common(3))
        raise StageDseError(
            f"no valid plan among {report.candidates:,} candidates, rejected by: "
            f"{rules or 'no candidates'}; widen the plan axes or change the model, GPU counts "
            "or batch"
        )
    if search is None:
        _grid_summary(cfg, spec, store, report, repeats)
    else:
        _optuna_summary(cfg, spec, search, store, report, repeats)
    return report.evaluated


def _print_run_notes(cfg, spec, search, measured_share) -> None:
    _print_memory_basis(spec, search)
    if cfg.mode == "budget" and cfg.budget.max_gpus is not None:
        print(
            f"GPU counts tried (budget.max_gpus={cfg.budget.max_gpus}): "
            f"{', '.join(map(str, spec.gpu_counts))} (powers of two up to a node, then node "
            "multiples doubling, and the budget itself; other counts: num_gpus=[...] instead)"
        )
    if spec.timing == "measured":
        from stage_dse.runner.sweep import tables_notes

        for note in tables_notes(spec.hardware):
            print(note)
        if measured_share is not None:
            print(
                f"timing: measured kernel tables for {measured_share:.0%} of the step time "
                "(median over this run's plans), roofline for the rest"
            )


def _grid_summary(cfg, spec, store, report, repeats) -> None:
    """The summary of a grid sweep, from what the run aggregated as its rows streamed by
    (:class:`stage_dse.runner.aggregate.RunSummary`): the dataset is not read back."""
    summary = report.summary
    _print_outcomes(
        store.root,
        report.folder_rows,
        report,
        "plans rejected before evaluation, by rule:",
        repeats,
    )
    _print_run_notes(cfg, spec, None, summary.median_measured_share())
    print_run_rows(summary.rows, report.folder_rows, 0)  # its reuse is said below
    if summary.reused:
        from stage_dse.results.schema import RESULT_SCHEMA
        from stage_dse.runner.aggregate import SUMMARY_COLUMNS

        print(
            f"({summary.reused:,} of the {summary.rows:,} were evaluated by earlier runs and "
            "reused: their stored values read by a scan filtered on their config_hash, "
            f"{len(SUMMARY_COLUMNS)} of {len(RESULT_SCHEMA)} columns)"
        )
    rank_by = cfg.budget.rank_by if cfg.mode == "budget" else "step_s"
    best = summary.best_per_group()
    if len(best) > 1:
        from stage_dse.runner.sweep import top_table

        table = top_table(best, len(best))
        table = table.drop(columns=["tie"], errors="ignore")  # bests of different groups
        table = table.sort_values(["model", "hardware", "gpus"], kind="stable")
        print("\nfastest feasible plan per model, hardware and GPU count:")
        print(table.to_string(index=False))
    _print_top(cfg, summary.candidates(rank_by), rank_by)
    if cfg.mode == "budget":
        _print_misses(summary.closest_misses())


def _print_top(cfg, rows, rank_by: str) -> None:
    from stage_dse.runner.sweep import TIE_REL, top_table

    top = top_table(rows, cfg.top_k, by=rank_by)
    label = "cheapest (GPU-seconds per step)" if rank_by == "gpu_seconds" else "fastest"
    print(f"\ntop {len(top)} {label} feasible plans:")
    print(top.to_string(index=False) if len(top) else "  none fits")
    if "tie" in top.columns:
        what = "GPU-seconds" if rank_by == "gpu_seconds" else "step times"
        print(
            f"tie: {what} within {TIE_REL:.1%} of each other share a rank (far below the "
            "model's error); among them, more memory headroom is listed first"
        )


def _print_misses(miss) -> None:
    """The closest plans that do not fit (``mode=budget``), least memory short first."""
    if not len(miss):
        return
    miss = miss.assign(short_gib=-miss["mem_headroom_bytes"] / GIB)
    miss = miss.sort_values(["short_gib", "step_s"]).head(5)
    print("\nclosest plans that do not fit:")
    for r in miss.itertuples():
        print(
            f"  gpus={r.num_gpus} dp={r.dp} tp={r.tp} pp={r.pp} cp={r.cp} "
            f"mbs={r.micro_batch} zero={r.zero_stage} recompute={r.recompute}: "
            f"needs {r.mem_total_bytes / GIB:.1f} GiB, misses by {r.short_gib:.2f} GiB "
            f"({-r.mem_headroom_bytes:,.0f} bytes)"
        )


def _optuna_summary(cfg, spec, search, store, report, repeats) -> None:
    """The summary of an Optuna study (a few thousand trials at most): this run's
    configurations read back from the folder."""
    df = store.read()
    _print_outcomes(
        store.root, len(df), report, "plans rejected before evaluation, by rule:", repeats
    )
    share = None
    if spec.timing == "measured":
        ok = df[(df["status"] == "ok") & (df["run_id"] == report.run_id)]
        share = float(ok["measured_share"].median()) if len(ok) else None
    _print_run_notes(cfg, spec, search, share)
    if report.trial_states:
        print("optuna trials by state:")
        print(_fmt_counter(report.trial_states))
    hardware = [hw.name for hw in (*spec.hardware, *search.hardware)]
    gpus = {*spec.gpu_counts, *search.gpus}
    df = _rows_of_run(
        df,
        "training",
        [m.name for m in spec.models],
        hardware,
        spec.cluster.name,
        gpus,
        spec.training,
        report.run_id,
        spec.timing,
    )
    rank_by = cfg.budget.rank_by if cfg.mode == "budget" else "step_s"
    if len(search.objectives) > 1:
        # a multi-objective study answers with its Pareto front, not one ranking
        from stage_dse.results.analysis import pareto
        from stage_dse.runner.sweep import top_table

        scored = df.assign(gpu_seconds=df["step_s"] * df["num_gpus"])
        front = pareto(scored, list(search.objectives))
        table = top_table(front, len(front))
        print(f"\nPareto front over {', '.join(search.objectives)} ({len(table)} plans):")
        print(table.to_string(index=False) if len(table) else "  none fits")
        return
    _print_top(cfg, df, rank_by)
    if cfg.mode == "budget":
        _print_misses(df[df["status"] == "infeasible"])


def _print_memory_basis(spec, search) -> None:
    """The usable memory per GPU each plan was judged against: the hardware the run sampled
    (Optuna's ``search.hardware``) at each capacity it sampled (``search.hbm_gib``), capped by
    ``budget.memory_gib``."""
    limit = spec.memory_limit_bytes
    hardware = (search.hardware if search is not None else ()) or spec.hardware
    capacities = search.hbm_gib if search is not None else ()
    for hw in hardware:
        variants = [hw.replace(hbm_bytes=g * GIB) for g in sorted(capacities)] or [hw]
        usable = [min(v.usable_bytes, limit) if limit else v.usable_bytes for v in variants]
        shown = ", ".join(f"{u / GIB:.1f}" for u in usable)
        axis = f" (search.hbm_gib=[{','.join(f'{g:g}' for g in sorted(capacities))}])"
        print(
            f"memory judged against: {shown} GiB usable per {hw.name} GPU"
            + (axis if capacities else "")
        )


INTERRUPTED = (
    "interrupted: every part written so far is kept; run the same command again to resume "
    "(stored configurations are skipped)"
)


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except StageDseError as exc:
        _forget_run_record()
        sys.exit(fail("stage-dse", str(exc)))
    except KeyboardInterrupt:
        sys.exit(fail("stage-dse", INTERRUPTED, code=130))


def _forget_run_record() -> None:
    """A failed job leaves no record: its Hydra output folder (the composed config under
    ``<results>/<sweep>/_runs/<time>/``) is removed, and the folders above it while empty."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not inside a Hydra job (run() called directly)
        return
    if not (out / ".hydra").is_dir() or any(p.name != ".hydra" for p in out.iterdir()):
        return  # not only Hydra's own record: leave it
    shutil.rmtree(out, ignore_errors=True)
    for parent in out.parents:
        try:
            parent.rmdir()  # only while empty
        except OSError:
            break


def validate_config(cfg: DictConfig) -> None:
    """Everything a job checks before it evaluates anything (specs built, ranges checked)."""
    check_top_level(cfg)
    check_run_options(cfg)
    if cfg.workload == "serving" or cfg.mode == "recommend":
        check_serving_job(cfg)
        return
    to_sweep(cfg)
    if cfg.search.kind == "optuna":
        to_optuna(cfg)


def usage() -> str:
    """``stage-dse --help``: the config groups with their presets and the main options."""
    from stage_dse.config.presets import list_presets

    groups = "\n".join(
        f"  {g:<9} {', '.join(p for p in list_presets(g) if not p.endswith('_schema'))}"
        for g in ("model", "hardware", "cluster", "training", "plan", "search", "runner")
    )
    sweeps = ", ".join(sorted(p.stem for p in (conf_dir().parent / "sweeps").glob("*.yaml")))
    return f"""usage: stage-dse [-m] [GROUP=PRESET ...] [KEY=VALUE ...]

Sweep the parallel plans of a model on a cluster; results go to results/<sweep_name>/.

config groups (GROUP=PRESET):
{groups}
named experiments: +sweep=NAME ({sweeps})

main options:
  num_gpus=[64,128]           GPU counts to sweep
  plan.tp=[1,2,4] plan.pp=auto  plan axes (lists, or auto = every divisor); see conf/plan/
  training.seq_len=8192 training.global_batch_size=1024
  workload=training|serving   serving sweeps use serving.* (tp, pp, batch_size, prompt_len)
  serving.mode=continuous     continuous batching: serving.prefill_budget, serving.arrival_rate
  serving.sla.ttft_ms=1000 serving.sla.tpot_ms=50  front within targets; + target_requests_per_s
  mode=sweep|budget|recommend budget: budget.memory_gib, budget.max_gpus, budget.rank_by
  timing=roofline|measured    measured: kernel tables of the 'measured' extra where they reach
  search=grid|optuna          optuna: search.n_trials, search.objectives=[step_s,num_gpus]
  runner=auto|local|ray       auto: in-process unless the measured cost per plan says Ray is sooner
  runner.address=HOST:PORT    evaluate on an existing Ray cluster (RAY_AUTH_MODE=token: README)
  sweep_name=NAME results_dir=DIR top_k=10 replace_stale=true

  -m                          one job per comma-separated value (validated before any runs)
  --cfg job                   print the composed config; --hydra-help for Hydra's own options
"""


def main() -> None:
    """Console script ``stage-dse``."""
    args = sys.argv[1:]
    if any(a in ("-h", "--help") for a in args):
        print(usage())
        return
    try:
        code = _main(args)
    except KeyboardInterrupt:
        code = fail("stage-dse", INTERRUPTED, code=130)
    if code:
        sys.exit(code)


def _main(args: list[str]) -> int:
    """Check every job before Hydra starts any (nothing is written for a refused run), then
    hand the command line to Hydra with its own flags first."""
    try:
        overrides, unknown, known = split_args(args)
    except StageDseError as exc:
        return fail("stage-dse", str(exc))
    if not unknown:  # Hydra's other flags (--cfg, --info, ...) go to Hydra unchecked
        config_dir = known.get("config_dir")
        config_name = str(known.get("config_name", "config"))
        if config_dir is not None and not Path(str(config_dir)).is_dir():
            return fail("stage-dse", f"--config-dir {config_dir}: no such folder")
        message = check_jobs(
            overrides,
            validate_config,
            None if config_dir is None else str(config_dir),
            config_name,
            multirun=bool(known.get("multirun")),
        )
        if message:
            return fail("stage-dse", message)
        flags = ["-m"] if known.get("multirun") else []
        if config_dir is not None:
            flags += ["--config-dir", str(config_dir)]
        if "config_name" in known:
            flags += ["--config-name", config_name]
        sys.argv = [sys.argv[0], *flags, *overrides]
    _hydra_main()
    return 0


if __name__ == "__main__":  # pragma: no cover
    main()
