"""The README's Python examples print what the README shows beside them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# a python block, optionally the word "prints", then the plain block of its output
EXAMPLE = re.compile(r"```python\n(.*?)```\n(?:\s*prints\s*\n)?\s*```\n(.*?)```", re.S)
NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def examples() -> list[tuple[str, str]]:
    return EXAMPLE.findall(README.read_text())


def test_the_readme_has_examples_with_outputs():
    assert len(examples()) >= 3


@pytest.mark.parametrize("index", range(3))
def test_readme_example_prints_what_the_readme_shows(index, tmp_path):
    code, shown = examples()[index]
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert run.returncode == 0, run.stderr
    got, want = run.stdout.split(), shown.split()
    assert len(got) == len(want), (run.stdout, shown)
    for g, w in zip(got, want):
        if NUMBER.match(w) and NUMBER.match(g):
            assert float(g) == pytest.approx(float(w), rel=2e-3), (run.stdout, shown)
        else:
            assert g == w, (run.stdout, shown)
