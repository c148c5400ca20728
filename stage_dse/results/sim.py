"""Simulated step times beside the analytic ones: the ``_sim`` dataset of a results folder.

What lives here: :data:`SIM_SCHEMA` (one row per result row and simulator backend),
:class:`SimStore` (atomic Parquet part files under ``<results>/_sim/``, one writer at a time,
keyed by ``config_hash`` + ``sim_backend``) and :func:`load_sim` (the simulated rows joined to
their result rows). Running the simulators is :mod:`stage_dse.trace.simulate`.

The leading underscore keeps the dataset out of ``pandas.read_parquet(results)``; per-run files
(simulator inputs, logs) live under ``_sim/_runs/``, which readers of ``_sim`` skip likewise.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stage_dse.errors import StageDseError

__all__ = ["SIM_DIR", "SIM_SCHEMA", "SIM_STATUS", "SimStore", "load_sim"]

SIM_DIR = "_sim"
RUNS_DIR = "_runs"
SIM_STATUS = ("ok", "failed")
SIM_SCHEMA = pa.schema(
    [
        pa.field("config_hash", pa.string()),
        pa.field("sim_backend", pa.string()),
        pa.field("sim_status", pa.string()),
        pa.field("sim_reason", pa.string()),
        pa.field("sim_step_s", pa.float64()),
        pa.field("sim_ratio", pa.float64()),
        pa.field("sim_finished_ranks", pa.int64()),
        pa.field("sim_ranks", pa.int64()),
        pa.field("sim_compute", pa.string()),
        pa.field("sim_log_path", pa.string()),
        pa.field("sim_wall_s", pa.float64()),
        pa.field("sim_cpu_s", pa.float64()),
        pa.field("sim_run_id", pa.string()),
    ]
)
"""``sim_step_s``: the last rank's finish time; ``sim_ratio``: ``sim_step_s / step_s`` of the
row; ``sim_finished_ranks`` of ``sim_ranks``; ``sim_status`` ``ok`` or ``failed`` with
``sim_reason`` (on an ok row: what the backend models differently for this set);
``sim_compute``: ``replay`` (COMP nodes take the trace's durations) or ``roofline``;
``sim_log_path`` relative to the results folder; ``sim_cpu_s``: CPU seconds of the run."""
KEY = ("config_hash", "sim_backend")


class SimStore:
    """The ``_sim`` dataset of one results folder."""

    def __init__(self, results: str | os.PathLike) -> None:
        self.results = Path(results)
        self.root = self.results / SIM_DIR
        self._lock_fd: int | None = None

    def acquire(self) -> None:
        """Become the dataset's only writer (an OS lock, released when the process ends);
        a second writer is refused at once rather than left waiting on a long farm run."""
        if self._lock_fd is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StageDseError(
                f"{self.root} is being written by another stage-dse-trace simulate; wait for it "
                "to finish (rows it simulates are skipped when you rerun)"
            ) from None
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def parts(self) -> list[Path]:
        return sorted(self.root.glob("part-*.parquet")) if self.root.is_dir() else []

    def read(self) -> pd.DataFrame:
        parts = self.parts()
        if not parts:
            return SIM_SCHEMA.empty_table().to_pandas()
        return pa.concat_tables(pq.read_table(p, schema=SIM_SCHEMA) for p in parts).to_pandas()

    def keys(self, status: str | None = None) -> set[tuple[str, str]]:
        """(config_hash, backend) of the stored rows (of one ``sim_status`` if given)."""
        df = self.read()
        if status is not None:
            df = df[df["sim_status"] == status]
        return set(zip(df["config_hash"], df["sim_backend"]))

    def write(self, rows: list[dict]) -> None:
        """Store ``rows``: a row whose key is stored already replaces it in its part (each
        touched part rewritten atomically under its name), the others go to one new part, so
        no key is ever stored twice."""
        if not rows:
            return
        by_key = {(r["config_hash"], r["sim_backend"]): r for r in rows}
        for part in self.parts():
            table = pq.read_table(part, schema=SIM_SCHEMA)
            keys = list(zip(*(table.column(k).to_pylist() for k in KEY)))
            hit = [k in by_key for k in keys]
            if not any(hit):
                continue
            kept = table.filter(pa.array([not h for h in hit]))
            new = _table([by_key.pop(k) for k, h in zip(keys, hit) if h])
            self._commit(pa.concat_tables([kept, new]), part)
        if by_key:
            self._commit(
                _table(list(by_key.values())), self.root / f"part-{uuid.uuid4().hex}.parquet"
            )

    def _commit(self, table: pa.Table, final: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{final.name}"
        pq.write_table(table, tmp, compression="lz4")
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)


def _table(rows: list[dict]) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows] for f in SIM_SCHEMA}
    return pa.table(cols, schema=SIM_SCHEMA)


def load_sim(results: str | os.PathLike, backend: str | None = None) -> pd.DataFrame:
    """The simulated rows of a results folder joined to their result rows (every result
    column beside the ``sim_*`` columns; one row per result row and backend), optionally of
    one ``backend``."""
    from stage_dse.results.store import ResultStore

    sim = SimStore(results).read()
    if backend is not None:
        sim = sim[sim["sim_backend"] == backend]
    rows = ResultStore(results).read()
    rows = rows.assign(config_hash=rows["config_hash"].astype(str))
    return rows.merge(sim, on="config_hash", how="inner").reset_index(drop=True)
