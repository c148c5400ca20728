"""Search spaces over parallel plans and their vectorized enumeration.

What lives here: :class:`SearchSpace` (the values each plan axis may take; ``"auto"`` means every
divisor of the GPU count) and :func:`enumerate_plans`, which builds the cartesian product as
numpy arrays, applies the same divisibility rules as :func:`stage_dse.spec.validate_plan` as
vectorized masks, and returns the valid plans as a plan table together with how many were
rejected by which rule (the first rule a plan breaks). No per-plan Python loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from stage_dse.cost.bind import bind_hardware, model_values
from stage_dse.cost.table import model_columns
from stage_dse.errors import ConfigError
from stage_dse.spec import (
    AttentionKernel,
    ClusterSpec,
    HardwareSpec,
    MeshAxis,
    ModelSpec,
    Recompute,
    TrainingSpec,
)

__all__ = ["Enumeration", "SearchSpace", "divisors", "enumerate_plans"]

Axis = Sequence[int] | str


def _const(value: object, rows: int):
    """A constant column: categorical for text (cheap to build, dictionary-encoded on disk)."""
    if isinstance(value, str):
        return pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), categories=[value])
    return np.full(rows, value)


def _moe_rules(model, tp, ep, etp, sp_, dp) -> list[tuple[str, np.ndarray]]:
    """The expert-parallel rules of ``validate_plan``, vectorized."""
    if not model.is_moe:
        return [
            ("ep > 1 needs a mixture-of-experts model", ep > 1),
            ("expert_tensor_parallel needs a mixture-of-experts model", etp),
        ]
    E, fe = model.num_experts, model.moe_ffn_hidden_size
    return [
        ("expert_tensor_parallel needs tp > 1", etp & (tp == 1)),
        (f"ep does not divide experts({E})", E % ep != 0),
        ("ep does not divide dp", np.where(ep > 0, dp % np.maximum(ep, 1), 1) != 0),
        ("tp > 1 with experts needs sequence parallelism", (tp > 1) & ~sp_),
        (
            f"tp does not divide moe_ffn_hidden_size({fe}) (expert tensor parallel)",
            etp & (fe % tp != 0),
        ),
    ]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Values each plan axis may take. Degrees accept ``"auto"``: every divisor of the GPU count."""

    tp: Axis = "auto"
    pp: Axis = "auto"
    cp: Axis = (1,)
    ep: Axis = (1,)
    """Expert-parallel sizes (MoE models); ``"auto"``: every divisor of the expert count."""
    expert_tensor_parallel: Sequence[bool] = (False,)
    micro_batch_size: Sequence[int] = (1, 2, 4, 8)
    zero_stage: Sequence[int] = (0, 1, 2, 3)
    recompute: Sequence[str] = ("none", "selective", "full")
    sequence_parallel: Sequence[bool] = (False, True)
    attention: Sequence[str] = ("flash",)
    virtual_stages: Sequence[int] = (1,)
    """1 means the 1F1B schedule; v > 1 the interleaved schedule with v chunks."""
    rank_order: Sequence[str] = ("tp-cp-ep-dp-pp",)
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if isinstance(v, str):
                if v != "auto":
                    raise ConfigError(f"plan.{name}={v!r}: give a list of integers or 'auto'")
            else:
                _positive_list(name, v)
        for name in ("micro_batch_size", "virtual_stages"):
            _positive_list(name, getattr(self, name))
        for z in self.zero_stage:
            if z not in (0, 1, 2, 3):
                raise ConfigError(f"plan.zero_stage={z!r} is not one of: 0, 1, 2, 3")
        for r in self.recompute:
            if r not in {m.value for m in Recompute}:
                raise ConfigError(f"plan.recompute={r!r} is not one of: none, selective, full")
        for a in self.attention:
            if a not in {m.value for m in AttentionKernel}:
                raise ConfigError(f"plan.attention={a!r} is not one of: materialized, flash")
        for order in self.rank_order:
            parts = str(order).split("-")
            if sorted(parts) != sorted(m.value for m in MeshAxis):
                raise ConfigError(
                    f"plan.rank_order={order} must name each of tp, cp, ep, dp, pp exactly once"
                )

    def degrees(self, name: str, num_gpus: int) -> list[int]:
        v = getattr(self, name)
        return divisors(num_gpus) if isinstance(v, str) else sorted(set(v))


def _positive_list(name: str, values: Sequence[int]) -> None:
    if not values:
        raise ConfigError(f"plan.{name} must list at least one value")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
            raise ConfigError(f"plan.{name} values must be integers > 0, got {x!r}")


