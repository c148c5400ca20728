"""The corpus of published, measured runs: reading and checking its YAML files.

The corpus lives in ``stage_dse/validation/corpus/{training,serving}/*.yaml``, one file per
source. A file has a ``source`` block (``id``, ``citation``, ``url``, ``commit`` for a
repository, ``kind``, ``framework``, ``notes``), optional ``defaults`` merged under every run,
and ``runs``: one record per published figure with the setup the source states, the list of
what it leaves ``unstated``, optional ``candidates`` (the values an unstated choice may take)
and the ``target`` (``kind``, ``value`` and the definition the source uses).

Every field is checked here, with one line naming the file, the run and the field. The same
reader takes a folder of the user's own files (``stage-dse-validate --corpus DIR``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from stage_dse.errors import ConfigError
from stage_dse.spec.plan import ONE_CHUNK_SCHEDULES

__all__ = [
    "CAPACITY_SCHEDULERS",
    "SERVING_FIELDS",
    "SERVING_KINDS",
    "TRAINING_FIELDS",
    "TRAINING_KINDS",
    "Case",
    "CorpusError",
    "Source",
    "corpus_root",
    "load_corpus",
]


class CorpusError(ConfigError):
    """A corpus file that does not follow the record format (the message names where)."""


TEXT = (str,)
INT = (int,)
NUMBER = (int, float)
BOOL = (bool,)

# field -> accepted types ("model" is a preset name or a mapping of ModelSpec fields)
COMMON_FIELDS: dict[str, tuple] = {
    "id": TEXT,
    "where": TEXT,
    "quote": TEXT,
    "note": TEXT,
    "notes": TEXT,
    "model": (str, dict),
    "model_name": TEXT,
    "model_source": TEXT,
    "hardware": TEXT,
    "cluster": TEXT,
    "gpus_per_node": INT,
    "network": TEXT,
    "framework": TEXT,
    "framework_version": TEXT,
    "tp": INT,
    "pp": INT,
    "ep": INT,
    "unstated": (list,),
    "candidates": (dict,),
    "target": (dict,),
    "details": (dict,),
    "derived": (list,),
    "hardware_variant": TEXT,
    "hardware_overrides": (dict,),
    "cluster_overrides": (dict,),
}
TRAINING_FIELDS: dict[str, tuple] = {
    **COMMON_FIELDS,
    "scheme": TEXT,
    "framework_flags": (dict,),
    "gpus": INT,
    "dp": INT,
    "cp": INT,
    "etp": INT,
    "zero": (int, str),
    "shard_group": INT,
    "recompute": TEXT,
    "precision": TEXT,
    "fp8_recipe": TEXT,
    "grads": TEXT,
    "optimizer_states": TEXT,
    "master": TEXT,
    "attention": TEXT,
    "sequence_parallel": BOOL,
    "seq_len": INT,
    "global_batch": INT,
    "micro_batch": INT,
    "virtual_stages": INT,
    "schedule": TEXT,
    "stage_layers": TEXT,
    "rank_order": TEXT,
    "memory_gib": NUMBER,
    "async_tp": BOOL,
    "activation_cpu_offload": BOOL,
    "offload_layers": INT,
    "torch_compile": BOOL,
    "cuda_graphs": TEXT,
}
SERVING_FIELDS: dict[str, tuple] = {
    **COMMON_FIELDS,
    "engine": TEXT,
    "engine_version": TEXT,
    "n_gpus": INT,
    "dp": INT,
    "attention_dp": (bool, int),
    "attention_dp_balance": BOOL,
    "chunked_prefill": BOOL,
    "weights": TEXT,
    "kv": TEXT,
    "precision": TEXT,
    "isl": INT,
    "osl": INT,
    "mode": TEXT,
    "batch": INT,
    "max_batch": INT,
    "max_num_tokens": INT,
    "request_rate": NUMBER,
    "concurrency": INT,
    "num_requests": INT,
    "dataset": TEXT,
    "mode_note": TEXT,
    "kv_memory_fraction": NUMBER,
    "capacity_scheduler": TEXT,
    "draft_tokens": INT,
    "accepted_length": NUMBER,
}
REQUIRED = {
    "training": (
        "id",
        "where",
        "model",
        "hardware",
        "cluster",
        "gpus",
        "framework",
        "seq_len",
        "global_batch",
        "target",
    ),
    "serving": (
        "id",
        "where",
        "model",
        "hardware",
        "cluster",
        "n_gpus",
        "tp",
        "isl",
        "osl",
        "mode",
        "weights",
        "target",
    ),
}
TRAINING_KINDS = {
    "iter_s": "seconds per optimizer step",
    "tokens_per_s_per_gpu": "tokens per second per GPU",
    "tflops_per_gpu": "achieved TFLOP/s per GPU (flops counted as the source says)",
    "mfu_pct": "model flops utilization, % of the stated peak",
    "layer_fwd_ms": "one transformer layer's forward pass, ms",
    "layer_bwd_ms": "one transformer layer's backward pass, ms",
}
SERVING_KINDS = {
    "out_tok_s_gpu": "output tokens per second per GPU",
    "out_tok_s": "output tokens per second of the whole deployment (n_gpus)",
    "out_tok_s_user": "output tokens per second seen by one request (1 / TPOT)",
    "total_tok_s": "input + output tokens per second of the whole deployment",
    "total_tok_s_gpu": "input + output tokens per second per GPU",
    "prefill_tok_s_gpu": "prompt tokens per second per GPU of a prefill-only deployment",
    "ttft_ms": "time to first token, ms",
    "tpot_ms": "time per output token after the first, ms",
    "itl_ms": "inter-token latency, ms (taken as TPOT)",
    "e2e_latency_s": "request latency, s",
    "request_s": "requests per second of the deployment",
}
SERVING_MODES = ("static", "inflight_max", "online_rate", "closed_loop", "burst", "other")
"""``burst``: ``num_requests`` requests sent at once (benchmarks with an infinite request rate
and a fixed prompt set); ``other``: a deployment the record describes in ``mode_note``."""
CAPACITY_SCHEDULERS = {"guaranteed_no_evict": 1.0, "max_utilization": 0.0}
"""The KV-cache room per running request (``EngineSpec.kv_reserve_ratio``) of TensorRT-LLM's
capacity scheduler policies a record may state (``capacity_scheduler``): ``GUARANTEED_NO_EVICT``
(the executor's default) starts a request only if its whole maximum length fits;
``MAX_UTILIZATION`` "packs as many requests as the underlying TRT engine can support in any
iteration", blocks allocated as tokens arrive and requests paused when a step finds none
(TensorRT-LLM performance tuning guide, "Useful Runtime Options"; ``CapacitySchedulerPolicy``).
NVIDIA's MLPerf Inference harness runs ``max_util`` unless told otherwise (its
``harness_llm`` main: ``DEFINE_string(trtllm_batch_sched_policy, "max_util", ...)``)."""

STATISTICS = ("mean", "median", "p90", "p95", "p99")
FLOPS_CONVENTION = {
    "attention": ("none", "full", "causal"),
    "recompute": ("none", "selective", "full"),
    "logits": (True, False),
    "params": ("matmul", "all"),
}


@dataclass(frozen=True)
class Source:
    id: str
    citation: str
    kind: str
    url: str = ""
    commit: str = ""
    framework: str = ""
    notes: str = ""
    file: str = ""


@dataclass(frozen=True)
class Case:
    """One published figure and the setup it was measured on."""

    id: str
    source: Source
    kind: str
    """``training`` or ``serving``."""
    fields: dict[str, Any]
    """The record with the file's defaults merged under it (target excluded)."""
    target_kind: str
    value: float
    target: dict[str, Any] = field(default_factory=dict)
    unstated: tuple[str, ...] = ()
    candidates: dict[str, tuple] = field(default_factory=dict)

    @property
    def group(self) -> str:
        """The group a case is summarized in: its source and target kind."""
        return f"{self.source.id}/{self.target_kind}"


