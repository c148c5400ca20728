"""Which layers sit on which pipeline stage: the one split the cost model and traces share.

A plan with ``pp`` stages and ``v`` model chunks per stage has ``N = pp * v`` virtual stages;
virtual stage ``c * pp + s`` is chunk ``c`` of stage ``s`` (Narayanan et al. SC21 sec. 2.2).
``plan.stage_layers`` says how the model's layers are spread over them:

* ``balanced`` (default): ``ceil(L / N)`` on every virtual stage, the shortfall taken one
  layer at a time from the first, the last, then the second, third, ... virtual stage, so the
  ends (which also hold the embedding and the output layer) are the lighter ones. Llama 3 405B
  (126 layers, pp 16) gets 7 layers on the first and last stage and 8 elsewhere, the layout
  Meta reports ("The Llama 3 Herd of Models", 2024, sec. 3.3.2: one layer removed from the
  first and the last stage);
* ``ceil``: the first ``L mod N`` virtual stages hold ``ceil(L / N)`` layers, the rest
  ``floor(L / N)``: the first stage is as heavy as ``ceil(L / pp)`` bounds it;
* an explicit list of ``N`` positive layer counts in virtual-stage order, summing to ``L``
  (text ``"7,8,...,7"`` in tables and YAML).

Only the first and the last virtual stage may hold no layer: they then run the embedding or the
output layer alone (with ``balanced`` when ``pp * v`` exceeds the layers by one or two; Llama 3
405B's 126 layers over 16 stages x 8 chunks leave the embedding and the head a chunk each).

:func:`stage_values` condenses a split into the few numbers the closed-form costs need: layers
on the first and last stage and, among the middle stages, the one with the most layers and the
one with the most layer-micro-batches of activations in flight under the schedule (1F1B: stage
``i`` holds ``pp - i`` micro-batches; interleaved: ``2 (pp - i - 1) + (v - 1) pp + 1`` chunks).
For the named splits the middle stages take at most two layer counts, so the heaviest middle
stage in memory is one of these two for any ratio of state to activation bytes; for an explicit
list it is the heavier of the two extremes of that trade-off.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from stage_dse.errors import ConfigError

__all__ = [
    "STAGE_SPLITS",
    "STAGE_SYMBOLS",
    "normalize_stage_layers",
    "stage_layer_counts",
    "stage_values",
    "virtual_stage_layers",
]

STAGE_SPLITS = ("balanced", "ceil")
STAGE_SYMBOLS = (
    "first_layers",
    "last_layers",
    "mid_layers",
    "mid_stage",
    "act_layers",
    "act_stage",
)
"""Symbol values :func:`stage_values` binds (see the module doc)."""


def normalize_stage_layers(value: object) -> str:
    """``balanced``, ``ceil`` or an explicit list as ``"7,8,...,7"``; ConfigError otherwise."""
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        if text in STAGE_SPLITS:
            return text
        parts = text.strip("[]()").split(",")
    elif isinstance(value, Sequence):
        parts = list(value)
    else:
        parts = None
    try:
        counts = [int(p) for p in parts] if parts else []
    except (TypeError, ValueError):
        counts = []
    if not counts or any(isinstance(p, bool) for p in parts or []):
        raise ConfigError(
            f"plan.stage_layers={value!r}: give one of {', '.join(STAGE_SPLITS)} or a list of "
            "layer counts per virtual stage"
        )
    if min(counts) < 0:
        raise ConfigError(f"plan.stage_layers={value!r}: layer counts cannot be negative")
    return ",".join(str(c) for c in counts)


def virtual_stage_layers(num_layers: int, pp: int, v: int, split: str) -> list[int]:
    """Layers of each virtual stage ``c * pp + s`` (``split`` as normalized)."""
    n = pp * v
    if split == "balanced":
        if n > num_layers + 2:
            raise ConfigError(
                f"pp({pp})*virtual_stages({v})={n} > layers({num_layers})+2: only the first and "
                "last virtual stage may hold no layer (the embedding or the output layer alone)"
            )
        per = -(-num_layers // n)
        counts = [per] * n
        deficit = per * n - num_layers
        order = [0, n - 1, *range(1, n - 1)] if n > 1 else [0]
        # the end virtual stages may be left with the embedding or the output layer alone
        floor = [1] * n
        if n > 1 and n > num_layers:
            floor[0] = floor[-1] = 0
        i = 0
        while deficit > 0:
            s = order[i % len(order)]
            if counts[s] > floor[s]:
                counts[s] -= 1
                deficit -= 1
            i += 1
        return counts
    if split == "ceil":
        if n > num_layers:
            raise ConfigError(
                f"pp({pp})*virtual_stages({v})={n} > layers({num_layers}) (stage_layers=ceil)"
            )
        base, extra = divmod(num_layers, n)
        return [base + (1 if i < extra else 0) for i in range(n)]
    counts = [int(c) for c in split.split(",")]
    if any(c < 1 for c in counts[1:-1]) or (n == 1 and counts[0] < 1):
        raise ConfigError(f"plan.stage_layers={split}: a middle stage needs at least one layer")
    if len(counts) != n:
        raise ConfigError(
            f"plan.stage_layers lists {len(counts)} stages, pp({pp})*virtual_stages({v})={n}"
        )
    if sum(counts) != num_layers:
        raise ConfigError(f"plan.stage_layers sums to {sum(counts)} != layers({num_layers})")
    return counts


def stage_layer_counts(num_layers: int, pp: int, v: int, split: str) -> list[list[int]]:
    """Layers of each model chunk of each stage: ``[stage][chunk]``."""
    flat = virtual_stage_layers(num_layers, pp, v, split)
    return [[flat[c * pp + s] for c in range(v)] for s in range(pp)]


def _inflight_chunks(stage: int, pp: int, v: int) -> int:
    """Forward chunks a stage holds before its first backward (1F1B: pp - stage)."""
    if v == 1:
        return pp - stage
    return 2 * (pp - stage - 1) + (v - 1) * pp + 1


@lru_cache(maxsize=4096)
def stage_values(num_layers: int, pp: int, v: int, split: str) -> dict[str, int]:
    """The split condensed for the closed-form costs (see the module doc); middle-stage values
    are 0 when there is no middle stage (pp <= 2)."""
    per_stage = [sum(c) for c in stage_layer_counts(num_layers, pp, v, split)]
    out = {
        "first_layers": per_stage[0],
        "last_layers": per_stage[-1],
        "mid_layers": 0,
        "mid_stage": 0,
        "act_layers": 0,
        "act_stage": 0,
    }
    middle = range(1, pp - 1)
    if len(middle):
        mid = max(middle, key=lambda i: (per_stage[i], -i))
        act = max(middle, key=lambda i: (per_stage[i] * _inflight_chunks(i, pp, v), -i))
        out.update(
            mid_layers=per_stage[mid],
            mid_stage=mid,
            act_layers=per_stage[act],
            act_stage=act,
        )
    return out
