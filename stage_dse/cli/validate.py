"""``stage-dse-validate``: the model against the corpus of published, measured runs.

Prints one line per case (published figure, prediction and signed error under each timing
source, the plan the rule chose), one table per timing source with every group's error and
its leave-one-source-out error, and the ranking agreement on published pairs. ``--fit`` reruns
the fit of the physical parameters (:mod:`stage_dse.validation.fit`) and the
leave-one-source-out folds; ``--record`` writes the figures the regression test guards
(``stage_dse/validation/recorded.yaml``).
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from stage_dse.cli._common import OneLineParser, one_line_errors
from stage_dse.cost.table import TIMINGS
from stage_dse.errors import ConfigError
from stage_dse.validation.corpus import load_corpus
from stage_dse.validation.fit import (
    Problem,
    apply_folds,
    checkpoint_dir,
    leave_one_source_out,
    load_parameters,
)
from stage_dse.validation.report import group_summary, mean_or_nan, ranking_pairs
from stage_dse.validation.run import corpus_hash, select

__all__ = ["main", "recorded_path", "run"]


def recorded_path() -> Path:
    return Path(str(files("stage_dse.validation").joinpath("recorded.yaml")))


def read_recorded() -> dict:
    path = recorded_path()
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="stage-dse-validate",
        description="Predict every published run of the corpus (stage_dse/validation/corpus/) "
        "and compare: per case, per group (source and target kind) with leave-one-source-out "
        "error, and the ranking of published pairs. Both timing sources unless timing= says "
        "one (measured needs the extra 'measured').",
    )
    p.add_argument("overrides", nargs="*", metavar="timing=roofline|measured")
    p.add_argument("--kind", choices=("training", "serving"), help="only this kind of case")
    p.add_argument("--source", action="append", default=[], help="only this source id (repeat)")
    p.add_argument("--group", action="append", default=[], help="only this group (repeat)")
    p.add_argument("--corpus", type=Path, help="also read the YAML records under this path")
    p.add_argument("--out", type=Path, help="write every case's row to this .parquet file")
    p.add_argument("--quiet", action="store_true", help="no per-case lines")
    p.add_argument("--fit", action="store_true",
                   help="refit the physical parameters and the leave-one-source-out folds "
                   "(on 2 cores ~1 h wall for roofline, 2-2.5 h for measured; finished "
                   "fits are kept and a rerun of the same command resumes)")  # fmt: skip
    p.add_argument(
        "--record",
        action="store_true",
        help="write the groups' errors (and with --fit the folds) to recorded.yaml",
    )
    return p


@one_line_errors("stage-dse-validate")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from stage_dse.kernels.tables import data_root

    # both sources by default; measured only where its tables are installed
    timings = tuple(TIMINGS) if data_root() is not None else ("roofline",)
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key != "timing" or value not in TIMINGS:
            raise ConfigError(f"{item!r}: expected timing=roofline or timing=measured")
        timings = (value,)
    if args.out is not None and args.out.suffix != ".parquet":
        raise ConfigError(f"--out {args.out}: give a .parquet file name")
    if args.record and (args.kind or args.source or args.group or args.corpus):
        raise ConfigError("--record records the whole packaged corpus: drop the filters")
    if "measured" not in timings and not any(o.startswith("timing=") for o in args.overrides):
        print("note: timing=measured skipped: its kernel tables are not installed "
              "(pip install -e '.[measured]')")  # fmt: skip
    if args.record and timings != tuple(TIMINGS):
        raise ConfigError("--record needs both timing sources (pip install -e '.[measured]')")
    run(args, timings)
    return 0


def run(args, timings: tuple[str, ...]) -> pd.DataFrame:
    t0 = time.process_time()
    every = load_corpus(None, args.corpus)
    for flag, names, known in (
        ("--source", args.source, {c.source.id for c in every}),
        ("--group", args.group, {c.group for c in every}),
    ):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(
                f"{flag} {unknown[0]}: no such {flag[2:]} in the corpus; valid: "
                + ", ".join(sorted(known))
            )
    cases = select(every, args.kind, tuple(args.source), tuple(args.group))
    if not cases:
        raise ConfigError("no case matches --kind/--source/--group together")
    params = load_parameters()
    recorded = read_recorded()
    parts, fits = [], {}
    prepared = Problem(cases, timings[0])
    for timing in timings:
        problem = prepared.retimed(timing)
        if args.fit:
            saved = checkpoint_dir(problem, params, corpus_hash(args.corpus))
            if not args.quiet or saved.is_dir():
                print(f"fit timing={timing}: finished fits kept in {saved} (a rerun resumes)")
            fitted, res = leave_one_source_out(
                problem, params, checkpoint=saved, progress=_progress(timing)
            )
            fits[timing] = fitted
        else:
            held = recorded.get("timings", {}).get(timing, {})
            res = apply_folds(problem, params, held.get("folds", {}), held.get("unseen"))
        res["timing_run"] = timing
        parts.append(res)
    results = pd.concat(parts, ignore_index=True)
    if not args.quiet:
        _print_cases(results, timings)
    if args.fit:
        _print_fit(fits)
    summaries = {}
    for timing in timings:
        res = results[results["timing_run"] == timing]
        pairs = ranking_pairs(res)
        summaries[timing] = (group_summary(res, pairs), pairs, res)
        _print_groups(timing, summaries[timing][0], pairs, res)
    _print_notes(results, timings)
    if recorded.get("corpus") and recorded["corpus"] != corpus_hash() and not args.fit:
        print("note: the corpus changed since the recorded leave-one-source-out folds "
              "(rerun with --fit --record)")  # fmt: skip
    if args.record:
        _record(summaries, fits, recorded)
        print(f"recorded {recorded_path()}")
    if args.out is not None:
        results.to_parquet(args.out, index=False)
        print(f"wrote {len(results)} rows to {args.out}")
    print(f"validated {len(cases)} cases in {time.process_time() - t0:.1f} CPU-s")
    return results


def _fmt(v: float) -> str:
    if not np.isfinite(v):
        return "-"
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"


def _pct(v: float, sign: str = "") -> str:
    return f"{v:{sign}.2f}" if np.isfinite(v) else "-"


def _print_cases(results: pd.DataFrame, timings) -> None:
    first = results[results["timing_run"] == timings[0]].set_index("case")
    others = {t: results[results["timing_run"] == t].set_index("case") for t in timings[1:]}
    head = "  ".join(f"{'pred ' + t[:4]:>9s} {'err':>7s}" for t in timings)
    print(f"{'case':60s} {'kind':20s} {'published':>10s}  {head}  plan")
    for cid, r in first.iterrows():
        if r["status"] == "unexpressible":
            print(f"{cid:60s} {r['kind']:20s} {_fmt(r['published']):>10s}  cannot express: "
                  f"{r['reason']}")  # fmt: skip
            continue
        cells = [f"{_fmt(r['predicted']):>9s} {r['err_pct']:+6.1f}%"]
        for t in timings[1:]:
            o = others[t].loc[cid]
            cells.append(f"{_fmt(o['predicted']):>9s} {o['err_pct']:+6.1f}%")
        flag = "  (no allowed plan fits)" if r["status"] == "oom" else ""
        print(f"{cid:60s} {r['kind']:20s} {_fmt(r['published']):>10s}  {'  '.join(cells)}  "
              f"{r['plan']}{flag}")  # fmt: skip


def _print_groups(timing: str, summary: pd.DataFrame, pairs: pd.DataFrame, res) -> None:
    print(
        f"\ntiming={timing}: error % = predicted / published - 1 (training: of the step time, "
        "negative = too fast; serving: of the metric); loso: leave-one-source-out"
    )
    print(f"  {'group':50s} {'n':>4s} {'cannot':>6s} {'mean|e|':>8s} {'max|e|':>8s} "
          f"{'signed':>7s} {'loso':>7s} {'pairs':>7s}")  # fmt: skip
    for r in summary.itertuples():
        loso = getattr(r, "loso_mean_abs_pct", np.nan)
        pair = f"{r.pairs_agree}/{r.pairs}" if r.pairs else "-"
        print(
            f"  {r.group:50s} {r.n:4d} {r.unexpressible:6d} {_pct(r.mean_abs_pct):>8s} "
            f"{_pct(r.max_abs_pct):>8s} {_pct(r.mean_signed_pct, '+'):>7s} {_pct(loso):>7s} "
            f"{pair:>7s}"
        )
    for kind, grp in res.groupby("corpus", sort=False):
        have = grp[grp["status"].isin(("ok", "oom")) & grp["err_pct"].notna()]
        err = have["err_pct"].to_numpy(float)
        loso = have["loso_err_pct"].to_numpy(float) if "loso_err_pct" in have else np.array([])
        loso = loso[np.isfinite(loso)]
        mine = pairs[pairs["a"].isin(grp["case"])] if len(pairs) else pairs
        print(
            f"{kind} timing={timing} n={len(have)} cannot_express="
            f"{int((grp['status'] == 'unexpressible').sum())} "
            f"mean_abs_err_pct={mean_or_nan(np.abs(err)):.2f} "
            f"mean_signed_err_pct={mean_or_nan(err):+.2f} "
            f"loso_mean_abs_err_pct={mean_or_nan(np.abs(loso)):.2f} "
            f"pairs_agree={int(mine['agrees'].sum()) if len(mine) else 0}/{len(mine)}"
        )
        if "fit_err_pct" in have:  # --fit: in-sample with the parameters fitted on every source
            fit = np.abs(have["fit_err_pct"].to_numpy(float))
            print(f"{kind} timing={timing} fitted_on_all_sources mean_abs_err_pct={fit.mean():.2f}")


def _print_notes(results: pd.DataFrame, timings) -> None:
    if "measured" in timings:
        res = results[results["timing_run"] == "measured"]
        from stage_dse.config import load_hardware
        from stage_dse.kernels.tables import table_set

        # a source none of whose cases can be expressed has no hardware column
        gpus = res["hardware"].dropna() if "hardware" in res else ()
        for hw in sorted(set(gpus)):
            if table_set(load_hardware(str(hw))) is None:
                print(f"note: timing=measured: no measured kernel tables for {hw}; its cases "
                      "use the roofline")  # fmt: skip


def _progress(timing: str):
    """A line on stderr as each fit of a refit ends: how many of how many, which, wall time."""
    t0 = time.monotonic()

    def report(done: int, total: int, name: str) -> None:
        print(
            f"fit timing={timing}: {done}/{total} fits done ({name}), "
            f"{(time.monotonic() - t0) / 60:.1f} min",
            file=sys.stderr,
            flush=True,
        )

    return report


def _print_fit(fits: dict) -> None:
    for timing, f in fits.items():
        print(f"\nfit timing={timing}: parameter, preset value, fitted on every source, "
              "range over the leave-one-source-out folds")  # fmt: skip
        for p in f.params:
            if p.name not in f.theta:
                continue
            folds = [fold[p.name] for fold in f.folds.values() if p.name in fold]
            print(
                f"  {p.name:28s} {f.start[p.name]:.3f} -> {f.theta[p.name]:.3f}  "
                f"folds {min(folds):.3f}-{max(folds):.3f}  range [{p.lower}, {p.upper}]"
            )


def _record(summaries: dict, fits: dict, recorded: dict) -> None:
    out = {"corpus": corpus_hash(), "timings": {}}
    for timing, (summary, _, _) in summaries.items():
        old = recorded.get("timings", {}).get(timing, {})
        folds = (
            # significant digits, not decimals: engine costs are fractions of a millisecond
            {
                s: {k: float(f"{v:.5g}") for k, v in th.items()}
                for s, th in fits[timing].folds.items()
            }
            if timing in fits
            else old.get("folds", {})
        )
        groups = {}
        for r in summary.to_dict("records"):
            groups[r["group"]] = {
                k: (round(float(r[k]), 2) if isinstance(r[k], float) else int(r[k]))
                for k in (
                    "n",
                    "unexpressible",
                    "mean_abs_pct",
                    "max_abs_pct",
                    "mean_signed_pct",
                    "loso_mean_abs_pct",
                    "pairs",
                    "pairs_agree",
                )
                if k in r and r[k] == r[k]
            }
        # the fit itself and the sources it saw: a source added later is predicted with it
        unseen = (
            {
                "theta": {k: float(f"{v:.5g}") for k, v in fits[timing].theta.items()},
                "fitted_sources": sorted(fits[timing].folds),
            }
            if timing in fits
            else old.get("unseen")
        )
        out["timings"][timing] = {"groups": groups, "folds": folds}
        if unseen:
            out["timings"][timing]["unseen"] = unseen
    head = (
        "# Written by `stage-dse-validate --record` (folds by `--fit --record`): each group's\n"
        "# errors (%) on the packaged corpus, guarded by tests/test_corpus.py (a group's mean\n"
        "# or leave-one-source-out error may not rise more than one point above these), the\n"
        "# parameters fitted without each source (the leave-one-source-out folds), and the last\n"
        "# fit with the sources it saw (unseen: what predicts a source added since).\n"
    )
    recorded_path().write_text(head + yaml.safe_dump(out, sort_keys=False, width=100))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
