"""The on-disk cache shared by the layers that keep derived or compiled artefacts between
processes (compiled cost families and their symbolic programs, measured kernel tables): where
it lives and how an entry is written. Below every layer that uses it; no package imports."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "load_pickle", "store_pickle"]


def cache_dir() -> Path:
    """Where compiled families are cached: ``$STAGE_DSE_CACHE`` or ``~/.cache/stage_dse``."""
    return Path(os.environ.get("STAGE_DSE_CACHE") or Path.home() / ".cache" / "stage_dse")


def store_pickle(path: Path, obj: object) -> None:
    """Pickle ``obj`` to ``path`` atomically (temporary file, rename); a cache that cannot be
    written (read-only folder, unpicklable code) is skipped, never an error."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(obj, fh)
        os.replace(tmp, path)
    except (OSError, TypeError, pickle.PicklingError):
        # a read-only home, or code symengine cannot pickle: evaluates, just uncached
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_pickle(path: Path) -> object | None:
    """The entry at ``path``, or None when there is none; a stale or truncated entry is
    removed and reported as absent, never trusted."""
    if not path.is_file():
        return None
    try:
        return pickle.loads(path.read_bytes())
    except Exception:
        path.unlink(missing_ok=True)
        return None
