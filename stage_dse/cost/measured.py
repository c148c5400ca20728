"""A cost family whose kernels are timed from tables of measured kernels
(:mod:`stage_dse.kernels`) instead of the roofline: what ``timing="measured"`` evaluates, for
a table (:func:`stage_dse.cost.table.evaluate_table`) or one plan
(:func:`stage_dse.cost.bind.evaluate_plan`)."""

from __future__ import annotations

import numpy as np

from stage_dse.cost.compile import family_for, family_kernels
from stage_dse.cost.key import CostKey

__all__ = ["MeasuredFamily"]


class MeasuredFamily:
    """One family evaluated with measured kernel times: the kernels' shapes from the family's
    ``kernels`` program, their seconds from the tables (roofline where a table has no such
    kernel), then the ``measured`` program with those seconds as inputs; the extra output
    ``measured_share`` is the share of the step time that came from tables."""

    STEP = "time_step_s"
    EPS = 1e-6

    def __init__(self, key: CostKey, rows: int, tables) -> None:
        self.kernels = family_kernels(key)
        self.shapes = family_for(key, "kernels", rows)
        self.family = family_for(key, "measured", rows)
        self.tables = tables
        self.names = (*self.family.names, "measured_share")
        self.step = self.family.names.index(self.STEP)

    def row(self, x: np.ndarray) -> np.ndarray:
        """The outputs of one row ``x`` (a ``(1, len(SYMBOL_NAMES))`` matrix)."""
        return self(x)[0]

    def into(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The outputs of the rows ``x`` (a new matrix: ``out`` is not written)."""
        return self(x)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from stage_dse.kernels.timing import kernel_seconds

        seconds, measured = kernel_seconds(self.kernels, self.shapes(x), self.tables)
        y = self.family(np.hstack([x, seconds]))
        share = np.zeros(len(x))
        if measured.any():
            # the step time's derivative along the measured kernels' times: how much of the
            # step they make up (sums and maxima are linear almost everywhere)
            bumped = self.family(np.hstack([x, seconds * (1 + self.EPS * measured)]))
            step = y[:, self.step]
            share = np.clip((bumped[:, self.step] - step) / (self.EPS * step), 0.0, 1.0)
        return np.hstack([y, share[:, None]])
