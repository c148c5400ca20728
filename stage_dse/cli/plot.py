"""``stage-dse-plot``: PNG figures of a results folder (see :mod:`stage_dse.results.plots`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from stage_dse.cli._common import fail, one_line_errors

__all__ = ["main"]


@one_line_errors("stage-dse-plot")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stage-dse-plot", description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a sweep's results folder, e.g. results/default")
    parser.add_argument("--out", default=None, help="output folder (default: RESULTS/_plots)")
    parser.add_argument("--top", type=int, default=10, help="plans in the memory breakdown")
    args = parser.parse_args(argv)
    if not Path(args.results).is_dir():
        return fail("stage-dse-plot", f"no results folder {args.results}")
    from stage_dse.results.plots import plot_results

    files = plot_results(args.results, args.out or Path(args.results) / "_plots", args.top)
    if not files:
        return fail("stage-dse-plot", "no feasible rows to plot", code=1)
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