def corpus_root() -> Path:
    return Path(str(files("stage_dse.validation").joinpath("corpus")))


def load_corpus(kind: str | None = None, extra: Path | str | None = None) -> list[Case]:
    """Every case of the packaged corpus (``kind``: only ``training`` or ``serving``), plus the
    YAML files under ``extra`` (a file or a folder of the user's records)."""
    if kind not in (None, "training", "serving"):
        raise ConfigError(f"corpus kind={kind!r} is not one of: training, serving")
    paths = []
    for k in ("training", "serving"):
        if kind in (None, k):
            paths += sorted((corpus_root() / k).glob("*.yaml"))
    if extra is not None:
        extra = Path(extra)
        if not extra.exists():
            raise ConfigError(f"--corpus {extra}: no such file or folder")
        paths += sorted(extra.rglob("*.yaml")) if extra.is_dir() else [extra]
    cases: list[Case] = []
    seen: dict[str, str] = {}
    sources: dict[str, str] = {}
    for path in paths:
        for case in read_file(path):
            if kind is not None and case.kind != kind:
                continue
            if case.id in seen:
                raise CorpusError(f"{path.name}: run {case.id}: id already used in {seen[case.id]}")
            other = sources.setdefault(case.source.id, path.name)
            if other != path.name:
                raise CorpusError(
                    f"{path.name}: source.id {case.source.id!r} already used in {other}"
                )
            seen[case.id] = path.name
            cases.append(case)
    return cases


