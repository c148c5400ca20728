"""Request classes of a serving workload: a stated mix of prompt and output lengths, or
output lengths spread around their mean as benchmark datasets spread them. What
:func:`stage_dse.cost.batching.continuous_batching` averages its steady state over. No I/O."""

from __future__ import annotations

import itertools

import numpy as np

from stage_dse.errors import ConfigError

__all__ = ["LENGTH_CLASSES", "mix_classes", "output_length_classes", "request_classes"]

LENGTH_CLASSES = 12
"""Classes of a spread of output lengths (geometric in survival)."""
_BISECT = 60  # halvings of the truncated exponential's scale bracket


def request_classes(mix) -> list[tuple[float, float, float]]:
    """A request mix ``[[prompt, output_tokens, weight], ...]`` checked, as
    ``(prompt, output_tokens, weight)`` classes with the weights normalised."""
    classes = [tuple(float(x) for x in item) for item in mix]
    if not classes or any(len(c) != 3 for c in classes):
        raise ConfigError("serving.request_mix: give [[prompt, output_tokens, weight], ...]")
    for p, o, w in classes:
        if not (p >= 1 and o >= 1 and w > 0):
            raise ConfigError(
                f"serving.request_mix: prompt and output_tokens must be >= 1 and weights > 0, "
                f"got [{p:g}, {o:g}, {w:g}]"
            )
    total = sum(w for _, _, w in classes)
    return [(p, o, w / total) for p, o, w in classes]


def mix_classes(mix, n_rows: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Request classes ``(prompt, output_tokens, weight)`` over the rows, weights normalised."""
    return [(np.full(n_rows, p), np.full(n_rows, o), w) for p, o, w in request_classes(mix)]


def _truncated_scale(mean: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Scale ``theta`` of an exponential truncated to ``[0, cap]`` whose mean is ``mean``
    (``theta - cap / (exp(cap / theta) - 1)``, increasing in ``theta``; bisection)."""
    lo, hi = np.full_like(mean, 1e-9), np.where(np.isfinite(cap), 1e6 * mean + cap, 2 * mean)
    for _ in range(_BISECT):
        mid = 0.5 * (lo + hi)
        with np.errstate(over="ignore"):
            m = mid - np.where(np.isfinite(cap), cap / np.expm1(np.minimum(cap / mid, 700.0)), 0.0)
        lo, hi = np.where(m < mean, mid, lo), np.where(m < mean, hi, mid)
    return np.where(np.isfinite(cap), 0.5 * (lo + hi), mean)


def output_length_classes(mean_tokens, cap_tokens, requests) -> list[tuple[np.ndarray, np.ndarray]]:
    """Output lengths spread as an exponential with mean ``mean_tokens`` truncated at
    ``cap_tokens`` (the maximum-entropy law of a positive length whose mean alone is known;
    benchmark samplers cap prompt plus output, e.g. 2,048 tokens in vLLM's ShareGPT sampler,
    ``vllm/benchmarks/datasets.py`` ``is_valid_sequence``), as ``(output_tokens, weight)``
    classes over the rows: the conditional means of survival bands ``1 > n^-1/(K-1) > ...
    > 1/n > 0`` for ``n = requests``, so that the last class is the longest of ``n`` requests
    (a burst's drain runs as long as its longest request). The classes' mean is
    ``mean_tokens`` exactly."""
    mean = np.asarray(mean_tokens, dtype=float)
    cap = np.broadcast_to(np.asarray(cap_tokens, dtype=float), mean.shape)
    n = np.broadcast_to(np.asarray(requests, dtype=float), mean.shape)
    theta = _truncated_scale(mean, cap)
    tail = np.where(np.isfinite(cap), np.exp(-np.minimum(cap / theta, 700.0)), 0.0)

    def length_at(survival):  # the length a share ``survival`` of requests exceeds
        return -theta * np.log(survival * (1.0 - tail) + tail)

    def partial(x):  # integral of x e^(-x/theta) / theta from 0 to x, over (1 - tail)
        e = np.exp(-np.minimum(x / theta, 700.0))
        return (theta - (x + theta) * e) / (1.0 - tail)

    levels = [n ** (-j / (LENGTH_CLASSES - 1)) for j in range(LENGTH_CLASSES)] + [None]
    out = []
    for upper, lower in itertools.pairwise(levels):
        a = length_at(upper)
        b = np.where(np.isfinite(cap), cap, np.inf) if lower is None else length_at(lower)
        weight = upper - (0.0 if lower is None else lower)
        b_part = np.where(
            np.isfinite(b), partial(np.where(np.isfinite(b), b, 0.0)), theta / (1.0 - tail)
        )
        out.append(((b_part - partial(a)) / weight, weight))
    return out
