"""Plain configuration (no ``DictConfig``) to the specs of a training sweep: the plan search
space with its frameworks, the training step's gradient precision, the model-level checks of
explicit degrees, and the GPU counts of a budget. :mod:`stage_dse.config.schema` hands these
the composed configuration as plain containers."""

from __future__ import annotations

import dataclasses
from typing import Any

from stage_dse.config.presets import framework_from_dict, load_framework
from stage_dse.errors import ConfigError
from stage_dse.spec import ModelSpec, SearchSpace, TrainingSpec
from stage_dse.spec.framework import GRAD_DTYPES, PLAN_FLAGS

__all__ = [
    "budget_gpu_counts",
    "check_explicit_degrees",
    "spec_from",
    "to_search_space",
    "training_step",
]


def spec_from(kind: str, factory, data: dict) -> Any:
    """``factory(**data)``, an unknown or missing field named as ``kind.field``."""
    if dataclasses.is_dataclass(factory):
        known = [f.name for f in dataclasses.fields(factory) if f.init]
        unknown = [k for k in data if k not in known]
        if unknown:
            raise ConfigError(
                f"{kind}.{unknown[0]} is not a {kind} option (known: {', '.join(known)})"
            )
    try:
        return factory(**data)
    except TypeError as exc:
        raise ConfigError(f"{kind}: {exc}") from None


def to_search_space(plan: dict) -> SearchSpace:
    data = dict(plan)
    for name in ("tp", "pp", "cp", "ep"):
        v = data[name]
        if isinstance(v, int) and not isinstance(v, bool):
            data[name] = [v]
        elif isinstance(v, str) and v != "auto":
            raise ConfigError(f"plan.{name}={v!r}: give an integer, a list of integers or 'auto'")
    for name in (
        "expert_tensor_parallel",
        "ep_over_tp",
        "micro_batch_size",
        "zero_stage",
        "shard_group",
        "recompute",
        "sequence_parallel",
        "attention",
        "virtual_stages",
        "schedule",
        "rank_order",
        "offload_layers",
        "cuda_graphs",
    ):
        if name not in data:
            continue
        v = data[name]
        if not isinstance(v, list | tuple):
            data[name] = [v]
    names = data.pop("framework", ["megatron_core"])
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list | tuple) or not all(isinstance(n, str | dict) for n in names):
        raise ConfigError(
            f"plan.framework={names!r}: give a profile name, or a list of names and profiles "
            "({name: ..., tp_dgrad_overlap: ..., ...})"
        )
    # set by profiles alone
    framework_only = (
        "zero_sync_per_tensor",
        "grad_sync_per_step",
        "ep_dispatch_dedup",
        "expert_gemm_loop",
        "fsdp_master_shards",
    )
    forced = {flag: data.pop(flag, None) for flag in PLAN_FLAGS if flag not in framework_only}
    for flag, value in forced.items():
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"plan.{flag} must be true, false or null, got {value!r}")
    try:
        data["frameworks"] = [
            (load_framework(n) if isinstance(n, str) else framework_from_dict(n)).with_flags(
                **forced
            )
            for n in names
        ]
    except ConfigError as exc:
        raise ConfigError(f"plan.framework: {exc}") from None
    splits = data.get("stage_layers", ["balanced"])
    if isinstance(splits, str) or (
        isinstance(splits, list | tuple) and splits and all(isinstance(x, int) for x in splits)
    ):
        splits = [splits]  # one split given alone
    data["stage_layers"] = splits
    return spec_from("plan", SearchSpace, data)


def training_step(data: dict) -> tuple[TrainingSpec, str | None]:
    """The training step, and its gradient precision when the configuration states one (it
    then overrides the frameworks'); unstated, the step's is bf16 and each framework's own
    applies."""
    data = dict(data)
    grads = data.get("grads_dtype")
    if grads is None:
        data["grads_dtype"] = "bf16"
    elif grads not in GRAD_DTYPES:
        raise ConfigError(
            f"training.grads_dtype={grads} is not one of: {', '.join(GRAD_DTYPES)} (or null: "
            "the framework's)"
        )
    return spec_from("training", TrainingSpec, data), grads


def budget_gpu_counts(max_gpus: int, gpus_per_node: int) -> list[int]:
    """Powers of two up to one node, then multiples of a node doubling up to ``max_gpus``."""
    counts, n = [], 1
    while n <= max_gpus:
        if n <= gpus_per_node or n % gpus_per_node == 0:
            counts.append(n)
        n *= 2
    if max_gpus not in counts and (max_gpus <= gpus_per_node or max_gpus % gpus_per_node == 0):
        counts.append(max_gpus)
    return counts


def check_explicit_degrees(space: SearchSpace, model: ModelSpec, training: TrainingSpec) -> None:
    """Explicitly listed degrees must suit the model (``auto`` filters silently)."""
    if not isinstance(space.tp, str):
        for tp in space.tp:
            for what, n in (
                ("heads", model.num_heads),
                ("kv_heads", model.num_kv_heads),
                ("ffn_hidden_size", model.ffn_hidden_size),
                ("vocab", model.vocab_size),
            ):
                if n % tp:
                    raise ConfigError(f"plan.tp={tp}: tp({tp}) does not divide {what}({n})")
    if not isinstance(space.pp, str):
        for pp in space.pp:
            if pp > model.num_layers:
                raise ConfigError(f"plan.pp={pp}: pp({pp}) > layers({model.num_layers})")
    if not isinstance(space.cp, str):
        for cp in space.cp:
            if training.seq_len % cp:
                raise ConfigError(f"plan.cp={cp}: cp({cp}) does not divide seq({training.seq_len})")