def read_file(path: Path) -> list[Case]:
    """The cases of one corpus file (a :class:`CorpusError` naming the first problem)."""
    where = path.name
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise CorpusError(
            f"{where}:{line} not valid YAML ({getattr(exc, 'problem', exc)})"
        ) from None
    if not isinstance(doc, dict) or "source" not in doc or "runs" not in doc:
        raise CorpusError(f"{where}: expected a mapping with 'source' and 'runs'")
    unknown = sorted(set(doc) - {"source", "defaults", "runs"})
    if unknown:
        raise CorpusError(
            f"{where}: unknown top-level key {unknown[0]!r}; valid: source, defaults, runs"
        )
    source = _source(doc["source"], where)
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise CorpusError(f"{where}: defaults must be a mapping")
    runs = doc["runs"]
    if not isinstance(runs, list) or not runs:
        raise CorpusError(f"{where}: runs must be a non-empty list")
    return [_case(run, defaults, source, where) for run in runs]


def _source(block: object, where: str) -> Source:
    if not isinstance(block, dict):
        raise CorpusError(f"{where}: source must be a mapping")
    allowed = {"id", "citation", "url", "commit", "kind", "framework", "notes"}
    for key in block:
        if key not in allowed:
            raise CorpusError(
                f"{where}: source.{key} is not a known field; valid: {', '.join(sorted(allowed))}"
            )
    for key in ("id", "citation", "kind"):
        if not isinstance(block.get(key), str) or not block[key].strip():
            raise CorpusError(f"{where}: source.{key} is missing (every figure needs its citation)")
    if block["kind"] not in ("training", "serving"):
        raise CorpusError(
            f"{where}: source.kind={block['kind']!r} is not one of: training, serving"
        )
    if not (block.get("url") or block.get("commit")):
        raise CorpusError(f"{where}: source needs a url (paper) or a commit (repository file)")
    return Source(**{k: str(v) if v is not None else "" for k, v in block.items()}, file=where)  # type: ignore[arg-type]


def _merge(defaults: dict, run: dict) -> dict:
    out = dict(defaults)
    for key, value in run.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "model":
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _case(run: object, defaults: dict, source: Source, where: str) -> Case:
    if not isinstance(run, dict):
        raise CorpusError(f"{where}: every run must be a mapping, got {run!r}")
    label = f"{where}: run {run.get('id', '?')}"
    rec = _merge(defaults, run)
    kind = source.kind
    spec = TRAINING_FIELDS if kind == "training" else SERVING_FIELDS
    for key, value in rec.items():
        if key not in spec:
            raise CorpusError(f"{label}: unknown field {key!r}; valid: {', '.join(sorted(spec))}")
        types = spec[key]
        if not isinstance(value, types) or (types is INT and isinstance(value, bool)):
            names = " or ".join(t.__name__ for t in types)
            raise CorpusError(f"{label}: {key} must be {names}, got {value!r}")
        if types in (INT, NUMBER) and not value > 0:
            raise CorpusError(f"{label}: {key} must be > 0, got {value!r}")
    for key in REQUIRED[kind]:
        if key not in rec:
            raise CorpusError(f"{label}: missing field {key!r}")
    if "name" in rec.get("hardware_overrides", {}):
        raise CorpusError(
            f"{label}: hardware_overrides cannot rename the preset; name it in 'hardware' "
            "and give the part in 'hardware_variant'"
        )
    target = dict(rec.pop("target"))
    kinds = TRAINING_KINDS if kind == "training" else SERVING_KINDS
    tkind = target.get("kind")
    if tkind not in kinds:
        raise CorpusError(f"{label}: target.kind={tkind!r} is not one of: {', '.join(kinds)}")
    value = target.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CorpusError(f"{label}: target.value must be a number > 0, got {value!r}")
    if kind == "training":
        _check_training(rec, target, tkind, label)
    else:
        _check_serving(rec, target, label)
    unstated = rec.pop("unstated", ())
    if not all(isinstance(u, str) for u in unstated):
        raise CorpusError(f"{label}: unstated must be a list of field names (with an optional "
                          "explanation: 'micro_batch (not printed)')")  # fmt: skip
    unstated = _field_names(unstated)
    candidates = rec.pop("candidates", {}) or {}
    for key, values in candidates.items():
        if key not in spec:
            raise CorpusError(f"{label}: candidates.{key} is not a known field")
        if not isinstance(values, list) or not values:
            raise CorpusError(f"{label}: candidates.{key} must be a non-empty list")
        if key in rec:
            raise CorpusError(
                f"{label}: candidates.{key} given but {key} is stated ({rec[key]!r}); "
                "remove one of them"
            )
    return Case(
        id=str(rec["id"]),
        source=source,
        kind=kind,
        fields=rec,
        target_kind=tkind,
        value=float(value),
        target=target,
        unstated=unstated,
        candidates={k: tuple(v) for k, v in candidates.items()},
    )


