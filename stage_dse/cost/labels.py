"""A text column of a plan table as integer codes into its distinct values: the layout of
:class:`pandas.Categorical`, without importing pandas (a process that enumerates and evaluates
plans as columns needs no DataFrame; :meth:`Labels.to_pandas` makes one column of it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Labels"]


class Labels:
    """``codes[i]`` is the position of row ``i``'s value in ``categories`` (distinct values)."""

    __slots__ = ("categories", "codes")
    __hash__ = None  # type: ignore[assignment]  # compares row by row, like an array

    def __init__(self, codes: np.ndarray, categories: Sequence) -> None:
        self.codes = np.asarray(codes)
        self.categories = tuple(categories)

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, index):
        """One row's value (an integer index), or the rows at ``index`` (positions, a boolean
        mask or a slice) as labels over the same categories."""
        if isinstance(index, int | np.integer):
            return self.categories[self.codes[index]]
        return Labels(self.codes[index], self.categories)

    def __iter__(self) -> Iterator:
        return (self.categories[c] for c in self.codes.tolist())

    def __eq__(self, other: object) -> np.ndarray:  # type: ignore[override]
        """Row by row against one value, or against another column of as many rows: a
        boolean array."""
        if isinstance(other, Labels | np.ndarray | list | tuple):
            return self.to_numpy() == np.asarray(other, dtype=object)
        if other in self.categories:
            return self.codes == self.categories.index(other)
        return np.zeros(len(self.codes), dtype=bool)

    def __ne__(self, other: object) -> np.ndarray:  # type: ignore[override]
        return ~(self == other)

    def __repr__(self) -> str:
        return f"Labels({len(self)} rows, categories={list(self.categories)!r})"

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self.to_numpy()
        return values if dtype is None else values.astype(dtype)

    def to_numpy(self) -> np.ndarray:
        """The values, one per row (an object array)."""
        values = np.empty(len(self.categories), dtype=object)
        values[:] = self.categories
        return values[self.codes]

    def to_pandas(self) -> pd.Categorical:
        import pandas as pd

        return pd.Categorical.from_codes(self.codes, categories=list(self.categories))