@dataclass
class Enumeration:
    table: pd.DataFrame
    """Valid plans as a plan table (see :mod:`stage_dse.cost.table`)."""
    candidates: int
    rejected: Counter = field(default_factory=Counter)
    """Rule (as text) -> plans rejected by it first."""
    valid: int = 0
    """Valid plans of the whole enumeration (``table`` may hold a slice of them)."""


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

    ``rows`` keeps a slice of the valid plans (in their deterministic order), so batches of one
    enumeration can be rebuilt anywhere; ``count_only`` skips building the table.
    """
    n = cluster.num_gpus if num_gpus is None else num_gpus
    if n > cluster.num_gpus:
        raise ConfigError(f"num_gpus({n}) > cluster.num_gpus({cluster.num_gpus})")
    tps, pps, cps = (space.degrees(k, n) for k in ("tp", "pp", "cp"))
    # degree triples first: most of the cartesian product fails tp*pp*cp | n
    triples = [(t, p, c) for t in tps for p in pps for c in cps if n % (t * p * c) == 0]
    # structural axes outermost, so that each compiled family is one contiguous block of rows
    eps = divisors(model.num_experts) if space.ep == "auto" else sorted(set(space.ep))
    if not model.is_moe:
        eps = [e for e in eps if e == 1] or eps
    outer: dict[str, list] = {
        "expert_tensor_parallel": list(dict.fromkeys(space.expert_tensor_parallel)),
        "ep": eps,
        "zero_stage": sorted(set(space.zero_stage)),
        "recompute": list(dict.fromkeys(space.recompute)),
        "sequence_parallel": list(dict.fromkeys(space.sequence_parallel)),
        "attention": list(dict.fromkeys(space.attention)),
        "rank_order": list(dict.fromkeys(space.rank_order)),
        "virtual_stages": sorted(set(space.virtual_stages)),
    }
    inner: dict[str, list] = {"micro_batch": sorted(set(space.micro_batch_size))}
    rest = int(np.prod([len(x) for x in (*outer.values(), *inner.values())]))
    total = len(tps) * len(pps) * len(cps) * rest
    pre_rejected = (len(tps) * len(pps) * len(cps) - len(triples)) * rest
    names = [*outer, "triple", *inner]
    sizes = [len(outer[k]) for k in outer] + [len(triples)] + [len(inner[k]) for k in inner]
    idx = np.indices(sizes).reshape(len(sizes), -1)
    tri = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
    t_i = names.index("triple")
    cols: dict[str, np.ndarray] = {
        "tp": tri[idx[t_i], 0],
        "pp": tri[idx[t_i], 1],
        "cp": tri[idx[t_i], 2],
    }
    for i, name in enumerate(names):
        if name == "triple":
            continue
        values = outer.get(name, inner.get(name))
        arr = np.asarray(values, dtype=object if isinstance(values[0], str) else None)
        cols[name] = arr[idx[i]]
    tp = cols["tp"]
    pp = cols["pp"]
    cp = cols["cp"]
    mb = cols["micro_batch"].astype(np.int64)
    v = cols["virtual_stages"].astype(np.int64)
    sp_ = cols["sequence_parallel"].astype(bool)
    ep = cols["ep"].astype(np.int64)
    etp = cols["expert_tensor_parallel"].astype(bool)
    mp = tp * pp * cp
    dp = np.where(n % mp == 0, n // np.maximum(mp, 1), 0)
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
        (f"pp*virtual_stages > layers({L})", pp * v > L),
        (f"cp does not divide seq({s})", s % cp != 0),
        (f"tp*cp does not divide seq({s}) under sequence parallelism", sp_ & (s % (tp * cp) != 0)),
        (f"dp*micro_batch does not divide global_batch({B})", B % per_step != 0),
        *_moe_rules(model, tp, ep, etp, sp_, dp),
        ("num_microbatches not divisible by pp (interleaved)", (v > 1) & (m % pp != 0)),
    ]
    ok = np.ones(idx.shape[1], dtype=bool)
    rejected: Counter = Counter()
    if pre_rejected:
        rejected[f"tp*pp*cp does not divide num_gpus({n})"] = pre_rejected
    for text, bad in rules:
        hit = ok & bad
        count = int(hit.sum())
        if count:
            rejected[text] += count
        ok &= ~bad
    sel = np.nonzero(ok)[0]
    valid = len(sel)
    if count_only:
        return Enumeration(table=pd.DataFrame(), candidates=total, rejected=rejected, valid=valid)
    if rows is not None:
        sel = sel[rows]
    rows = len(sel)
    consts = {
        **model_columns(model, training),
        "hardware": hardware.name,
        "cluster": cluster.name,
        **model_values(model, training),
        **bind_hardware(hardware, cluster),
        "overlap_grad_reduce": space.overlap_grad_reduce,
        "overlap_param_gather": space.overlap_param_gather,
        "tp_comm_overlap": space.tp_comm_overlap,
    }
    data: dict[str, object] = {k: _const(val, rows) for k, val in consts.items()}
    data.update(
        {
            "num_gpus": np.full(rows, n),
            "dp": dp[sel],
            "tp": tp[sel],
            "pp": pp[sel],
            "cp": cp[sel],
            "micro_batch": mb[sel],
            "virtual_stages": v[sel],
            "ep": ep[sel],
            "expert_tensor_parallel": etp[sel],
            "sequence_parallel": sp_[sel],
            "zero_stage": cols["zero_stage"][sel].astype(np.int64),
            "recompute": pd.Categorical(cols["recompute"][sel], categories=outer["recompute"]),
            "attention": pd.Categorical(cols["attention"][sel], categories=outer["attention"]),
            "schedule": pd.Categorical.from_codes(
                (v[sel] > 1).astype(np.int8), categories=["1f1b", "interleaved"]
            ),
            "rank_order": pd.Categorical(cols["rank_order"][sel], categories=outer["rank_order"]),
        }
    )
    return Enumeration(table=pd.DataFrame(data), candidates=total, rejected=rejected, valid=valid)
