"""The summary streamed from a sweep's blocks answers what the stored rows answer."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from test_sweep import small_spec

from stage_dse.results import ResultStore, best_per, load
from stage_dse.results.schema import RESULT_SCHEMA
from stage_dse.runner import LocalExecutor, run_grid, top_table
from stage_dse.runner.aggregate import MISSES, TIE_REL, RunSummary


def _closest_misses(df: pd.DataFrame) -> list[str]:
    miss = df[df["status"] == "infeasible"]
    miss = miss.assign(short=-miss["mem_headroom_bytes"]).sort_values(["short", "step_s"])
    return list(miss["config_hash"].head(MISSES))


def _same_answers(summary: RunSummary, df: pd.DataFrame, k: int) -> None:
    assert summary.rows == len(df)
    assert summary.status == Counter(df["status"].astype(str))
    for by in ("step_s", "gpu_seconds"):
        for top in (1, 3, k):
            got = top_table(summary.candidates(by), top, by=by)
            want = top_table(df, top, by=by)
            pd.testing.assert_frame_equal(got, want)
    best = best_per(df, ["model", "hardware", "num_gpus"])
    got = summary.best_per_group()
    assert list(got["num_gpus"]) == list(best["num_gpus"])
    np.testing.assert_array_equal(got["step_s"].to_numpy(), best["step_s"].to_numpy())
    assert list(summary.closest_misses()["config_hash"]) == _closest_misses(df)


def test_streamed_summary_equals_the_stored_rows(tmp_path):
    """Many small blocks (150 rows), 58 GiB usable so some plans miss: counts, both rankings
    with their ties, the best per GPU count and the closest misses, as the whole table."""
    spec = small_spec(gpus=(8, 16, 32))
    spec = replace(spec, memory_limit_bytes=58 * 2**30)
    store = ResultStore(tmp_path / "s")
    report = run_grid(spec, LocalExecutor(), store, batch_size=150, progress=False, top_k=7)
    df = load(store.root)
    assert (df["status"] == "infeasible").any() and (df["status"] == "ok").any()
    assert report.folder_rows == len(df) == report.summary.rows
    assert report.summary.reused == 0
    _same_answers(report.summary, df, 7)


def test_a_resumed_sweep_summarizes_the_rows_it_reused(tmp_path):
    """A second run over more GPU counts evaluates only the new ones; its summary covers the
    whole sweep, the stored rows read back by a filtered, projected scan."""
    store = ResultStore(tmp_path / "r")
    first = run_grid(small_spec(gpus=(16,)), LocalExecutor(), store, progress=False)
    second = run_grid(small_spec(gpus=(16, 32)), LocalExecutor(), store, progress=False)
    df = load(store.root)
    assert second.evaluated == len(df) - first.evaluated > 0
    assert second.summary.reused == first.evaluated and second.summary.rows == len(df)
    _same_answers(second.summary, df, 10)
    third = run_grid(small_spec(gpus=(32,)), LocalExecutor(), store, progress=False)
    assert third.evaluated == 0 and third.folder_rows == len(df)
    _same_answers(third.summary, df[df["num_gpus"] == 32], 10)


def test_ties_across_partials_rank_as_in_one_table(tmp_path):
    """Rows that tie within TIE_REL arrive in different partials: merged, the table shows the
    same ranks, tie marks and headroom order as the table of all rows."""
    run_grid(small_spec(gpus=(16,)), LocalExecutor(), ResultStore(tmp_path / "t"), progress=False)
    ok = load(tmp_path / "t").query("status == 'ok'").head(40).copy()
    rng = np.random.default_rng(0)
    ok["step_s"] = 1.0 + rng.integers(0, 6, len(ok)) * TIE_REL * 0.6
    ok["mem_headroom_bytes"] = rng.uniform(0, 40, len(ok)) * 2**30
    merged = RunSummary(top_k=5)
    for part in np.array_split(np.arange(len(ok)), 4):
        partial = RunSummary(top_k=5)
        partial.add(pa.Table.from_pandas(ok.iloc[part], schema=RESULT_SCHEMA, preserve_index=False))
        merged.merge(partial)
    got = top_table(merged.candidates(), 5)
    want = top_table(ok, 5)
    assert "tie" in want.columns
    pd.testing.assert_frame_equal(got, want)


@pytest.mark.parametrize("status", ["error", "invalid"])
def test_rows_that_are_not_evaluated_are_counted_with_their_reason(status):
    rows = pd.DataFrame({c: [None, None] for c in RESULT_SCHEMA.names})
    rows["status"], rows["reason"] = status, ["RuntimeError: boom", "RuntimeError: boom"]
    summary = RunSummary()
    summary.add(pa.Table.from_pandas(rows, schema=RESULT_SCHEMA, preserve_index=False))
    assert summary.status == {status: 2}
    assert summary.reasons == {(status, "RuntimeError: boom"): 2}
    assert len(summary.candidates()) == 0 and len(summary.closest_misses()) == 0


def test_stored_hashes_parse_and_match_as_integers():
    """``config_hash`` strings read back as the integers they were written from; membership
    is a binary search over the sorted stored values."""
    from stage_dse.results.schema import hex_hashes
    from stage_dse.results.store import among, hash_values

    rng = np.random.default_rng(1)
    values = rng.integers(0, 2**63, 1000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    text = pa.array(hex_hashes(values).astype(str))
    assert (hash_values(text) == values).all()
    assert (hash_values(pa.chunked_array([text.slice(0, 10), text.slice(10)])) == values).all()
    odd = hash_values(pa.array(["not-a-hash", None, "0123456789ABCDEF", "00000000000000ff"]))
    assert list(odd[:3]) == [2**64 - 1] * 3 and odd[3] == 255
    stored = np.unique(values[::2])
    hit = among(values, stored)
    assert hit[::2].all() and not hit[1::2].any()
    assert not among(values, np.zeros(0, np.uint64)).any()
