"""Plan enumeration and the columnar sweep path against their one-plan-at-a-time definitions."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost import compile as compile_module
from stage_dse.errors import ConfigError
from stage_dse.results.schema import RESULT_SCHEMA, config_hash
from stage_dse.runner.evaluate import (
    Block,
    block_configs,
    done_hashes,
    evaluate_batch,
    evaluate_block,
)
from stage_dse.search import SearchSpace, divisors, enumerate_plans
from stage_dse.spec import ParallelPlan, TrainingSpec, validate_plan

TRAINING = TrainingSpec(seq_len=4096, global_batch_size=64)
PLAN_COLUMNS = (
    "tp", "pp", "cp", "ep", "dp", "micro_batch", "virtual_stages", "zero_stage", "recompute",
    "sequence_parallel", "attention", "expert_tensor_parallel", "ep_over_tp", "rank_order",
    "dp_replicate",
)  # fmt: skip


def brute_force(model, training, n, space) -> tuple[set, int]:
    """Valid plans by building and validating every candidate one at a time."""
    deg = {k: space.degrees(k, n) for k in ("tp", "pp", "cp")}
    eps = divisors(model.num_experts) if space.ep == "auto" else sorted(set(space.ep))
    if not model.is_moe:
        eps = [e for e in eps if e == 1] or eps
    valid, total = set(), 0
    for tp, pp, cp, ep, etp, fold, z, g, rc, sp_, att, order, v, mb in itertools.product(
        deg["tp"], deg["pp"], deg["cp"], eps, set(space.expert_tensor_parallel),
        set(space.ep_over_tp),
        set(space.zero_stage), set(space.shard_group), set(space.recompute),
        set(space.sequence_parallel),
        set(space.attention), set(space.rank_order), set(space.virtual_stages),
        set(space.micro_batch_size),
    ):  # fmt: skip
        total += 1
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        if g and (dp % g or g >= dp):  # a sharding group size that is not a proper part of dp
            continue
        try:
            plan = ParallelPlan(
                dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, expert_tensor_parallel=etp, ep_over_tp=fold,
                sequence_parallel=sp_, zero_stage=z, micro_batch_size=mb, recompute=rc,
                attention=att, schedule="interleaved" if v > 1 else "1f1b",
                virtual_stages=v, rank_order=order, dp_replicate=dp // g if g else 1,
            )  # fmt: skip
            validate_plan(model, training, plan, num_gpus=n)
        except ConfigError:
            continue
        valid.add((tp, pp, cp, ep, dp, mb, v, z, rc, sp_, att, etp, fold, order, plan.dp_replicate))
    return valid, total


def as_tuples(table: pd.DataFrame) -> set:
    cols = [table[c].astype(object).to_numpy() for c in PLAN_COLUMNS]
    return {tuple(x.item() if isinstance(x, np.generic) else x for x in row) for row in zip(*cols)}


spaces = st.builds(
    SearchSpace,
    tp=st.sampled_from(["auto", (1, 2, 3, 4, 8)]),
    pp=st.sampled_from(["auto", (1, 2, 4)]),
    cp=st.sampled_from([(1,), (1, 2, 3)]),
    ep=st.sampled_from([(1,), "auto", (2, 3), (4, 8, 16)]),
    expert_tensor_parallel=st.sampled_from([(False,), (False, True)]),
    ep_over_tp=st.sampled_from([(False,), (False, True)]),
    micro_batch_size=st.sampled_from([(1,), (1, 2, 3), (4, 8)]),
    zero_stage=st.sampled_from([(0,), (1, 3)]),
    shard_group=st.sampled_from([(0,), (0, 2, 8)]),
    recompute=st.sampled_from([("none",), ("full", "selective")]),
    sequence_parallel=st.sampled_from([(False,), (False, True)]),
    virtual_stages=st.sampled_from([(1,), (1, 2, 3)]),
    rank_order=st.sampled_from([("tp-cp-ep-dp-pp",), ("tp-cp-ep-dp-pp", "tp-dp-cp-ep-pp")]),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(["llama3_8b", "gpt_1p7b", "mixtral_8x7b"]),
    n=st.sampled_from([8, 16, 24, 48, 64]),
    space=spaces,
)
def test_enumeration_equals_validating_every_candidate(model, n, space):
    """The broadcast masks keep exactly the plans ``validate_plan`` accepts, and every other
    candidate is counted under some rule."""
    m = load_model(model)
    cluster = load_cluster("dgx_h100").replace(num_gpus=n)
    e = enumerate_plans(m, TRAINING, load_hardware("h100_sxm"), cluster, space)
    expected, total = brute_force(m, TRAINING, n, space)
    assert e.candidates == total
    assert e.valid == len(e.table) == len(expected)
    assert sum(e.rejected.values()) == total - len(expected)
    assert as_tuples(e.table) == expected
    counted = enumerate_plans(
        m, TRAINING, load_hardware("h100_sxm"), cluster, space, count_only=True
    )
    assert (counted.valid, counted.rejected) == (e.valid, e.rejected)


def test_rows_slice_is_a_slice_of_the_whole_enumeration():
    m, hw = load_model("llama3_8b"), load_hardware("h100_sxm")
    cluster = load_cluster("dgx_h100").replace(num_gpus=64)
    whole = enumerate_plans(m, TRAINING, hw, cluster, SearchSpace()).table
    part = enumerate_plans(m, TRAINING, hw, cluster, SearchSpace(), rows=slice(100, 250)).table
    pd.testing.assert_frame_equal(part, whole.iloc[100:250].reset_index(drop=True))


def blocks():
    hw = load_hardware("h100_sxm")
    for model, n, space, limit in [
        ("llama3_8b", 64, SearchSpace(virtual_stages=(1, 2)), None),
        ("mixtral_8x7b", 32, SearchSpace(ep="auto", expert_tensor_parallel=(False, True)), 40e9),
    ]:
        m = load_model(model)
        cluster = load_cluster("dgx_h100").replace(num_gpus=n)
        valid = enumerate_plans(m, TRAINING, hw, cluster, space, count_only=True).valid
        yield Block(
            model=m, training=TRAINING, hardware=hw, cluster=cluster, space=space,
            memory_limit_bytes=limit, start=valid // 4, stop=valid,
        )  # fmt: skip


@pytest.mark.parametrize("block", list(blocks()), ids=["dense", "moe-budget"])
def test_columnar_block_equals_the_dataframe_path(block, monkeypatch):
    """What sweep workers send (Arrow built from columns) is row for row what the DataFrame
    path (plan table -> evaluate_table -> result rows) gives, and ``done`` rows are skipped.
    Both paths run compiled code: a family's first rows in a process are interpreted, which
    agrees with compiled code to a few ulp only, and which of the two a path meets depends
    on the rows earlier tests evaluated."""
    monkeypatch.setattr(compile_module, "LLVM_MIN_ROWS", 0)
    configs = block_configs(block)
    expected = pa.Table.from_pandas(
        evaluate_batch(configs, "s"), schema=RESULT_SCHEMA, preserve_index=False
    )
    got = evaluate_block(block, "s")
    assert got.schema == RESULT_SCHEMA and len(got) == len(configs) > 100
    for name in RESULT_SCHEMA.names:
        a, b = got.column(name), expected.column(name)
        if pa.types.is_dictionary(a.type):
            a, b = a.cast(pa.string()), b.cast(pa.string())
        assert a.equals(b), name
    assert set(got.column("status").to_pylist()) <= {"ok", "infeasible"}
    done = configs["config_hash"].iloc[::3]
    rest = evaluate_block(block, "s", done_hashes(done))
    assert len(rest) == len(configs) - len(done)
    assert set(rest.column("config_hash").to_pylist()) == set(configs["config_hash"]) - set(done)


def test_config_hash_is_a_function_of_row_values_only():
    """Same hashes from columns, from the plan table, with rows shuffled, columns reordered and
    text as plain strings instead of categoricals."""
    m, hw = load_model("mixtral_8x7b"), load_hardware("h100_sxm")
    cluster = load_cluster("dgx_h100").replace(num_gpus=32)
    e = enumerate_plans(m, TRAINING, hw, cluster, SearchSpace(ep=(1, 2, 4)))
    table = e.table
    from_columns = config_hash(e.columns).to_numpy()
    assert (config_hash(table).to_numpy() == from_columns).all()
    assert len(set(from_columns)) == len(table)
    order = np.random.default_rng(0).permutation(len(table))
    shuffled = table.iloc[order][list(reversed(table.columns))]
    shuffled = shuffled.astype({c: str for c in ("recompute", "attention", "model")})
    assert (config_hash(shuffled).to_numpy() == from_columns[order]).all()
    changed = table.assign(hidden=table["hidden"] + 1)
    assert not np.any(config_hash(changed).to_numpy() == from_columns)


def test_fsdp_master_shards_change_only_zero3_identities_and_memory():
    """The FSDP storage flag changes a row's hash and its memory only at ZeRO-3, where the
    stored shard is the fp32 master; rows without it keep the hashes they always had."""
    from stage_dse.cost.table import evaluate_table

    m, hw = load_model("llama3_8b"), load_hardware("h100_sxm")
    cluster = load_cluster("dgx_h100").replace(num_gpus=16)
    table = enumerate_plans(m, TRAINING, hw, cluster, SearchSpace(zero_stage=(1, 3))).table
    assert not table["fsdp_master_shards"].any()
    fsdp = table.assign(fsdp_master_shards=True)
    zero3 = (table["zero_stage"] == 3).to_numpy()
    same_hash = config_hash(fsdp).to_numpy() == config_hash(table).to_numpy()
    assert zero3.any() and (same_hash == ~zero3).all()
    before, after = evaluate_table(table), evaluate_table(fsdp)
    saved = (before["mem_total"] - after["mem_total"]).to_numpy()
    # the 16-bit shard is no longer stored beside the master: at ZeRO-3 the saving is the
    # 16-bit weights the row held, and the weights are now the fp32 shard (twice as large)
    held = before["mem_weights"].to_numpy()
    assert np.allclose(saved[zero3], held[zero3]) and np.all(saved[~zero3] == 0)
    assert np.allclose(after["mem_weights"].to_numpy()[zero3], 2 * held[zero3])


def test_expert_routing_and_dispatch_are_part_of_a_serving_row_s_identity():
    """A mixture-of-experts serving row's routing and dispatch change its hash unless they are
    the defaults (or empty, as for dense models), which hash as rows without the columns did."""
    m, hw = load_model("mixtral_8x7b"), load_hardware("h100_sxm")
    cluster = load_cluster("dgx_h100").replace(num_gpus=32)
    table = enumerate_plans(m, TRAINING, hw, cluster, SearchSpace(ep=(1, 2))).table.head(4)
    plain = config_hash(table).to_numpy()
    defaults = table.assign(moe_routing="power_law_1.01", moe_dispatch="allgather")
    assert (config_hash(defaults).to_numpy() == plain).all()
    assert (config_hash(table.assign(moe_routing="", moe_dispatch="")).to_numpy() == plain).all()
    a2a = config_hash(defaults.assign(moe_dispatch="alltoall")).to_numpy()
    even = config_hash(defaults.assign(moe_routing="balanced")).to_numpy()
    assert not np.any(a2a == plain) and not np.any(even == plain) and not np.any(a2a == even)


def test_a_space_with_no_dividing_degrees_counts_every_candidate_as_rejected():
    m, hw = load_model("llama3_8b"), load_hardware("h100_sxm")
    cluster = load_cluster("dgx_h100").replace(num_gpus=16)
    space = SearchSpace(tp=(3,), pp=(5,), micro_batch_size=(1, 2))
    e = enumerate_plans(m, TRAINING, hw, cluster, space)
    expected, total = brute_force(m, TRAINING, 16, space)
    assert e.candidates == total == 1 * 1 * 1 * 4 * 3 * 2 * 2 and not expected
    assert e.valid == len(e.table) == 0
    assert e.rejected == {"tp*pp*cp does not divide num_gpus(16)": total}


def test_a_table_of_many_families_equals_each_family_evaluated_alone():
    """Evaluated together (one shared symbol buffer, one output matrix), rows of different
    families get what each family gives alone, in any row order, and the output columns a
    family does not have (a collective its graph lacks) are zero on its rows."""
    from stage_dse.cost.table import evaluate_table

    model, hw = load_model("llama3_8b"), load_hardware("h100_sxm")
    cl = load_cluster("dgx_h100", num_gpus=32)
    space = SearchSpace(tp=(1, 2), pp=(1, 2), cp=(1,), micro_batch_size=(1, 2),
                        zero_stage=(0, 3), recompute=("none", "full"))  # fmt: skip
    table = enumerate_plans(model, TRAINING, hw, cl, space).table
    shuffled = table.sample(frac=1.0, random_state=0)  # families no longer contiguous
    together = evaluate_table(shuffled).loc[table.index]
    keys = ["tp", "pp", "zero_stage", "recompute"]
    lacking = 0
    for _, rows in table.groupby(keys):
        alone = evaluate_table(rows)
        assert set(alone.columns) <= set(together.columns)
        np.testing.assert_array_equal(together.loc[rows.index, alone.columns], alone)
        other = [c for c in together.columns if c not in alone.columns]
        lacking += len(other)
        assert (together.loc[rows.index, other] == 0).all().all()
    assert lacking > 0  # some family lacks some output


@settings(max_examples=60, deadline=None)
@given(
    categories=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=5, unique=True),
    data=st.data(),
)
def test_labels_read_like_the_pandas_categorical_they_stand_for(categories, data):
    """A text column of plan columns (codes into categories, without pandas) gives the values,
    comparisons, row selections and DataFrame column the equivalent pandas.Categorical gives."""
    from stage_dse.cost.labels import Labels

    codes = np.array(
        data.draw(st.lists(st.integers(0, len(categories) - 1), min_size=0, max_size=20)),
        dtype=np.int64,
    )
    labels, cat = Labels(codes, categories), pd.Categorical.from_codes(codes, categories)
    assert list(labels) == list(cat)
    probe = data.draw(st.sampled_from([*categories, "absent"]))
    np.testing.assert_array_equal(labels == probe, np.asarray(cat == probe))
    np.testing.assert_array_equal(labels != probe, np.asarray(cat != probe))
    mask = np.array(
        data.draw(st.lists(st.booleans(), min_size=len(codes), max_size=len(codes))), dtype=bool
    )
    assert list(labels[mask]) == list(cat[mask])
    pd.testing.assert_series_equal(pd.Series(labels.to_pandas()), pd.Series(cat))
    np.testing.assert_array_equal(np.asarray(labels, dtype=object), np.asarray(cat, dtype=object))
