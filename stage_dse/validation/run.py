"""Selecting the cases of a validation run, and the digest that ties recorded figures to the
corpus they were computed on."""

from __future__ import annotations

import hashlib
from pathlib import Path

from stage_dse.validation.corpus import Case, corpus_root

__all__ = ["corpus_hash", "select"]


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
