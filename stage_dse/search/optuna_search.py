"""The space an Optuna search samples: valid plans only, named so that samplers can learn.

What lives here: :class:`OptunaSpace`, built from a sweep's model, training step, plan space,
GPU counts, hardware and co-design axes. Each GPU count's candidates are the grid of
:func:`stage_dse.search.space.plan_grid` with its validity mask (the rules the enumerated
sweep applies, nothing re-implemented), and a trial walks that mask one axis at a time: the
GPU count and co-design axes first, then tp, pp, cp, micro-batch, ZeRO stage, recompute,
sequence parallelism, ep, expert tensor parallelism, virtual stages, layer split, attention,
rank order. Each axis offers only the values that still have at least one valid plan beside
the choices made so far, so every trial is a valid plan of the enumeration (same columns,
same config hash as the grid sweep's row). An axis left with one value is not a parameter.

Optuna's categorical parameters keep their choices for the whole study, so a parameter is named
by the values it offers: ``tp[1,2,4,8]``, or ``tp[1,2,4]`` where the GPU count or earlier
choices leave those three. Trials that met the same restriction share one parameter and its
statistics, and a resumed study whose space was edited (more GPU counts, another axis value)
gains parameters instead of failing on changed choices. What does not live here: the study,
evaluation, results (the driver, :mod:`stage_dse.runner.optuna_driver`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from stage_dse.cost.bind import bind_hardware
from stage_dse.errors import ConfigError
from stage_dse.search.space import PlanGrid, plan_grid
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec, TrainingSpec
from stage_dse.spec.sweep import OBJECTIVES, SearchSpace
from stage_dse.spec.training import check_gemm_dtype

__all__ = ["OBJECTIVES", "PLAN_AXES", "Choice", "OptunaSpace"]

GIB = 2.0**30
PLAN_AXES = (
    "framework",
    "tp",
    "pp",
    "cp",
    "micro_batch",
    "zero_stage",
    "shard_group",
    "recompute",
    "sequence_parallel",
    "ep",
    "expert_tensor_parallel",
    "ep_over_tp",
    "virtual_stages",
    "schedule",
    "stage_layers",
    "attention",
    "rank_order",
    "offload_layers",
    "cuda_graphs",
)
"""Plan axes in the order a trial chooses them (most decisive for step time first)."""
TRIPLE = {"tp": 0, "pp": 1, "cp": 2}

Pick = Callable[[str, list], object]
"""``pick(name, values)`` returns one of ``values``: a trial's ``suggest_categorical``."""


@dataclass(frozen=True, order=True)
class Choice:
    """One configuration of the space: GPU count, hardware, co-design values and the flat
    position of its plan in that GPU count's grid."""

    num_gpus: int
    hardware: str
    hbm_gib: float | None
    inter_gbit_s: float | None
    position: int


def _name(axis: str, values: list) -> str:
    """A parameter's name: the axis and the values offered (``tp[1,2,4]``)."""
    return f"{axis}[{','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in values)}]"


