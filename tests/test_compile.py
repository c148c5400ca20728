"""The compile strategy by size: small tables are interpreted, large ones compiled, and both
give the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import symengine as se

import stage_dse.cost.compile as C
from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.table import KEY_COLUMNS, key_from_values
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.spec import TrainingSpec


@pytest.fixture(scope="module")
def families():
    """Rows and key of a few families of two models (dense with CP, MoE with EP)."""
    out = []
    for name, space in (
        ("llama3_70b", SearchSpace(cp=(1, 2), attention=("flash", "materialized"))),
        ("mixtral_8x7b", SearchSpace(ep=(1, 2, 4, 8))),
    ):
        plans = enumerate_plans(
            load_model(name),
            TrainingSpec(seq_len=4096, global_batch_size=512),
            load_hardware("h100_sxm"),
            load_cluster("dgx_h100", num_gpus=256),
            space,
        ).table
        codes = plans.groupby(list(KEY_COLUMNS), observed=True, sort=False).ngroup()
        for g in np.unique(codes)[:3]:
            rows = plans[codes == g]
            key = key_from_values(dict(rows[list(KEY_COLUMNS)].iloc[0]))
            out.append((key, np.ascontiguousarray(rows[list(C.SYMBOL_NAMES)].to_numpy(float))))
    return out


@pytest.fixture
def unshipped(monkeypatch):
    """As if the package shipped no family program (every family derived or cached)."""
    import stage_dse.cost.shipped as shipped

    monkeypatch.setattr(shipped, "shipped_source", lambda key, subset: None)
    C._interpreted_family.cache_clear()
    C._cse_program.cache_clear()
    C._symengine_program.cache_clear()
    yield
    C._interpreted_family.cache_clear()


def test_interpreted_and_compiled_families_agree(families, tmp_path, monkeypatch, unshipped):
    """The evaluators round differently (their operation orders differ, and the order of a
    derived sum's terms can depend on what the process derived before): a few ulp, 1.6e-15
    relative at most when other test modules ran first (2.4e-16 alone). The interpreted
    program runs on numpy columns for tables and on Python floats for a few rows."""
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    for key, x in families:
        fast = C._interpreted_family(key, "all")
        built = C.compile_family(key, "symengine")
        assert fast.names == built.names
        table = np.ascontiguousarray(np.tile(x, (8 // len(x) + 1, 1)))
        for rows in (table, x[:1]):
            a, b = fast(rows), built(rows)
            assert np.array_equal(np.isnan(a), np.isnan(b))
            assert np.allclose(a, b, rtol=1e-14, atol=0, equal_nan=True)


def test_dag_conversion_equals_symengines_own(families):
    key, x = families[0]
    defs, outputs = C.family_program(key)
    names = list(outputs)
    ours = C._to_symengine(defs, [outputs[n] for n in names])
    resolved: dict = {}
    for sym, expr in defs:
        e = se.sympify(expr)
        resolved[se.Symbol(sym.name)] = e.xreplace(resolved) if resolved else e
    theirs = [se.sympify(outputs[n]).xreplace(resolved) for n in names]
    args = C._se_args()
    a = se.Lambdify(args, ours, backend="lambda", cse=True, real=True)(x)
    b = se.Lambdify(args, theirs, backend="lambda", cse=True, real=True)(x)
    assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def test_a_family_is_compiled_once_its_rows_repay_it(families, tmp_path, monkeypatch):
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "LLVM_MIN_ROWS", 1000)
    monkeypatch.setattr(C, "_rows_seen", {})
    monkeypatch.setattr(C, "_compiled", set())
    monkeypatch.setattr(C, "_ready", {})
    monkeypatch.setattr(C, "_interpreted", set())
    C.compile_family.cache_clear()  # as a new process: what earlier tests compiled is not kept
    key, _ = families[-1]
    assert C.family_for(key, "all", 400).backend == "interpreted"
    assert C.family_for(key, "all", 400).backend == "interpreted"
    assert not list(tmp_path.glob("family-*.pkl"))  # nothing compiled, nothing cached
    assert C.family_for(key, "all", 400).backend == "symengine"  # 1,200 rows: compiled
    assert len(list(tmp_path.glob("family-*.pkl"))) == 1
    # a later process finds the compiled code in the disk cache and uses it for one row
    monkeypatch.setattr(C, "_rows_seen", {})
    monkeypatch.setattr(C, "_compiled", set())
    monkeypatch.setattr(C, "_ready", {})
    monkeypatch.setattr(C, "_interpreted", set())
    C.compile_family.cache_clear()
    assert C.family_for(key, "all", 1).backend == "symengine"


def test_a_family_met_by_an_earlier_process_is_loaded_not_derived(
    families, tmp_path, monkeypatch, unshipped
):
    """The first process interprets a small family and stores its derived program; a later
    one loads the program instead of deriving it and interprets it too (equal results):
    compiling waits until a process evaluates LLVM_MIN_ROWS of its rows."""
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    key, x = families[0]
    for name in ("_rows_seen", "_compiled", "_interpreted", "_ready"):
        monkeypatch.setattr(C, name, type(getattr(C, name))())
    first = C.family_for(key, "all", 10)
    assert first.backend == "interpreted"
    assert len(list(tmp_path.glob("program-*.pkl"))) == 1
    assert not list(tmp_path.glob("family-*.pkl"))
    assert C.family_for(key, "all", 10) is first  # same process: still interpreted
    derived = first(x)

    for name in ("_rows_seen", "_compiled", "_interpreted", "_ready"):  # a later process
        monkeypatch.setattr(C, name, type(getattr(C, name))())
    C._interpreted_family.cache_clear()
    C._cse_program.cache_clear()
    C._symengine_program.cache_clear()
    C.compile_family.cache_clear()
    monkeypatch.setattr(C, "_family_outputs", lambda *a: pytest.fail("derived again"))
    later = C.family_for(key, "all", 1)
    assert later.backend == "interpreted"
    assert not list(tmp_path.glob("family-*.pkl"))
    np.testing.assert_allclose(later(x), derived, rtol=1e-14, equal_nan=True)


_TABLE_IN_A_FRESH_PROCESS = """
import sys
from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.cost.table import evaluate_columns
from stage_dse.search import SearchSpace, enumerate_plans
from stage_dse.spec import ParallelPlan, TrainingSpec

model, training = load_model("llama3_8b"), TrainingSpec(seq_len=4096, global_batch_size=256)
hardware, cluster = load_hardware("h100_sxm"), load_cluster("dgx_h100", num_gpus=64)
space = SearchSpace(tp=(2,), pp=(1,), zero_stage=(1,), recompute=("selective",),
                    sequence_parallel=(True,), micro_batch_size=(1, 2))
names, y = evaluate_columns(enumerate_plans(model, training, hardware, cluster, space).columns)
plan = ParallelPlan(dp=32, tp=2, sequence_parallel=True, zero_stage=1, recompute="selective")
step_s = evaluate_plan(model, training, plan, hardware=hardware, cluster=cluster)["step_s"]
print(len(y), step_s, *(m in sys.modules for m in ("sympy", "stage_dse.graph.core", "pandas")))
"""


def test_a_process_that_meets_only_compiled_families_derives_nothing(tmp_path, run_python):
    """A process whose families an earlier one compiled (the disk cache holds their code)
    evaluates a table and a single plan without importing sympy, the graph builders or
    pandas, and gets the numbers the deriving process got."""
    import os

    env = dict(os.environ, STAGE_DSE_CACHE=str(tmp_path), STAGE_DSE_LLVM_MIN_ROWS="0")
    first = run_python(_TABLE_IN_A_FRESH_PROCESS, env)
    later = run_python(_TABLE_IN_A_FRESH_PROCESS, env)
    assert first[:2] == later[:2]  # rows, step seconds
    assert first[2:4] == ["True", "True"]  # the first process derived the families
    assert later[2:] == ["False", "False", "False"]
