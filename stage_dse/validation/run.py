"""One validation run: every selected case of the corpus, predicted and compared.

:func:`validate` evaluates the training cases as one plan table and the serving cases as one
serving table (:mod:`stage_dse.validation.training`, :mod:`stage_dse.validation.serving`) and
returns one row per case. ``timing="measured"`` times training kernels from the measured
tables where a GPU has them (the roofline elsewhere, said in ``notes``); the serving programs
have no measured path yet and are evaluated with the roofline under either timing (their rows
say ``timing=roofline``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from stage_dse.validation.corpus import Case, corpus_root, load_corpus
from stage_dse.validation.report import group_summary, ranking_pairs
from stage_dse.validation.serving import evaluate_serving
from stage_dse.validation.training import build_table, evaluate_training

__all__ = ["Validation", "corpus_hash", "select", "validate"]


def select(
    cases: list[Case],
    kind: str | None = None,
    sources: tuple[str, ...] = (),
    groups: tuple[str, ...] = (),
) -> list[Case]:
    """The cases of one kind, of the named sources and of the named groups (each filter an
    exact name; empty: all)."""
    out = [c for c in cases if kind in (None, c.kind)]
    if sources:
        out = [c for c in out if c.source.id in sources]
    if groups:
        out = [c for c in out if c.group in groups]
    return out


@dataclass
class Validation:
    results: pd.DataFrame
    """One row per case (and timing)."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> pd.DataFrame:
        parts = []
        for timing, res in self.results.groupby("timing_run", sort=False):
            s = group_summary(res, ranking_pairs(res))
            s.insert(0, "timing", timing)
            parts.append(s)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def validate(cases: list[Case], timings: tuple[str, ...] = ("roofline",)) -> Validation:
    """Predict every case under each timing source."""
    training = [c for c in cases if c.kind == "training"]
    serving = [c for c in cases if c.kind == "serving"]
    parts, notes = [], []
    table, info = build_table(training) if training else (None, None)
    serving_res = evaluate_serving(serving) if serving else None
    for timing in timings:
        if training:
            res = evaluate_training(training, timing, table, info)
            parts.append(res.assign(timing_run=timing))
        if serving_res is not None:
            parts.append(serving_res.assign(timing_run=timing))
        if timing == "measured":
            if serving:
                notes.append("timing=measured: serving programs have no measured path yet; "
                             "serving cases use the roofline")  # fmt: skip
            if training:
                notes += _missing_tables(table)
    results = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return Validation(results, notes)


def _missing_tables(table: pd.DataFrame | None) -> list[str]:
    from stage_dse.kernels.tables import table_set

    if table is None or not len(table):
        return []
    out = []
    for hw in sorted(table["hardware"].unique()):
        if table_set(str(hw), "") is None:
            out.append(f"timing=measured: no measured kernel tables for {hw}; its cases use "
                       "the roofline")  # fmt: skip
    return out


def corpus_hash(extra: Path | None = None) -> str:
    """A digest of the packaged corpus files (and ``extra``'s): recorded figures are valid for
    the corpus they were computed on."""
    h = hashlib.sha256()
    paths = sorted(corpus_root().rglob("*.yaml"))
    if extra is not None:
        paths += sorted(Path(extra).rglob("*.yaml")) if Path(extra).is_dir() else [Path(extra)]
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def load(kind: str | None = None, extra=None) -> list[Case]:
    return load_corpus(kind, extra)
