"""Numpy programs of the presets' common plan families, shipped with the package.

A process whose disk cache is empty derives each family it meets (0.1-0.5 CPU-s of sympy
each): for the default sweep or a GPT-3 plan table, two dozen to fifty families and 2-4 CPU-s
before the first row. The families those tables meet are shipped here as their numpy programs
(:mod:`stage_dse.cost.vector`), one text file per family named by a digest of the family's
key, its output subset and the cost model's source: a process that meets one evaluates it
without sympy or a derivation. A family of a changed cost model has another digest, so a stale
file is never used; ``python -m stage_dse.cli.shipped`` rewrites them from the preset tables
it names (the test suite checks they are current).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from stage_dse.cost.key import CostKey

__all__ = ["FAMILIES", "shipped_digest", "shipped_files", "shipped_source", "write_shipped"]

FAMILIES = Path(__file__).parent / "families"
_HEADER = "# outputs: "


def shipped_digest(key: CostKey, subset: str) -> str:
    """The name of a family's shipped program: its key, output subset and the cost model."""
    from stage_dse.cost.compile import _source_digest

    text = "|".join([repr(key), subset, _source_digest()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def shipped_source(key: CostKey, subset: str) -> tuple[tuple[str, ...], str] | None:
    """Output names and numpy source of a shipped family, or None (always None with
    ``STAGE_DSE_SHIPPED=0``: every family derived, as for models outside the presets)."""
    if os.environ.get("STAGE_DSE_SHIPPED", "1") == "0":
        return None
    path = FAMILIES / f"{shipped_digest(key, subset)}.txt"
    try:
        text = path.read_text()
    except OSError:
        return None
    header, _, source = text.partition("\n")
    if not header.startswith(_HEADER):
        return None
    return tuple(header[len(_HEADER) :].split()), source


def shipped_files(families: Iterable[tuple[CostKey, str]]) -> set[str]:
    """The file names ``families``' programs are shipped under."""
    return {f"{shipped_digest(key, subset)}.txt" for key, subset in families}


def write_shipped(families: Iterable[tuple[CostKey, str]]) -> tuple[int, int]:
    """Write the numpy programs of ``families`` (deriving those the disk cache lacks) and
    remove every other shipped file: (written, removed)."""
    from stage_dse.cost.compile import _cse_program
    from stage_dse.cost.vector import numpy_source

    FAMILIES.mkdir(parents=True, exist_ok=True)
    keep = set()
    for key, subset in sorted(families, key=repr):
        names, steps, finals, arg_names = _cse_program(key, subset)
        name = f"{shipped_digest(key, subset)}.txt"
        keep.add(name)
        text = _HEADER + " ".join(names) + "\n" + numpy_source(steps, finals, arg_names)
        (FAMILIES / name).write_text(text)
    removed = 0
    for path in FAMILIES.glob("*.txt"):
        if path.name not in keep:
            path.unlink()
            removed += 1
    return len(keep), removed
