"""Search spaces over parallel plans and their vectorized enumeration.

What lives here: :func:`enumerate_plans`, which takes a
:class:`~stage_dse.spec.sweep.SearchSpace` (the values each plan axis may take; ``"auto"`` means
every divisor of the GPU count), lays the cartesian product out as a numpy grid, applies the
same divisibility rules as :func:`stage_dse.spec.validate_plan` as broadcast masks, and returns
the valid plans as columns (:class:`stage_dse.cost.table.PlanColumns`, or a plan table) together
with how many were rejected by which rule (the first rule a plan breaks). No per-plan Python
loop.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from stage_dse.cost.bind import bind_hardware, cuda_graph_values, model_values, recompute_share
from stage_dse.cost.labels import Labels
from stage_dse.cost.table import PlanColumns, model_columns
from stage_dse.errors import ConfigError
from stage_dse.spec import (
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    TrainingSpec,
)
from stage_dse.spec.framework import PLAN_FLAGS
from stage_dse.spec.plan import check_recompute_modules, parse_cuda_graphs, parse_recompute
from stage_dse.spec.stages import STAGE_SYMBOLS, stage_values
from stage_dse.spec.sweep import SearchSpace, divisors

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Enumeration", "PlanGrid", "SearchSpace", "divisors", "enumerate_plans", "plan_grid"]

Axis = Sequence[int] | str


def _moe_rules(model, tp, cp, ep, etp, fold, sp_, dp) -> list[tuple[str, np.ndarray]]:
    """The expert-parallel rules of ``validate_plan``, vectorized (``fold``: ep_over_tp)."""
    if not model.is_moe:
        return [
            ("ep > 1 needs a mixture-of-experts model", ep > 1),
            ("expert_tensor_parallel needs a mixture-of-experts model", etp),
            ("ep_over_tp needs a mixture-of-experts model", fold),
        ]
    E, fe = model.num_experts, model.moe_ffn_hidden_size
    ep_data, cp_in = _ep_data(tp, cp, ep, fold)
    return [
        ("expert_tensor_parallel needs tp > 1", etp & (tp == 1)),
        ("ep_over_tp needs tp > 1", fold & (tp == 1)),
        ("ep_over_tp needs expert_tensor_parallel=false", fold & etp),
        (f"ep does not divide experts({E})", E % ep != 0),
        ("ep is not a multiple of tp (ep_over_tp)", fold & (ep % np.maximum(tp, 1) != 0)),
        (
            "ep is not a multiple of cp (expert groups hold whole context-parallel groups)",
            (cp_in > 1) & ((ep // np.where(fold, np.maximum(tp, 1), 1)) % cp_in != 0),
        ),
        (
            "ep does not divide dp (ep/tp with ep_over_tp, /cp with cp > 1)",
            np.where(ep_data > 0, dp % np.maximum(ep_data, 1), 1) != 0,
        ),
        ("tp > 1 with experts needs sequence parallelism", (tp > 1) & ~sp_),
        (
            f"tp does not divide moe_ffn_hidden_size({fe}) (expert tensor parallel)",
            etp & (fe % tp != 0),
        ),
    ]


def _ep_data(tp, cp, ep, fold) -> tuple[np.ndarray, np.ndarray]:
    """``ParallelPlan.ep_data`` vectorized, and the context-parallel ranks inside each expert
    group (``cp`` where ``ep > 1``, else 1)."""
    cp_in = np.where(ep > 1, cp, 1)
    return np.where(fold, ep // np.maximum(tp, 1), ep) // np.maximum(cp_in, 1), cp_in


@dataclass
class Enumeration:
    columns: PlanColumns | None
    """Valid plans as columns (None when only counted)."""
    candidates: int
    rejected: Counter = field(default_factory=Counter)
    """Rule (as text) -> plans rejected by it first."""
    valid: int = 0
    """Valid plans of the whole enumeration (``columns`` may hold a slice of them)."""

    @cached_property
    def table(self) -> pd.DataFrame:
        """Valid plans as a plan table (see :mod:`stage_dse.cost.table`)."""
        import pandas as pd

        return pd.DataFrame() if self.columns is None else self.columns.frame()


@dataclass
class PlanGrid:
    """The candidate plans of one model, training step, space and GPU count as a grid (one
    dimension per plan axis; the (tp, pp, cp) triples that divide the GPU count share one
    dimension) and its validity mask ``ok``, built from the divisibility rules of
    :func:`stage_dse.spec.validate_plan` as broadcast masks. Flat positions into the grid name
    plans: :meth:`columns` turns any of them into plan columns, so the enumeration and a
    sampler that picks cells of ``ok`` produce the same rows."""

    model: ModelSpec
    training: TrainingSpec
    space: SearchSpace
    num_gpus: int
    axes: dict[str, list]
    """Axis name -> its values, in grid-dimension order (``triple``: (tp, pp, cp) tuples)."""
    triples: np.ndarray
    """``(len(axes["triple"]), 3)`` int64: tp, pp, cp of each triple."""
    split_values: dict[str, np.ndarray]
    """Stage symbols of every (virtual_stages, triple, stage_layers) cell."""
    ok: np.ndarray
    """Validity of every candidate, shaped like the grid."""
    candidates: int
    rejected: Counter = field(default_factory=Counter)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ok.shape

    def dim(self, name: str) -> int:
        return list(self.axes).index(name)

    @cached_property
    def valid(self) -> int:
        return int(np.count_nonzero(self.ok))

    @cached_property
    def valid_positions(self) -> np.ndarray:
        """Flat positions of the valid plans, in enumeration order."""
        return np.flatnonzero(self.ok)

    def columns(self, sel: np.ndarray, hardware: HardwareSpec, cluster: ClusterSpec) -> PlanColumns:
        """Plan columns of the grid cells at flat positions ``sel`` (valid ones: callers pick
        them from ``ok``), bound to ``hardware`` and ``cluster``."""
        model, training, axes, tri = (
            self.model,
            self.training,
            self.axes,
            self.triples,
        )
        at = dict(zip(axes, np.unravel_index(np.asarray(sel, dtype=np.int64), self.shape)))

        def values(name: str, dtype=np.int64) -> np.ndarray:
            return np.asarray(axes[name], dtype=dtype)[at[name]]

        def labels(name: str) -> Labels:
            return Labels(at[name], axes[name])

        t_tp, t_pp, t_cp = (tri[at["triple"], j] for j in range(3))
        v_sel = values("virtual_stages")
        dp = self.num_gpus // (t_tp * t_pp * t_cp)
        group = values("shard_group")  # 0: one sharding group of all dp ranks
        ep_sel = values("ep")
        ep_data, cp_in = _ep_data(t_tp, t_cp, ep_sel, values("ep_over_tp", bool))
        columns: dict[str, object] = {
            **model_columns(model, training),
            "hardware": hardware.name,
            "cluster": cluster.name,
            **model_values(model, training),
            **bind_hardware(hardware, cluster),
            **self.framework_columns(at["framework"]),
            "num_gpus": self.num_gpus,
            "dp": dp,
            "dp_replicate": np.where(group > 0, dp // np.maximum(group, 1), 1),
            "tp": t_tp,
            "pp": t_pp,
            "cp": t_cp,
            "micro_batch": values("micro_batch"),
            "virtual_stages": v_sel,
            "offload_layers": values("offload_layers"),
            "cuda_graphs": labels("cuda_graphs"),
            **{
                name: np.asarray(flags, dtype=np.int64)[at["cuda_graphs"]]
                for name, flags in self.graph_values.items()
            },
            "recompute_share": recompute_share(
                model.num_layers,
                t_pp,
                v_sel,
                np.array([parse_recompute(r).layers for r in axes["recompute"]])[at["recompute"]],
            ),
            "stage_layers": labels("stage_layers"),
            **{
                name: x[at["virtual_stages"], at["triple"], at["stage_layers"]]
                for name, x in self.split_values.items()
            },
            "ep": ep_sel,
            "ep_data": ep_data,
            "expert_tensor_parallel": values("expert_tensor_parallel", bool),
            "ep_over_tp": values("ep_over_tp", bool),
            "ep_over_cp": cp_in > 1,  # ParallelPlan.ep_over_cp
            "sequence_parallel": values("sequence_parallel", bool),
            "zero_stage": values("zero_stage"),
            "recompute": labels("recompute"),
            "attention": labels("attention"),
            "schedule": Labels(
                np.where(v_sel > 1, 0, at["schedule"] + 1).astype(np.int8),
                ["interleaved", *axes["schedule"]],
            ),
            "rank_order": labels("rank_order"),
        }
        return PlanColumns(len(at["triple"]), columns)

    @cached_property
    def graph_values(self) -> dict[str, list[int]]:
        """The 0/1 CUDA-graph symbols of each ``cuda_graphs`` choice of the grid."""
        per = [cuda_graph_values(parse_cuda_graphs(g)) for g in self.axes["cuda_graphs"]]
        return {name: [v[name] for v in per] for name in per[0]}

    def framework_columns(self, at: np.ndarray) -> dict[str, object]:
        """The framework of each selected cell (grid indices ``at``): its name, plan flags and
        gradient precision, constants when the space holds one framework."""
        frameworks = self.space.frameworks
        table = {
            **{flag: [getattr(fw, flag) for fw in frameworks] for flag in PLAN_FLAGS},
            "grad_bytes": [fw.grads(self.training.grads_dtype).bytes for fw in frameworks],
        }
        if len(frameworks) == 1:
            return {"framework": frameworks[0].name, **{k: v[0] for k, v in table.items()}}
        out: dict[str, object] = {"framework": Labels(at, [f.name for f in frameworks])}
        for name, values in table.items():
            column = np.asarray(values)[at]
            out[name] = column if len(set(values)) > 1 else values[0]
        return out


def plan_grid(
    model: ModelSpec, training: TrainingSpec, space: SearchSpace, num_gpus: int
) -> PlanGrid:
    """The candidate grid of ``space`` on exactly ``num_gpus`` GPUs and which of its plans are
    valid, with how many were rejected by which rule (the first rule a plan breaks).

    Each rule is evaluated on the few dimensions it reads and broadcast over the rest, so no
    candidate-sized column is built. The structural axes are the outer dimensions, so each
    compiled family is a contiguous run of valid plans in flat order.
    """
    n = num_gpus
    tps, pps, cps = (space.degrees(k, n) for k in ("tp", "pp", "cp"))
    # degree triples first: most of the cartesian product fails tp*pp*cp | n
    triples = [(t, p, c) for t in tps for p in pps for c in cps if n % (t * p * c) == 0]
    eps = divisors(model.num_experts) if space.ep == "auto" else sorted(set(space.ep))
    if not model.is_moe:
        eps = [e for e in eps if e == 1] or eps
    axes: dict[str, list] = {
        "framework": [fw.name for fw in space.frameworks],
        "expert_tensor_parallel": list(dict.fromkeys(space.expert_tensor_parallel)),
        "ep_over_tp": list(dict.fromkeys(space.ep_over_tp)),
        "ep": eps,
        "zero_stage": sorted(set(space.zero_stage)),
        "shard_group": sorted(set(space.shard_group)),
        "recompute": list(dict.fromkeys(space.recompute)),
        "sequence_parallel": list(dict.fromkeys(space.sequence_parallel)),
        "attention": list(dict.fromkeys(space.attention)),
        "rank_order": list(dict.fromkeys(space.rank_order)),
        "schedule": list(dict.fromkeys(space.schedule)),
        "virtual_stages": sorted(set(space.virtual_stages)),
        "triple": triples,
        "stage_layers": list(space.stage_layers),
        "micro_batch": sorted(set(space.micro_batch_size)),
        "offload_layers": sorted(set(space.offload_layers)),
        "cuda_graphs": list(space.cuda_graphs),
    }
    shape = tuple(len(v) for v in axes.values())
    per_triple = int(np.prod([len(v) for k, v in axes.items() if k != "triple"]))
    total = len(tps) * len(pps) * len(cps) * per_triple
    pre_rejected = (len(tps) * len(pps) * len(cps) - len(triples)) * per_triple

    def grid(name: str, values=None) -> np.ndarray:
        """An axis's values shaped to broadcast along its own grid dimension."""
        i = list(axes).index(name)
        dims = [1] * len(shape)
        dims[i] = shape[i]
        return np.asarray(axes[name] if values is None else values).reshape(dims)

    tri = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
    # the layer split of every (virtual_stages, triple, stage_layers): adjacent grid dimensions
    vs, splits = axes["virtual_stages"], axes["stage_layers"]
    split_shape = (len(vs), len(triples), len(splits))
    split_ok = np.zeros(split_shape, dtype=bool)
    split_values = {k: np.zeros(split_shape, dtype=np.int64) for k in STAGE_SYMBOLS}
    for (i, v_), (j, (_, p_, _)), (k, split) in itertools.product(
        enumerate(vs), enumerate(triples), enumerate(splits)
    ):
        try:
            values_ = stage_values(model.num_layers, p_, v_, split)
        except ConfigError:
            continue
        split_ok[i, j, k] = True
        for name, x in values_.items():
            split_values[name][i, j, k] = x
    first_split_dim = list(axes).index("virtual_stages")
    assert list(axes)[first_split_dim : first_split_dim + 3] == [
        "virtual_stages",
        "triple",
        "stage_layers",
    ]
    split_dims = [1] * len(shape)
    split_dims[first_split_dim : first_split_dim + 3] = split_shape
    tp, pp, cp = (grid("triple", tri[:, k]) for k in range(3))
    mb = grid("micro_batch").astype(np.int64)
    offload = grid("offload_layers").astype(np.int64)
    recompute = grid("recompute", [r != "none" for r in axes["recompute"]]).astype(bool)
    absent_modules = [
        (
            f"recompute={r}: {why}",
            grid("recompute", [x == r for x in axes["recompute"]]).astype(bool),
        )
        for r in axes["recompute"]
        if (why := _absent_module(model, r)) is not None
    ]
    v = grid("virtual_stages").astype(np.int64)
    dual = grid("schedule", [s == "dualpipe" for s in axes["schedule"]]).astype(bool)
    one_chunk = grid("schedule", [s != "1f1b" for s in axes["schedule"]]).astype(bool)
    sp_ = grid("sequence_parallel").astype(bool)
    ep = grid("ep").astype(np.int64)
    etp = grid("expert_tensor_parallel").astype(bool)
    fold = grid("ep_over_tp").astype(bool)
    mp = tp * pp * cp
    dp = np.where(n % mp == 0, n // np.maximum(mp, 1), 0)
    zero = grid("zero_stage").astype(np.int64)
    group = grid("shard_group").astype(np.int64)
    hybrid = group > 0
    per_step = np.maximum(dp * mb, 1)
    m = np.where(
        training.global_batch_size % per_step == 0, training.global_batch_size // per_step, 0
    )
    a, g, f, V = model.num_heads, model.num_kv_heads, model.ffn_hidden_size, model.vocab_size
    L, s, B = model.num_layers, training.seq_len, training.global_batch_size
    rules: list[tuple[str, np.ndarray]] = [
        (f"tp*pp*cp does not divide num_gpus({n})", n % mp != 0),
        ("sequence_parallel needs tp > 1", sp_ & (tp == 1)),
        ("interleaved schedule needs pp > 1", (v > 1) & (pp == 1)),
        (f"tp does not divide heads({a})", a % tp != 0),
        (f"tp does not divide kv_heads({g})", g % tp != 0),
        (f"tp does not divide ffn_hidden_size({f})", f % tp != 0),
        (f"tp does not divide vocab({V})", V % tp != 0),
        (f"pp > layers({L})", pp > L),
        (
            f"stage_layers does not fit pp*virtual_stages (layers={L})",
            ~split_ok.reshape(split_dims),
        ),
        (f"cp does not divide seq({s})", s % cp != 0),
        (f"tp*cp does not divide seq({s}) under sequence parallelism", sp_ & (s % (tp * cp) != 0)),
        (f"dp*micro_batch does not divide global_batch({B})", B % per_step != 0),
        *_moe_rules(model, tp, cp, ep, etp, fold, sp_, dp),
        ("shard_group needs zero_stage >= 1", hybrid & (zero == 0)),
        ("shard_group does not divide dp", hybrid & (dp % np.maximum(group, 1) != 0)),
        ("shard_group is not below dp (0 shards over all dp ranks)", hybrid & (group >= dp)),
        (
            "ep does not fit a sharding group (shard_group)",
            hybrid & (group % np.maximum(_ep_data(tp, cp, ep, fold)[0], 1) != 0),
        ),
        ("num_microbatches not divisible by pp (interleaved)", (v > 1) & (m % pp != 0)),
        ("dualpipe needs an even pp", dual & (pp % 2 != 0)),
        ("zb1p and dualpipe run one chunk per stage (virtual_stages=1)", one_chunk & (v > 1)),
        ("dualpipe needs an even number of micro-batches", dual & (m % 2 != 0)),
        (f"offload_layers must be below layers({L})", offload >= L),
        ("offload_layers needs pp=1", (offload > 0) & (pp > 1)),
        ("offload_layers needs recompute=none", (offload > 0) & recompute),
        *absent_modules,
    ]
    ok = np.ones(shape, dtype=bool)
    rejected: Counter = Counter()
    if pre_rejected:
        rejected[f"tp*pp*cp does not divide num_gpus({n})"] = pre_rejected
    for text, bad in rules:
        if not np.any(bad):
            continue
        hit = ok & bad
        count = int(np.count_nonzero(hit))
        if count:
            rejected[text] += count
            ok &= ~hit
    return PlanGrid(
        model=model,
        training=training,
        space=space,
        num_gpus=n,
        axes=axes,
        triples=tri,
        split_values=split_values,
        ok=ok,
        candidates=total,
        rejected=rejected,
    )


def enumerate_plans(
    model: ModelSpec,
    training: TrainingSpec,
    hardware: HardwareSpec,
    cluster: ClusterSpec,
    space: SearchSpace,
    num_gpus: int | None = None,
    rows: slice | None = None,
    count_only: bool = False,
) -> Enumeration:
    """Every valid plan of ``space`` on exactly ``num_gpus`` GPUs (default: the whole cluster).

    The valid cells of :func:`plan_grid`, in its fixed order (structural axes outermost, so
    each compiled family is a contiguous run of rows). ``rows`` keeps a slice of the valid
    plans, so batches of one enumeration can be rebuilt anywhere; ``count_only`` skips building
    the columns.
    """
    n = cluster.num_gpus if num_gpus is None else num_gpus
    if n > cluster.num_gpus:
        raise ConfigError(f"num_gpus({n}) > cluster.num_gpus({cluster.num_gpus})")
    grid = plan_grid(model, training, space, n)
    if count_only:
        return Enumeration(
            columns=None, candidates=grid.candidates, rejected=grid.rejected, valid=grid.valid
        )
    sel = grid.valid_positions
    if rows is not None:
        sel = sel[rows]
    return Enumeration(
        columns=grid.columns(sel, hardware, cluster),
        candidates=grid.candidates,
        rejected=grid.rejected,
        valid=grid.valid,
    )


def _absent_module(model: ModelSpec, label: str) -> str | None:
    """The message if a recompute label names a module the model lacks, else None."""
    try:
        check_recompute_modules(model, parse_recompute(label).modules)
    except ConfigError as exc:
        return str(exc)
    return None
