"""Interpolation over tables of measured kernel latencies (pure numpy, no I/O).

A :class:`GridTable` holds latencies measured on a grid of shapes (every combination of a few
values per axis, as kernel benchmarks sweep them) and answers many queries at once: it
interpolates linearly in log space (log latency against log shape, per axis: multilinear over
the cell that holds the query). Between two measured points the answer is monotone and lies
between them (no overshoot); at a measured point it is the measured value. A query outside the
measured range, or in a cell with an unmeasured corner, is reported as outside (``inside`` is
False, the latency NaN), never extrapolated: the caller falls back to its analytic model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GridTable"]


@dataclass(frozen=True)
class GridTable:
    """Latencies on a grid: ``axes[i]`` the ascending measured values of shape axis ``i``,
    ``seconds`` of shape ``tuple(len(a) for a in axes)``, NaN where not measured."""

    names: tuple[str, ...]
    axes: tuple[np.ndarray, ...]
    seconds: np.ndarray

    def __post_init__(self) -> None:
        if self.seconds.shape != tuple(len(a) for a in self.axes):
            raise ValueError("seconds must have one entry per grid point")
        for name, a in zip(self.names, self.axes):
            if len(a) < 2 or np.any(np.diff(a) <= 0) or a[0] <= 0:
                raise ValueError(f"axis {name} needs >= 2 ascending positive values")

    @classmethod
    def from_points(cls, names: tuple[str, ...], coords: np.ndarray, seconds: np.ndarray):
        """A table from measured points: ``coords`` (points, axes), ``seconds`` (points,).
        A point measured twice keeps the faster measurement."""
        coords = np.asarray(coords, dtype=np.float64)
        axes = tuple(np.unique(coords[:, i]) for i in range(coords.shape[1]))
        grid = np.full(tuple(len(a) for a in axes), np.inf)
        index = tuple(np.searchsorted(a, coords[:, i]) for i, a in enumerate(axes))
        np.minimum.at(grid, index, np.asarray(seconds, dtype=np.float64))
        grid[np.isinf(grid)] = np.nan
        return cls(tuple(names), axes, grid)

    @property
    def measured(self) -> int:
        return int(np.isfinite(self.seconds).sum())

    def lookup(self, *coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Seconds at each query (arrays broadcast together) and whether it was inside the
        measured range; outside queries get NaN."""
        if len(coords) != len(self.axes):
            raise ValueError(f"expected {len(self.axes)} coordinates ({', '.join(self.names)})")
        q = np.broadcast_arrays(*[np.asarray(c, dtype=np.float64) for c in coords])
        shape = q[0].shape
        q = [c.reshape(-1) for c in q]
        log_axes, log_values, missing, strides = self._prepared()
        inside = np.ones(q[0].shape, dtype=bool)
        base = np.zeros(q[0].shape, dtype=np.intp)
        weights = []
        for c, a, la, stride in zip(q, self.axes, log_axes, strides):
            inside &= (c >= a[0]) & (c <= a[-1])
            lc = np.log(np.clip(c, a[0], a[-1]))
            i = np.clip(np.searchsorted(la, lc, side="right") - 1, 0, len(a) - 2)
            weights.append(np.clip((lc - la[i]) / (la[i + 1] - la[i]), 0.0, 1.0))
            base += i * stride
        acc = np.zeros(q[0].shape)
        for corner in range(1 << len(self.axes)):
            offset, wt = 0, None
            for d, (w, stride) in enumerate(zip(weights, strides)):
                up = (corner >> d) & 1
                offset += up * stride
                f = w if up else 1.0 - w
                wt = f if wt is None else wt * f
            flat = base + offset
            acc += wt * log_values[flat]
            # a corner that carries no weight (the query lies on a measured face) may be missing
            inside &= ~((wt > 0) & missing[flat])
        out = np.where(inside, np.exp(acc), np.nan)
        return out.reshape(shape), inside.reshape(shape)

    def _prepared(self):
        """Log axes, log latencies (0 where missing) and the missing mask, flattened, and the
        strides of the flat grid (computed once per table)."""
        cached = self.__dict__.get("_cache")
        if cached is None:
            missing = ~np.isfinite(self.seconds)
            log_values = np.where(missing, 0.0, np.log(np.where(missing, 1.0, self.seconds)))
            strides = [int(s) // self.seconds.itemsize for s in self.seconds.strides]
            cached = (
                tuple(np.log(a) for a in self.axes),
                np.ascontiguousarray(log_values).reshape(-1),
                np.ascontiguousarray(missing).reshape(-1),
                strides,
            )
            object.__setattr__(self, "_cache", cached)
        return cached
