"""Inputs beyond physical sense are one clear error at the edge; below the bounds, no integer
arithmetic of the enumeration overflows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.errors import ConfigError
from stage_dse.search import SearchSpace, divisors, enumerate_plans
from stage_dse.spec import ClusterSpec, ParallelPlan, TrainingSpec
from stage_dse.spec._validate import MAX_GPUS, MAX_TOKENS

HUGE_GPUS = st.integers(min_value=MAX_GPUS + 1, max_value=2**256)
HUGE_TOKENS = st.integers(min_value=MAX_TOKENS + 1, max_value=2**256)


@settings(max_examples=40, deadline=None)
@given(n=HUGE_GPUS)
def test_gpu_counts_beyond_physical_sense_are_one_error(n):
    with pytest.raises(ConfigError, match=r"cluster\.num_gpus=\d+ is beyond 10,000,000"):
        ClusterSpec(
            name="c", num_gpus=n, gpus_per_node=8, intra_bandwidth_bytes_per_s=1e11,
            inter_bandwidth_bytes_per_s=1e10,
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"plan\.dp=\d+ is beyond"):
        ParallelPlan(dp=n)


@settings(max_examples=40, deadline=None)
@given(n=HUGE_TOKENS)
def test_lengths_and_batches_beyond_physical_sense_are_one_error(n):
    with pytest.raises(ConfigError, match=r"training\.seq_len=\d+ is beyond 100,000,000"):
        TrainingSpec(seq_len=n, global_batch_size=8)
    with pytest.raises(ConfigError, match=r"training\.global_batch_size=\d+ is beyond"):
        TrainingSpec(seq_len=8, global_batch_size=n)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=MAX_GPUS))
def test_divisors_by_trial_division_up_to_the_square_root(n):
    got = divisors(n)
    assert got == sorted(set(got)) and got[0] == 1 and got[-1] == n
    assert all(n % d == 0 for d in got)
    assert all(n // d in got for d in got)  # closed under the complement


@pytest.mark.parametrize("log2_gpus", [13, 18, 23])  # up to 8,388,608 GPUs
def test_enumeration_at_the_largest_gpu_counts_does_not_overflow(log2_gpus):
    n = 2**log2_gpus
    model = load_model("llama3_405b")
    training = TrainingSpec(seq_len=8192, global_batch_size=2**24)
    cluster = load_cluster("dgx_h100", num_gpus=n)
    space = SearchSpace(tp=(8,), pp="auto", cp=(1, 16), micro_batch_size=(1,), zero_stage=(1,))
    found = enumerate_plans(model, training, load_hardware("h100_sxm"), cluster, space, n)
    assert found.valid > 0
    cols = found.columns.columns
    world = cols["dp"] * cols["tp"] * cols["pp"] * cols["cp"]
    assert (world == n).all() and (cols["dp"] > 0).all()
