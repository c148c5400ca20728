"""The layering of ARCHITECTURE.md, checked on the source: lower layers never import the
configuration edge or the command line, modules stay readable, every op kind has its rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stage_dse
from stage_dse.graph.backward import BACKWARD_RULES
from stage_dse.graph.ir import OpKind

PACKAGE = Path(stage_dse.__file__).parent
LOWER = ("graph", "cost", "search", "runner", "spec", "results", "trace")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_import_neither_config_nor_cli(layer):
    for path in sorted((PACKAGE / layer).glob("*.py")):
        bad = {
            m
            for m in _imports(path)
            if m.startswith(("stage_dse.config", "stage_dse.cli", "hydra", "omegaconf"))
        }
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_search_imports_nothing_below_it():
    """``search/`` (spaces, enumeration, what a sampler may choose) sits above the drivers:
    it reads specs and cost columns and never imports ``runner/`` (the Optuna driver lives
    there beside the sweep drivers), ``results/``, ``trace/`` or ``validation/``."""
    allowed = ("search", "cost", "graph", "spec", "errors")
    for path in sorted((PACKAGE / "search").glob("*.py")):
        bad = {
            m
            for m in _imports(path)
            if m.startswith("stage_dse.") and m.split(".")[1] not in allowed
        }
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_symbolic_layer_does_no_io():
    for layer in ("graph", "spec"):
        for path in sorted((PACKAGE / layer).glob("*.py")):
            bad = _imports(path) & {"os", "pathlib", "json", "yaml", "pyarrow", "pandas"}
            assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_no_module_over_600_lines():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name.endswith("_pb2.py"):
            continue
        n = len(path.read_text().splitlines())
        assert n <= 600, f"{path.relative_to(PACKAGE)} has {n} lines"


def test_every_forward_op_kind_has_a_backward_rule():
    assert set(BACKWARD_RULES) == set(OpKind) - {OpKind.OPTIMIZER}


SERVING_INTERNALS = (
    "stage_dse.cost.serving",
    "stage_dse.cost.batching",
    "stage_dse.cost.requests",
    "stage_dse.cost.disagg",
    "stage_dse.runner.serving",
    "stage_dse.runner.recommend",
)


def test_the_command_line_serves_through_the_driver():
    """Serving sweeps, SLA fronts and recommendations are decided by one driver
    (``runner/serving_job.py``): no command-line module reaches past it into the serving
    evaluators, and the sweep command's modules import nothing of ``cost/`` or ``kernels/``."""
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        names = _imports(path)
        bad = {m for m in names if m in SERVING_INTERNALS}
        if path.name in ("sweep.py", "serve.py"):
            bad |= {m for m in names if m.startswith(("stage_dse.cost", "stage_dse.kernels"))}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_cache_helpers_and_measured_families_sit_below_their_users():
    """The disk cache is a module of its own (``stage_dse/diskcache.py``), so the kernel
    tables do not reach into the cost compiler for it; one plan's evaluation
    (``cost/bind.py``) and the table evaluator (``cost/table.py``) share the measured family
    from ``cost/measured.py`` instead of importing each other."""
    assert not any(
        m.startswith("stage_dse.cost") for m in _imports(PACKAGE / "kernels" / "tables.py")
    )
    assert "stage_dse.cost.table" not in _imports(PACKAGE / "cost" / "bind.py")
    assert not {m for m in _imports(PACKAGE / "diskcache.py") if m.startswith("stage_dse")}