def _field_names(entries) -> tuple[str, ...]:
    """``'micro_batch (not printed)'`` -> ``micro_batch``: the field an unstated entry names."""
    return tuple(
        u.split()[0].split("(")[0] if u.split() else u for u in entries if isinstance(u, str)
    )


def _check_training(rec: dict, target: dict, tkind: str, label: str) -> None:
    allowed = {"kind", "value", "flops", "peak_tflops", "note"}
    for key in target:
        if key not in allowed:
            raise CorpusError(
                f"{label}: target.{key} is not a known field; valid: {', '.join(sorted(allowed))}"
            )
    if tkind in ("tflops_per_gpu", "mfu_pct"):
        conv = target.get("flops")
        if not isinstance(conv, dict):
            raise CorpusError(
                f"{label}: target.flops is missing: say how the source counts flops "
                "({attention: none|full|causal, recompute: none|selective|full, "
                "logits: true|false})"
            )
        for key, value in conv.items():
            if key == "note":
                continue
            if key not in FLOPS_CONVENTION:
                valid = ", ".join(FLOPS_CONVENTION)
                raise CorpusError(
                    f"{label}: target.flops.{key} is not a known field; valid: {valid}, note"
                )
            if value not in FLOPS_CONVENTION[key]:
                raise CorpusError(
                    f"{label}: target.flops.{key}={value!r} is not one of: "
                    + ", ".join(str(v) for v in FLOPS_CONVENTION[key])
                )
    sched = rec.get("schedule")
    if sched not in (None, "interleaved", *ONE_CHUNK_SCHEDULES):
        raise CorpusError(
            f"{label}: schedule={sched!r} is not one of: "
            f"{', '.join(('interleaved', *ONE_CHUNK_SCHEDULES))}"
        )
    v = rec.get("virtual_stages")
    if (sched in ONE_CHUNK_SCHEDULES and v not in (None, 1)) or (sched == "interleaved" and v == 1):
        raise CorpusError(f"{label}: schedule={sched} contradicts virtual_stages={v}")
    for key in ("tp", "pp"):
        if (
            key not in rec
            and key not in _field_names(rec.get("unstated", ()))
            and key not in rec.get("candidates", {})
        ):
            raise CorpusError(f"{label}: {key} is neither stated nor listed in unstated")


def _check_serving(rec: dict, target: dict, label: str) -> None:
    allowed = {"kind", "value", "statistic", "note"}
    for key in target:
        if key not in allowed:
            raise CorpusError(
                f"{label}: target.{key} is not a known field; valid: {', '.join(sorted(allowed))}"
            )
    stat = target.get("statistic", "mean")
    if stat not in STATISTICS:
        raise CorpusError(
            f"{label}: target.statistic={stat!r} is not one of: {', '.join(STATISTICS)}"
        )
    if rec["mode"] not in SERVING_MODES:
        raise CorpusError(
            f"{label}: mode={rec['mode']!r} is not one of: {', '.join(SERVING_MODES)}"
        )
    need = {"static": "batch", "online_rate": "request_rate", "closed_loop": "concurrency",
            "burst": "num_requests", "other": "mode_note"}  # fmt: skip
    key = need.get(rec["mode"])
    if key and key not in rec:
        raise CorpusError(f"{label}: mode={rec['mode']} needs {key}")
    policy = rec.get("capacity_scheduler", "guaranteed_no_evict")
    if policy not in CAPACITY_SCHEDULERS:
        raise CorpusError(
            f"{label}: capacity_scheduler={policy!r} is not one of: "
            f"{', '.join(CAPACITY_SCHEDULERS)}"
        )
    frac = rec.get("kv_memory_fraction", 1.0)
    if not 0 < frac <= 1:
        raise CorpusError(
            f"{label}: kv_memory_fraction={frac:g} must be a fraction in (0, 1] (e.g. 0.9)"
        )
