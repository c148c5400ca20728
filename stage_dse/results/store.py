"""The results dataset on disk: atomic Parquet part files under ``results/<sweep>/``.

Only the sweep driver writes, and one driver per folder at a time (an OS file lock, see
:meth:`ResultStore.acquire`); workers may encode a part (:func:`encode_part`) and send its
bytes. A part file is written to a temporary name in the same folder
and renamed into place, so a killed process leaves either a whole part or none (the temporary
is ignored by readers and removed on the next start). Rows are identified by ``config_hash``;
a rerun reads the hashes already present and evaluates only the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from stage_dse.cost.compile import model_digest
from stage_dse.errors import StageDseError
from stage_dse.results.schema import (
    HASH_SCHEME,
    HASH_SCHEME_KEY,
    MODEL_DIGEST_KEY,
    RESULT_SCHEMA,
    empty_results,
)

__all__ = ["ResultStore", "among", "as_arrow", "encode_part", "hash_values", "new_run_id"]

PART_GLOB = "part-*.parquet"
LOCK_NAME = ".writer.lock"
QUARANTINE_DIR = "_quarantine"


def _reason(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _read(parts: list[Path], columns: list[str] | None = None, filters=None) -> pa.Table:
    dataset = ds.dataset([str(p) for p in parts], format="parquet", schema=RESULT_SCHEMA)
    return dataset.to_table(columns=columns, filter=filters)


_NIBBLE = np.full(256, 255, dtype=np.uint8)
_NIBBLE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def hash_values(hashes: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """``config_hash`` strings (16 lower-case hex digits) as uint64, vectorized; a string of
    another form maps to no stored hash (``2**64 - 1``)."""
    arr = hashes.combine_chunks() if isinstance(hashes, pa.ChunkedArray) else hashes
    arr = arr.cast(pa.string())
    n = len(arr)
    out = np.full(n, np.iinfo(np.uint64).max, dtype=np.uint64)
    if n == 0:
        return out
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + n + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8)
    regular = (np.diff(offsets) == 16) & ~np.asarray(arr.is_null(), dtype=bool)
    if not regular.any():
        return out
    starts = offsets[:-1][regular]
    digits = _NIBBLE[data[starts[:, None] + np.arange(16)]]
    ok = (digits != 255).all(axis=1)
    shifts = np.arange(60, -4, -4, dtype=np.uint64)
    values = (digits.astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)
    out[np.flatnonzero(regular)[ok]] = values[ok]
    return out


def among(values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``wanted`` (both uint64; ``wanted`` sorted and unique): a
    binary search, where ``numpy.isin`` hashes its million-element second argument anew on
    every call."""
    if len(wanted) == 0:
        return np.zeros(len(values), dtype=bool)
    pos = np.minimum(np.searchsorted(wanted, values), len(wanted) - 1)
    return wanted[pos] == values