class OptunaSpace:
    """Valid configurations over GPU counts x hardware x co-design axes x plans."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingSpec,
        space: SearchSpace,
        gpus: list[int],
        hardware: dict[str, HardwareSpec],
        cluster: ClusterSpec,
        hbm_gib: tuple[float, ...] = (),
        inter_gbit_s: tuple[float, ...] = (),
    ) -> None:
        for hw in hardware.values():
            try:
                check_gemm_dtype(training, hw)
            except ConfigError as exc:
                raise ConfigError(f"search.hardware: {hw.name}: {exc}") from None
        self.cluster = cluster
        self.hardware = hardware
        grids = {g: plan_grid(model, training, space, g) for g in sorted(set(gpus))}
        self.grids: dict[int, PlanGrid] = {g: x for g, x in grids.items() if x.valid}
        self.without_plans = [g for g, x in grids.items() if not x.valid]
        if not self.grids:
            rejected: Counter = Counter()
            for x in grids.values():
                rejected.update(x.rejected)
            rules = "; ".join(f"{r} ({n:,})" for r, n in rejected.most_common(3))
            raise ConfigError(
                f"no valid plan for any of num_gpus={sorted(grids)}, rejected by: {rules}; "
                "widen the plan axes or change the model, GPU counts or batch"
            )
        self.codesign: dict[str, list] = {"hardware": sorted(hardware)}
        if hbm_gib:
            self.codesign["hbm_gib"] = sorted({float(x) for x in hbm_gib})
        if inter_gbit_s:
            self.codesign["inter_gbit_s"] = sorted({float(x) for x in inter_gbit_s})
        self.variants = int(np.prod([len(v) for v in self.codesign.values()]))
        self.total = sum(x.valid for x in self.grids.values()) * self.variants
        """Distinct configurations of the space."""
        self.full = {a: self._axis_values(a) for a in PLAN_AXES}
        self._offers: dict[tuple, list] = {}

    def _axis_values(self, axis: str) -> list:
        if axis in TRIPLE:
            out = {int(v) for x in self.grids.values() for v in x.triples[:, TRIPLE[axis]]}
            return sorted(out)
        return list(dict.fromkeys(v for x in self.grids.values() for v in x.axes[axis]))

    @property
    def axes(self) -> list[str]:
        """What a trial chooses among (plan axes with more than one value in the space)."""
        names = ["num_gpus"] if len(self.grids) > 1 else []
        names += [k for k, v in self.codesign.items() if len(v) > 1]
        return names + [a for a in PLAN_AXES if len(self.full[a]) > 1]

    # -- sampling ---------------------------------------------------------------------------

    def suggest(self, trial) -> Choice:
        """A valid configuration chosen through ``trial.suggest_categorical``."""
        return self.walk(trial.suggest_categorical)

    def walk(self, pick: Pick) -> Choice:
        """Choose the GPU count, co-design values and plan axes in order, offering each axis
        only the values that keep at least one valid plan."""
        gpus = sorted(self.grids)
        g = int(self._pick(pick, "num_gpus", gpus))
        design = {k: self._pick(pick, k, v) for k, v in self.codesign.items()}
        grid = self.grids[g]
        sub = grid.ok
        triples = np.arange(len(grid.triples))
        prefix: tuple = (g,)
        fixed = [0] * sub.ndim
        for axis in PLAN_AXES:
            dim = grid.dim("triple" if axis in TRIPLE else axis)
            key = (*prefix, axis)
            offered = self._offers.get(key)
            others = tuple(d for d in range(sub.ndim) if d != dim)
            alive = sub.any(axis=others) if offered is None else None
            if axis in TRIPLE:
                column = grid.triples[triples, TRIPLE[axis]]
                if offered is None:
                    offered = sorted({int(v) for v in column[alive]})
                value = self._pick(pick, axis, offered)
                keep = np.flatnonzero(column == value)
                sub = sub.take(keep, axis=dim)
                triples = triples[keep]
                if axis == "cp":
                    fixed[dim] = int(triples[0])
            else:
                values = grid.axes[axis]
                if offered is None:
                    offered = [values[i] for i in np.flatnonzero(alive)]
                value = self._pick(pick, axis, offered)
                i = values.index(value)
                sub = sub[(slice(None),) * dim + (slice(i, i + 1),)]
                fixed[dim] = i
            self._offers[key] = offered
            prefix = (*prefix, value)
        assert sub.shape == (1,) * sub.ndim and sub.item(), "a trial left the valid plans"
        return self._choice(g, design, int(np.ravel_multi_index(tuple(fixed), grid.shape)))

    def _pick(self, pick: Pick, axis: str, offered: list):
        if len(offered) == 1:
            return offered[0]
        return pick(_name(axis, offered), offered)

    def params(self, choice: Choice) -> dict[str, object]:
        """The trial parameters that lead :meth:`walk` to ``choice`` (for ``enqueue_trial``)."""
        grid = self.grids[choice.num_gpus]
        at = dict(zip(grid.axes, np.unravel_index(choice.position, grid.shape)))
        target = {a: grid.axes[a][at[a]] for a in grid.axes if a != "triple"}
        t = grid.triples[at["triple"]]
        target.update(tp=int(t[0]), pp=int(t[1]), cp=int(t[2]), num_gpus=choice.num_gpus)
        target.update(
            hardware=choice.hardware, hbm_gib=choice.hbm_gib, inter_gbit_s=choice.inter_gbit_s
        )
        out: dict[str, object] = {}

        def pick(name: str, values: list):
            axis = name.split("[", 1)[0]
            out[name] = target[axis]
            return target[axis]

        assert self.walk(pick) == choice
        return out

    def neighbors(self, choice: Choice) -> list[Choice]:
        """The valid configurations one step from ``choice``: one plan axis set to another
        value (tp, pp or cp alone, dp following), two of tp, pp, cp traded at the same dp, or
        one co-design axis set to another value; the rest kept."""
        grid = self.grids[choice.num_gpus]
        at = list(np.unravel_index(choice.position, grid.shape))
        out = []
        for d in range(len(at)):
            if d == grid.dim("triple"):
                here = grid.triples[at[d]]
                differ = (grid.triples != here).sum(axis=1)
                same_dp = grid.triples.prod(axis=1) == here.prod()
                near = np.flatnonzero((differ == 1) | ((differ == 2) & same_dp))
            else:
                near = [i for i in range(grid.shape[d]) if i != at[d]]
            for i in near:
                cell = (*at[:d], int(i), *at[d + 1 :])
                if grid.ok[cell]:
                    position = int(np.ravel_multi_index(cell, grid.shape))
                    out.append(replace(choice, position=position))
        for k, values in self.codesign.items():
            here = getattr(choice, k)
            out.extend(replace(choice, **{k: v}) for v in values if v != here)
        return out

    def random(self, rng: np.random.Generator, n: int) -> list[Choice]:
        """``n`` configurations drawn uniformly from the valid ones (with replacement)."""
        gpus = sorted(self.grids)
        weights = np.array([self.grids[g].valid for g in gpus], dtype=float)
        drawn = rng.choice(len(gpus), size=n, p=weights / weights.sum())
        out = []
        for gi in drawn:
            grid = self.grids[gpus[gi]]
            pos = grid.valid_positions[rng.integers(grid.valid)]
            design = {k: v[rng.integers(len(v))] for k, v in self.codesign.items()}
            out.append(self._choice(gpus[gi], design, int(pos)))
        return out

    def every(self) -> list[Choice]:
        """Every configuration of the space (for small spaces)."""
        out = []
        for g, grid in self.grids.items():
            for design in self._designs():
                out.extend(self._choice(g, design, int(p)) for p in grid.valid_positions)
        return out

    def _designs(self) -> list[dict]:
        designs: list[dict] = [{}]
        for k, values in self.codesign.items():
            designs = [{**d, k: v} for d in designs for v in values]
        return designs

    @staticmethod
    def _choice(g: int, design: dict, position: int) -> Choice:
        return Choice(
            num_gpus=g,
            hardware=str(design["hardware"]),
            hbm_gib=design.get("hbm_gib"),
            inter_gbit_s=design.get("inter_gbit_s"),
            position=position,
        )

    # -- rows -------------------------------------------------------------------------------

    def variant(self, choice: Choice) -> tuple[HardwareSpec, ClusterSpec]:
        """The hardware and cluster of a configuration, co-design values applied."""
        hw = self.hardware[choice.hardware]
        if choice.hbm_gib is not None:
            gib = choice.hbm_gib
            hw = hw.replace(hbm_bytes=gib * GIB, name=f"{hw.name}@{gib:g}GiB")
        cluster = self.cluster.replace(num_gpus=choice.num_gpus)
        if choice.inter_gbit_s is not None:
            cluster = cluster.replace(inter_bandwidth_bytes_per_s=choice.inter_gbit_s * 1e9 / 8)
        return hw, cluster

    def table(self, choices: list[Choice]) -> pd.DataFrame:
        """The plan table of ``choices``, one row each, in their order (the grid's columns,
        as the enumerated sweep builds them)."""
        if not choices:
            return pd.DataFrame()
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(choices):
            groups.setdefault(c.num_gpus, []).append(i)
        parts, order = [], []
        for g, idx in groups.items():
            # one frame per GPU count; the hardware columns of each co-design variant after
            sel = np.array([choices[i].position for i in idx], dtype=np.int64)
            hw, cluster = self.variant(choices[idx[0]])
            frame = self.grids[g].columns(sel, hw, cluster).frame()
            frame = frame.astype({k: object for k in frame if frame[k].dtype == "category"})
            keys = [(choices[i].hardware, choices[i].hbm_gib, choices[i].inter_gbit_s) for i in idx]
            bound = {}
            for key, i in zip(keys, idx):
                if key not in bound:
                    hw, cluster = self.variant(choices[i])
                    bound[key] = {"hardware": hw.name, **bind_hardware(hw, cluster)}
            if len(bound) > 1:
                names = list(bound[keys[0]])
                per_row = pd.DataFrame(
                    {name: [bound[k][name] for k in keys] for name in names}, index=frame.index
                )
                frame = pd.concat([frame.drop(columns=names), per_row], axis=1)[frame.columns]
            parts.append(frame)
            order.extend(idx)
        table = pd.concat(parts, ignore_index=True)
        table = table.iloc[np.argsort(np.asarray(order), kind="stable")]
        return table.reset_index(drop=True).copy()  # one block per dtype
