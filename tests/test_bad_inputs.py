"""The bad-input table (``tests/bad_inputs.py``): every case exits non-zero with one line that
names the field, run through the console scripts."""

from __future__ import annotations

import bad_inputs


def test_at_least_ninety_bad_inputs_each_give_one_line_naming_the_field(capsys):
    assert len(bad_inputs.CASES) >= 100
    assert bad_inputs.main() == 0, capsys.readouterr().out
