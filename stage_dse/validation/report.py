"""Summaries of a validation run: per group, per kind, and the published rankings.

A **group** is a source and a target kind (``narayanan2021_t1/tflops_per_gpu``). Per group:
the cases with a prediction (``n``), those the model cannot express, mean and largest absolute
error, mean signed error. A **ranking pair** is two published figures of one source on one
model, GPU type, GPU count and workload (sequence and batch, or prompt and output lengths)
under two different plans whose published rates differ by more than :data:`TIE_PCT`, measured
with one software release (a source that tables several releases ranks plans within each):
the model agrees when it orders the two the same way.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["TIE_PCT", "group_summary", "ranking_pairs", "rate"]

TIE_PCT = 2.0
"""Published figures closer than this (percent) are a tie, not a ranking claim."""

TIME_KINDS = ("iter_s", "layer_fwd_ms", "layer_bwd_ms", "ttft_ms", "tpot_ms", "itl_ms",
              "e2e_latency_s")  # fmt: skip


def rate(kind: pd.Series, value: pd.Series) -> np.ndarray:
    """Work per time of a figure: the figure for throughputs, its inverse for times."""
    v = value.to_numpy(dtype=float)
    return np.where(kind.isin(TIME_KINDS).to_numpy(), 1.0 / v, v)


def ranking_pairs(results: pd.DataFrame) -> pd.DataFrame:
    """Every published pair (see the module docstring) and whether the prediction agrees."""
    ok = results[results["status"].isin(("ok", "oom"))].copy()
    if ok.empty:
        return pd.DataFrame(columns=["a", "b", "group", "published_ratio", "predicted_ratio",
                                     "agrees"])  # fmt: skip
    ok["pub_rate"] = rate(ok["kind"], ok["published"])
    ok["pred_rate"] = rate(ok["kind"], ok["predicted"])
    keys = ["source", "framework_version", "kind", "model", "hardware", "num_gpus", "workload"]
    out = []
    for _, grp in ok.groupby(keys, sort=False):
        rows = grp.to_dict("records")
        for i, a in enumerate(rows):
            for b in rows[i + 1 :]:
                if a["plan"] == b["plan"]:
                    continue
                pub = a["pub_rate"] / b["pub_rate"]
                if abs(pub - 1) * 100 <= TIE_PCT:
                    continue
                pred = a["pred_rate"] / b["pred_rate"]
                out.append(
                    {
                        "a": a["case"],
                        "b": b["case"],
                        "group": a["group"],
                        "published_ratio": pub,
                        "predicted_ratio": pred,
                        "agrees": bool((pub > 1) == (pred > 1)),
                    }
                )
    return pd.DataFrame(out)


def mean_or_nan(values: np.ndarray) -> float:
    """The mean, NaN for no values (a group or kind none of whose cases has a prediction)."""
    return float(np.mean(values)) if len(values) else float("nan")


def group_summary(results: pd.DataFrame, pairs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per group: n, unexpressible, mean/max absolute and mean signed error (%), pairs agreeing;
    plus ``loso_mean_abs_pct`` when ``results`` has a ``loso_err_pct`` column."""
    pairs = ranking_pairs(results) if pairs is None else pairs
    rows = []
    for group, grp in results.groupby("group", sort=True):
        # a case judged out of memory counts when the model still predicts it (training's
        # fastest plan); a serving case where no request fits has no figure to compare
        have = grp[grp["status"].isin(("ok", "oom")) & grp["err_pct"].notna()]
        err = have["err_pct"].to_numpy(dtype=float)
        row = {
            "group": group,
            "n": len(have),
            "unexpressible": int((grp["status"] == "unexpressible").sum()),
            "oom": int((grp["status"] == "oom").sum()),
            "mean_abs_pct": mean_or_nan(np.abs(err)),
            "max_abs_pct": float(np.max(np.abs(err))) if len(err) else np.nan,
            "mean_signed_pct": mean_or_nan(err),
        }
        if "loso_err_pct" in have:
            loso = have["loso_err_pct"].to_numpy(dtype=float)
            row["loso_mean_abs_pct"] = mean_or_nan(np.abs(loso))
        mine = pairs[pairs["group"] == group] if len(pairs) else pairs
        row["pairs"] = len(mine)
        row["pairs_agree"] = int(mine["agrees"].sum()) if len(mine) else 0
        rows.append(row)
    return pd.DataFrame(rows)
