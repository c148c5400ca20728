"""What training and serving cases share on their way from a record to specs."""

from __future__ import annotations

from stage_dse.config import load_model
from stage_dse.config.presets import list_presets
from stage_dse.spec import ModelSpec
from stage_dse.validation.corpus import Case, CorpusError

__all__ = [
    "Unexpressible",
    "case_model",
    "check_expressible",
    "result_base",
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
    """The record's model: a preset name or a mapping of :class:`ModelSpec` fields."""
    spec = case.fields["model"]
    if isinstance(spec, str):
        if spec not in list_presets("model"):
            raise Unexpressible(f"no model preset {spec!r} (give the dimensions in the record)")
        return load_model(spec)
    try:
        return ModelSpec(**spec)
    except TypeError as exc:
        raise CorpusError(f"{case.source.file}: run {case.id}: model: {exc}") from None


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