def _among(hashes: pa.ChunkedArray, wanted: np.ndarray) -> pa.Array:
    return pa.array(among(hash_values(hashes), wanted))


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def new_run_id() -> str:
    """A run's id: its UTC start time, process id and a random tag, e.g.
    ``20261201T040512Z-4242-9f3c`` (sorts by start time)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{stamp}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def encode_part(rows: pd.DataFrame | pa.Table, schema: pa.Schema = RESULT_SCHEMA) -> bytes:
    """Result rows as the bytes of one Parquet part file (no I/O): cheap to send from a worker,
    and the driver only has to write them."""
    if isinstance(rows, pa.Table):
        table = rows.cast(schema)
    else:
        table = pa.Table.from_pandas(rows, schema=schema, preserve_index=False)
    text = [f.name for f in RESULT_SCHEMA if f.type == pa.string()]
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="lz4", use_dictionary=text, write_statistics=False)
    return sink.getvalue().to_pybytes()


def as_arrow(rows: pd.DataFrame) -> pa.Table:
    """Result rows built as a DataFrame (error and invalid rows) as an Arrow table."""
    return pa.Table.from_pandas(rows, schema=RESULT_SCHEMA, preserve_index=False)


class ResultStore:
    """One sweep's dataset folder.

    A resumed sweep skips the configurations already stored, so every part must come from the
    same hash scheme and cost model as this code (recorded in each part's metadata). Parts that
    do not are refused, or, with ``replace_stale``, deleted when the sweep starts so that their
    configurations are evaluated again (never kept beside their new rows).
    """

    def __init__(self, root: str | os.PathLike, replace_stale: bool = False) -> None:
        self.root = Path(root)
        self.replace_stale = replace_stale
        self._lock_fd: int | None = None

    # ----------------------------------------------------------------- one writer at a time
    def acquire(self, log: Callable[[str], None] = print) -> None:
        """Become the folder's only writer: an OS lock on ``<root>/.writer.lock``, released by
        :meth:`release` or when the process ends however it ends (kill -9 included, so a lock
        is never stale). A second writer waits, after saying who holds the folder; it reads
        which configurations are stored only once it holds the lock, so two sweeps on one
        folder never store a configuration twice."""
        if self._lock_fd is not None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StageDseError(
                f"results folder {self.root} is not writable ({exc.strerror}); choose another "
                "results_dir or fix its permissions"
            ) from None
        if not _try_lock(fd):
            holder: str | None = ""
            for _ in range(40):  # the holder writes who it is just after taking the lock
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
                if holder:
                    break
                if _try_lock(fd):
                    holder = None  # it finished meanwhile
                    break
                time.sleep(0.025)
            if holder is not None:
                log(f"{self.root} is being written by {holder or 'another process'}; waiting")
                fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        """Stop being the writer (the lock file stays; its lock is what counts)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def prepare(self, log: Callable[[str], None] = print) -> int:
        """Become the writer (:meth:`acquire`), remove leftover temporaries, move corrupt parts
        aside (their configurations are evaluated again) and, with ``replace_stale``, delete the
        parts of another hash scheme or cost model; returns how many parts were removed."""
        self.acquire(log)
        for tmp in self.root.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        self.quarantine_corrupt(log)
        if not self.replace_stale:
            return 0
        stale = [part for part, why in self._provenance() if why]
        for part in stale:
            part.unlink()
        return len(stale)

    def quarantine_corrupt(self, log: Callable[[str], None] = print) -> list[Path]:
        """Parts whose Parquet footer cannot be read (a truncated or zero-byte file, e.g. from a
        disk that filled up) moved to ``<root>/_quarantine/``, one warning each. (Corrupt data
        pages behind a sound footer are found when a read fails: :meth:`unreadable_parts`.)"""
        bad = {}
        for part in self.parts():
            try:
                pq.read_metadata(part)
            except (OSError, pa.ArrowException) as exc:
                bad[part] = _reason(exc)
        return self._quarantine(bad, log)

    def unreadable_parts(self, columns: list[str] | None = None) -> dict[Path, str]:
        """Each part that cannot be read whole (footer, or any data page of ``columns``; all
        columns by default), with why. Decodes every page: called only once a read failed."""
        bad = {}
        for part in self.parts():
            try:
                pq.read_table(part, columns=columns, schema=RESULT_SCHEMA)
            except (OSError, pa.ArrowException) as exc:
                bad[part] = _reason(exc)
        return bad

    def _quarantine(self, bad: dict[Path, str], log: Callable[[str], None]) -> list[Path]:
        moved = []
        for part, reason in bad.items():
            dest = self.root / QUARANTINE_DIR / part.name
            dest.parent.mkdir(exist_ok=True)
            os.replace(part, dest)
            moved.append(dest)
            log(
                f"warning: {part} is not a readable Parquet file ({reason}); moved to "
                f"{dest}, its configurations will be evaluated again"
            )
        return moved

    def _set_aside(self, columns: list[str] | None, log: Callable[[str], None]) -> set[Path]:
        """After a failed read: quarantine the unreadable parts when no sweep is writing the
        folder (taking its lock for the move), else leave them and name them; returns them."""
        bad = self.unreadable_parts(columns)
        if not bad:
            return set()
        own = self._lock_fd is not None
        fd = None
        if not own:
            try:
                fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                fd = None
            if fd is not None and not _try_lock(fd):
                os.close(fd)
                fd = None
        if own or fd is not None:
            try:
                self._quarantine(bad, log)
            finally:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
        else:
            for part, reason in bad.items():
                log(f"warning: skipped {part}, not a readable Parquet file ({reason})")
        return set(bad)

    def _provenance(self) -> list[tuple[Path, str]]:
        """Each part with why it cannot be resumed from ("" when it can)."""
        out = []
        for part in self.parts():
            meta = pq.read_schema(part).metadata or {}
            scheme = meta.get(HASH_SCHEME_KEY, b"1").decode()
            model = meta.get(MODEL_DIGEST_KEY, b"unknown").decode()
            why = ""
            if scheme != HASH_SCHEME:
                why = f"hash scheme {scheme}, this one uses {HASH_SCHEME}"
            elif model != model_digest():
                why = f"cost model {model}, this one is {model_digest()}"
            out.append((part, why))
        return out

    def check_workload(self, workload: str, log: Callable[[str], None] = print) -> None:
        """Refuse to add ``workload`` rows (training or serving) to a folder holding the other
        kind: their columns and summaries differ."""
        parts = self.parts()
        if not parts:
            return
        try:
            table = _read(parts, ["workload"])
        except (OSError, pa.ArrowException):
            skipped = self._set_aside(["workload"], log)
            table = _read([p for p in self.parts() if p not in skipped], ["workload"])
        kinds = pa.compute.unique(table.column("workload").cast(pa.string()))
        other = set(kinds.to_pylist()) - {workload, None}
        if other:
            raise StageDseError(
                f"{self.root} holds {', '.join(sorted(other))} results; {workload} results go "
                "to their own folder: choose another sweep_name"
            )

    def parts(self) -> list[Path]:
        return sorted(self.root.glob(PART_GLOB)) if self.root.is_dir() else []

    def write(self, rows: pd.DataFrame | pa.Table) -> Path | None:
        """Write one part file atomically; returns its path (None for no rows)."""
        if len(rows) == 0:
            return None
        return self.write_encoded(encode_part(rows))

    def write_encoded(self, data: bytes) -> Path:
        """Write one part already encoded by :func:`encode_part` (e.g. on a worker)."""
        final = self.root / f"part-{uuid.uuid4().hex}.parquet"
        self._commit(data, final)
        return final

    def set_column(self, column: str, values: dict[str, object]) -> int:
        """Set ``column`` for the rows whose ``config_hash`` is a key of ``values``; each part
        holding such rows is rewritten atomically under its own name (no row lost or
        duplicated whatever happens). Returns the number of rows changed."""
        if not values:
            return 0
        own = self._lock_fd is None
        self.acquire()
        try:
            return self._set_column(column, values)
        finally:
            if own:
                self.release()

    def _set_column(self, column: str, values: dict[str, object]) -> int:
        changed = 0
        keys = pa.array(list(values), type=pa.string())
        for part in self.parts():
            stored = pq.read_schema(part).metadata or {}
            own = {k: v for k, v in stored.items() if k in (HASH_SCHEME_KEY, MODEL_DIGEST_KEY)}
            schema = RESULT_SCHEMA.with_metadata(own)  # the part keeps its provenance
            table = pq.read_table(part, schema=RESULT_SCHEMA)
            hashes = table.column("config_hash")
            hit = pa.compute.is_in(hashes, value_set=keys)
            if not pa.compute.any(hit).as_py():
                continue
            old = table.column(column).to_pylist()
            new = [values.get(h, o) for h, o in zip(hashes.to_pylist(), old)]
            changed += sum(1 for a, b in zip(old, new) if a != b)
            table = table.set_column(
                table.schema.get_field_index(column),
                column,
                pa.array(new, type=RESULT_SCHEMA.field(column).type),
            )
            self._commit(encode_part(table, schema), part)
        return changed

    def _commit(self, data: bytes, final: Path) -> None:
        """Temporary file, fsync, rename: a reader sees the whole part or none of it. A write
        that fails (disk full, folder gone or read-only) removes its temporary and ends in one
        line: the parts already written stay, and a rerun resumes from them."""
        tmp = self.root / f".tmp-{final.name}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StageDseError(
                f"cannot write a part to {self.root} ({exc.strerror or exc}); the "
                f"{len(self.parts()):,} parts written before are kept: free space or fix the "
                "folder, then rerun to resume"
            ) from None

    def hashes(self, log: Callable[[str], None] = print) -> set[str]:
        """The config hashes already stored (what a resumed sweep skips); a part whose hash
        pages cannot be read is quarantined (``log`` says so) and its configurations count as
        not stored."""
        return set(self._hash_column(log).to_pylist())

    def hash_values(self, log: Callable[[str], None] = print) -> np.ndarray:
        """:meth:`hashes` as a sorted array of unique uint64 (a million in some 0.1 s)."""
        return np.unique(hash_values(self._hash_column(log)))

    def _hash_column(self, log: Callable[[str], None]) -> pa.ChunkedArray:
        parts = self.parts()
        if not parts:
            return pa.chunked_array([], type=pa.string())
        for part, why in self._provenance():
            if why:
                raise StageDseError(
                    f"{self.root} holds rows from another stage_dse ({part.name}: {why}): "
                    "resuming would keep them beside new results; rerun with "
                    "replace_stale=true to evaluate them again, or choose another sweep_name"
                )
        try:
            table = _read(parts, ["config_hash"])
        except (OSError, pa.ArrowException):  # a corrupt page: set it aside, then resume
            skipped = self._set_aside(["config_hash"], log)
            table = _read([p for p in self.parts() if p not in skipped], ["config_hash"])
        return table.column("config_hash")

    def row_count(self) -> int:
        """Rows in the folder, from the part footers (no data page is read)."""
        total = 0
        for part in self.parts():
            try:
                total += pq.read_metadata(part).num_rows
            except (OSError, pa.ArrowException):  # counted as not stored, as hashes() does
                continue
        return total

    def scan(
        self,
        columns: list[str],
        filters=None,
        hashes: np.ndarray | None = None,
        batch_rows: int = 65_536,
    ) -> Iterator[pa.RecordBatch]:
        """The rows matching ``filters`` (a ``pyarrow.dataset`` expression) and, if given,
        whose ``config_hash`` is among ``hashes`` (sorted uint64, see
        :func:`~stage_dse.runner.evaluate.done_hashes`), ``columns`` only, as record batches
        of at most ``batch_rows``: what a summary of stored rows needs, in bounded memory (one
        part's matching rows at a time). Hashes are matched by a binary search on their
        integer values (a set of a million strings in an ``isin`` filter would be rebuilt for
        every batch). A part that cannot be read is quarantined when this process writes the
        folder, else skipped with a warning."""
        read = list(dict.fromkeys([*columns, *(["config_hash"] if hashes is not None else [])]))
        bad: dict[Path, str] = {}
        for part in self.parts():
            try:  # one part at a time: a part is read whole or not at all
                dataset = ds.dataset(str(part), format="parquet", schema=RESULT_SCHEMA)
                table = dataset.to_table(columns=read, filter=filters)
            except (OSError, pa.ArrowException) as exc:
                bad[part] = _reason(exc)
                continue
            if hashes is not None and table.num_rows:
                table = table.filter(_among(table.column("config_hash"), hashes))
            yield from table.select(columns).to_batches(max_chunksize=batch_rows)
        if bad:
            if self._lock_fd is not None:
                self._quarantine(bad, lambda line: print(line, file=sys.stderr))
            else:
                for part, reason in bad.items():
                    print(f"warning: skipped {part}, not readable ({reason})", file=sys.stderr)

    def read(self, columns: list[str] | None = None, filters=None) -> pd.DataFrame:
        """The rows as a DataFrame. A part that cannot be read (zero bytes, truncated, corrupt
        pages) never fails the read: it is quarantined, or skipped with a warning on stderr
        while a sweep writes the folder."""
        parts = self.parts()
        if not parts:
            return empty_results()
        try:
            table = _read(parts, columns, filters)
        except (OSError, pa.ArrowException):
            skipped = self._set_aside(columns, lambda line: print(line, file=sys.stderr))
            parts = [p for p in self.parts() if p not in skipped]
            if not parts:
                return empty_results()
            table = _read(parts, columns, filters)
        # dictionary-encoded text loads as plain strings: stable dtypes whatever the part order
        for i, f in enumerate(table.schema):
            if pa.types.is_dictionary(f.type):
                table = table.set_column(i, f.name, table.column(i).cast(pa.string()))
        return table.to_pandas()
