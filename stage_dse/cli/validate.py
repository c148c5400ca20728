"""``stage-dse-validate``: predictions against published measurements (the tables of
:mod:`stage_dse.validation.published`)."""

from __future__ import annotations

import argparse

import numpy as np

from stage_dse.cli._common import one_line_errors
from stage_dse.cost.table import TIMINGS
from stage_dse.errors import StageDseError
from stage_dse.validation.published import korthikanti_table4, narayanan_table1

__all__ = ["main"]


@one_line_errors("stage-dse-validate")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stage-dse-validate",
        description="Compare predictions with published measurements (Narayanan et al. SC21 "
        "Table 1; Korthikanti et al. MLSys 2023 Table 4). timing=measured times kernels from "
        "measured tables (extra 'measured') and prints both sources' summary lines.",
    )
    parser.add_argument("--hardware", default="a100_80gb", help="hardware preset")
    parser.add_argument("--cluster", default="dgx_a100", help="cluster preset")
    parser.add_argument(
        "overrides", nargs="*", metavar="timing=roofline|measured", help="the timing source"
    )
    args = parser.parse_args(argv)
    timing = "roofline"
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key != "timing" or value not in TIMINGS:
            raise StageDseError(f"{item!r}: expected timing=roofline or timing=measured")
        timing = value
    summaries = []
    for source in ("roofline", "measured") if timing == "measured" else ("roofline",):
        t4 = korthikanti_table4(args.hardware, args.cluster, timing=source)
        t1 = narayanan_table1(args.hardware, args.cluster, timing=source)
        if source == timing:
            _print_details(t1, t4, source)
        summaries.append((source, t1, t4))
    for source, t1, t4 in summaries:
        tag = "" if timing == "roofline" else f" timing={source}"
        errs = np.abs(t1["err_pct"].to_numpy())
        print(f"table1 mean_abs_err_pct={errs.mean():.2f} max_abs_err_pct={errs.max():.2f}{tag}")
        # Table 4: forward and backward of every experiment, 10 times in all
        t4_errs = np.abs(
            100
            * np.concatenate(
                [
                    t4["predicted_forward_ms"] / t4["forward_ms"] - 1,
                    t4["predicted_backward_ms"] / t4["backward_ms"] - 1,
                ]
            )
        )
        print(
            f"table4 mean_abs_err_pct={t4_errs.mean():.2f} max_abs_err_pct={t4_errs.max():.2f}{tag}"
        )
    return 0


def _print_details(t1, t4, source: str) -> None:
    print(f"Korthikanti et al. Table 4: one 22B layer, TP 8, micro-batch 4 (ms), timing={source}")
    for r in t4.itertuples():
        print(
            f"  {r.experiment:42s} fwd {r.predicted_forward_ms:5.1f} vs {r.forward_ms:5.1f} "
            f"({100 * (r.predicted_forward_ms / r.forward_ms - 1):+5.1f}%)  "
            f"bwd {r.predicted_backward_ms:5.1f} vs {r.backward_ms:5.1f} "
            f"({100 * (r.predicted_backward_ms / r.backward_ms - 1):+5.1f}%)"
        )
    print(f"Narayanan et al. Table 1: achieved TFLOP/s per GPU, timing={source}")
    for r in t1.itertuples():
        share = f"  measured {r.measured_share:.0%}" if source == "measured" else ""
        print(
            f"  {r.model:11s} tp={r.tp:<2d} pp={r.pp:<2d} dp={r.dp:<3d} gpus={r.num_gpus:<5d} "
            f"micro_batch={r.micro_batch:<2d} chunks={r.virtual_stages:<2d} "
            f"predicted {r.predicted_tflops:6.1f} published {r.published_tflops:6.1f} "
            f"err {r.err_pct:+5.1f}%  mfu {r.mfu:.3f}{share}"
        )


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
