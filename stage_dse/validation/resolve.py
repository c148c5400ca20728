"""What training and serving cases share on their way from a record to specs, and what a
serving record states about its engine (memory fraction, capacity scheduler)."""

from __future__ import annotations

import dataclasses

from stage_dse.config import load_model
from stage_dse.config.presets import list_presets
from stage_dse.spec import ModelSpec
from stage_dse.spec.engine import EngineSpec
from stage_dse.validation.corpus import CAPACITY_SCHEDULERS, Case, CorpusError

__all__ = [
    "Unexpressible",
    "case_model",
    "check_expressible",
    "reserve_ratio",
    "result_base",
    "stated_kv_memory_fraction",
    "tensorrt_engine_flow",
]


class Unexpressible(Exception):
    """The model cannot express a case (the message names the missing feature)."""


def check_expressible(case: Case) -> None:
    """What the record's curator found the model lacks, and presets that do not exist."""
    f = case.fields
    missing = f.get("details", {}).get("cannot_express")
    if missing:  # architecture features the model does not have, noted in the record
        raise Unexpressible(str(missing))
    for group in ("hardware", "cluster"):
        if f[group] not in list_presets(group):
            raise Unexpressible(f"no {group} preset {f[group]!r}")


def case_model(case: Case) -> ModelSpec:
    """The record's model: a preset name, a mapping of :class:`ModelSpec` fields, or a preset
    with some fields changed (``{preset: deepseek_v3, mtp_layers: 1}``)."""
    spec = case.fields["model"]
    if isinstance(spec, dict) and "preset" in spec:
        spec = dict(spec)
        base, changes = _preset_model(spec.pop("preset")), spec
    elif isinstance(spec, str):
        base, changes = _preset_model(spec), {}
    else:
        base, changes = None, spec
    try:
        return dataclasses.replace(base, **changes) if base is not None else ModelSpec(**changes)
    except TypeError as exc:
        raise CorpusError(f"{case.source.file}: run {case.id}: model: {exc}") from None


def _preset_model(name: str) -> ModelSpec:
    if name not in list_presets("model"):
        raise Unexpressible(f"no model preset {name!r} (give the dimensions in the record)")
    return load_model(name)


def result_base(case: Case, timing: str) -> dict:
    """The columns every result row of a case starts with."""
    return {
        "case": case.id,
        "corpus": case.kind,
        "source": case.source.id,
        "group": case.group,
        "kind": case.target_kind,
        "framework_version": str(case.fields.get("framework_version", "")),
        "published": case.value,
        "timing": timing,
    }


def tensorrt_engine_flow(fields: dict) -> bool:
    """A TensorRT-LLM record before 1.0 that does not name the PyTorch backend: the TensorRT
    engine flow, whose FP8 prefill attention was the ``use_fp8_context_fmha`` build flag, off
    by default (``EngineSpec.fp8_context_attention`` describes the PyTorch backend)."""
    version = str(fields.get("engine_version", "")).lower()
    return (
        fields.get("engine") == "trtllm"
        and version.startswith(("0.", "v0."))
        and "pytorch" not in version
    )


_FRACTION_FLAGS = {
    "total_fraction": "--gpu-memory-utilization",
    "static_reserve": "--mem-fraction-static",
    "free_fraction": "kv_cache_free_gpu_mem_fraction",
}


def reserve_ratio(f: dict, engine: EngineSpec) -> float:
    """The KV-cache room per running request: the record's stated capacity scheduler
    (:data:`~stage_dse.validation.corpus.CAPACITY_SCHEDULERS`, checked when the corpus is
    read), else the engine profile's."""
    policy = f.get("capacity_scheduler")
    return float(engine.kv_reserve_ratio) if policy is None else CAPACITY_SCHEDULERS[policy]


def stated_kv_memory_fraction(f: dict, engine: EngineSpec) -> float | None:
    """The memory fraction a record states for its engine's KV-cache rule: its
    ``kv_memory_fraction``, else the engine's flag in the serving command it quotes
    (``--gpu-memory-utilization``, ``--mem-fraction-static``,
    ``kv_cache_free_gpu_mem_fraction``); None where neither says (the engine's default)."""
    if "kv_memory_fraction" in f:
        return float(f["kv_memory_fraction"])
    flag = _FRACTION_FLAGS.get(engine.kv_memory_rule)
    command = str((f.get("details") or {}).get("command", ""))
    if flag is None or flag not in command:
        return None
    words = command.replace("=", " ").replace(":", " ").split()
    at = words.index(flag) if flag in words else -1
    try:
        return float(words[at + 1]) if at >= 0 else None
    except (IndexError, ValueError):
        return None
