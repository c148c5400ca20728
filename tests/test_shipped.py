"""Numpy programs of plan families: the printer against symengine, and the programs the
package ships for the presets' common families (current, equal to the derived ones, and
enough for a process with an empty cache to evaluate the default sweep without deriving)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import symengine as se
from hypothesis import given, settings
from hypothesis import strategies as st

import stage_dse.cost.compile as C
import stage_dse.cost.shipped as shipped
from stage_dse.cli.shipped import preset_tables, stale
from stage_dse.cost.table import evaluate_columns
from stage_dse.cost.vector import Unprintable, numpy_source, source_function

x, y, z = se.symbols("x y z")
s0, s1 = se.symbols("s0 s1")
# one step per construct the cost programs use, outputs over the steps and the inputs
STEPS = [
    (s0, se.Max(x, 2 * y, z - 1) + se.Min(x, y) * se.Rational(3, 7)),
    (s1, se.Piecewise((x / y, se.Lt(x, y)), (se.floor(z), se.Eq(x, z)), (se.ceiling(y), True))),
]
FINALS = [
    s0 * s1,
    se.log(x) * s1**-1 + y ** se.Rational(1, 2),
    se.Piecewise((1, se.Le(s0, s1)), (0, True)),
    se.Integer(3),
    s0 - se.RealDouble(0.25) * se.E,
]


def _symengine_values(rows: np.ndarray) -> np.ndarray:
    resolved: dict = {}
    for sym, e in STEPS:
        resolved[sym] = e.xreplace(resolved)
    outs = [f.xreplace(resolved) for f in FINALS]
    fn = se.Lambdify([x, y, z], outs, backend="lambda", real=True)
    return np.array([np.asarray(fn(r), float).ravel() for r in rows])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(*[st.floats(0.5, 64.0, allow_nan=False) for _ in range(3)]),
        min_size=1,
        max_size=20,
    )
)
def test_the_numpy_program_equals_symengine(values):
    rows = np.array(values, float)
    rows[::3, 2] = rows[::3, 0]  # some rows take the Eq branch
    fn = source_function(numpy_source(STEPS, FINALS, ["x", "y", "z"]), len(FINALS))
    np.testing.assert_allclose(fn(rows), _symengine_values(rows), rtol=1e-14, atol=0)


def test_one_row_that_divides_by_zero_in_an_untaken_branch():
    """Python floats raise where numpy returns inf: such a row runs again on numpy scalars
    and gets the numbers the columns get."""
    program = [se.Piecewise((1 / (x - y), se.Lt(y, x)), (se.log(x - y + 1), True)), se.Max(x, y)]
    fn = source_function(numpy_source([], program, ["x", "y"]), 2)
    rows = np.array([[2.0, 2.0], [3.0, 1.0], [1.0, 2.0], [0.0, 1.0], [5.0, 5.0]])
    table = fn(np.repeat(rows, 2, axis=0))[::2]  # numpy columns
    one_by_one = np.vstack([fn(r[None, :]) for r in rows])  # Python floats, numpy on error
    np.testing.assert_array_equal(table, one_by_one)
    assert table[0, 0] == 0.0 and table[1, 0] == 0.5


def test_a_node_outside_the_vocabulary_is_refused():
    with pytest.raises(Unprintable, match="sin"):
        numpy_source([], [se.sin(x)], ["x"])
    with pytest.raises(Unprintable, match="free symbol"):
        numpy_source([], [x + y], ["x"])


def test_the_shipped_programs_are_current():
    missing, extra = stale()
    assert not missing and not extra, (
        f"{len(missing)} shipped family programs missing and {len(extra)} stale: the cost "
        "model changed; rewrite them with `python -m stage_dse.cli.shipped`"
    )


def test_shipped_programs_give_the_derived_numbers(tmp_path, monkeypatch):
    """The default sweep's table from the shipped programs (nothing derived), and its first
    rows again from freshly derived and compiled families."""
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    for name in ("_rows_seen", "_compiled", "_interpreted", "_ready"):  # as a new process
        monkeypatch.setattr(C, name, type(getattr(C, name))())
    C._interpreted_family.cache_clear()
    table = preset_tables()[0]
    monkeypatch.setattr(C, "_family_outputs", lambda *a: pytest.fail("derived"))
    names, from_shipped = evaluate_columns(table)
    monkeypatch.undo()
    monkeypatch.setenv("STAGE_DSE_CACHE", str(tmp_path))
    monkeypatch.setattr(shipped, "shipped_source", lambda key, subset: None)
    monkeypatch.setattr(C, "LLVM_MIN_ROWS", 0)
    C._interpreted_family.cache_clear()
    head = table.take(np.arange(len(table)) < 40)
    names_again, derived = evaluate_columns(head)
    C._interpreted_family.cache_clear()
    at = [names.index(n) for n in names_again]  # the head meets fewer families' outputs
    assert len(at) >= 40
    np.testing.assert_allclose(from_shipped[:40, at], derived, rtol=1e-14, atol=0, equal_nan=True)


_DEFAULT_SWEEP_TABLE = """
import sys
from stage_dse.cli.shipped import preset_tables
from stage_dse.cost.table import evaluate_columns
plans = preset_tables()[0]
names, y = evaluate_columns(plans, "memory")
names, y = evaluate_columns(plans)
print(len(y), *(m in sys.modules for m in ("sympy", "stage_dse.graph.core")))
"""


def test_a_process_with_an_empty_cache_evaluates_the_default_sweep_without_deriving(
    tmp_path, run_python
):
    out = run_python(_DEFAULT_SWEEP_TABLE, dict(os.environ, STAGE_DSE_CACHE=str(tmp_path)))
    rows, sympy_loaded, graph_loaded = out
    assert int(rows) > 1000
    assert (sympy_loaded, graph_loaded) == ("False", "False")
    assert not list(tmp_path.glob("program-*.pkl"))
