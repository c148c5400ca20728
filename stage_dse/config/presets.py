"""Named presets from the YAML files under ``conf/`` (the Hydra config groups).

The same files serve Hydra composition and plain Python use (``load_model("llama3_70b")``).
Human units stay in YAML; this module turns a preset into a domain spec and nothing else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from stage_dse.errors import ConfigError
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec
from stage_dse.spec.engine import EngineSpec
from stage_dse.spec.framework import FrameworkSpec

__all__ = [
    "cluster_from_dict",
    "conf_dir",
    "engine_from_dict",
    "framework_from_dict",
    "hardware_from_dict",
    "list_presets",
    "load_cluster",
    "load_engine",
    "load_framework",
    "load_hardware",
    "load_model",
    "read_preset",
]

# YAML key in human units -> (spec field in base units, factor)
HARDWARE_UNITS: dict[str, tuple[str, float]] = {
    "peak_bf16_tflops": ("peak_flops", 1e12),
    "peak_fp8_tflops": ("peak_fp8_flops", 1e12),
    "peak_fp4_tflops": ("peak_fp4_flops", 1e12),
    "hbm_gib": ("hbm_bytes", 2.0**30),
    "hbm_tb_s": ("hbm_bandwidth_bytes_per_s", 1e12),
    "host_gb_s": ("host_bandwidth_bytes_per_s", 1e9),
    "memory_reserve_gib": ("memory_reserve_bytes", 2.0**30),
    "kernel_launch_us": ("kernel_launch_s", 1e-6),
    "host_op_us": ("host_op_s", 1e-6),
    "gemm_floor_us": ("gemm_floor_s", 1e-6),
    "attention_floor_us": ("attention_floor_s", 1e-6),
    "elementwise_floor_us": ("elementwise_floor_s", 1e-6),
    "moe_layer_latency_us": ("moe_layer_latency_s", 1e-6),
}
CLUSTER_UNITS: dict[str, tuple[str, float]] = {
    "intra_gb_s": ("intra_bandwidth_bytes_per_s", 1e9),
    "inter_gbit_s": ("inter_bandwidth_bytes_per_s", 1e9 / 8),
    "intra_latency_us": ("intra_latency_s", 1e-6),
    "inter_latency_us": ("inter_latency_s", 1e-6),
    "collective_base_latency_us": ("collective_base_latency_s", 1e-6),
    "oneshot_latency_us": ("oneshot_latency_s", 1e-6),
    "ll_intra_latency_us": ("ll_intra_latency_s", 1e-6),
    "ll_inter_latency_us": ("ll_inter_latency_s", 1e-6),
    "ll_base_latency_us": ("ll_base_latency_s", 1e-6),
}


def conf_dir() -> Path:
    """The ``conf/`` directory: inside an installed wheel, or at the top of a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_conf", here.parent / "conf"):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"configuration directory not found next to {here}")


def list_presets(group: str) -> list[str]:
    folder = conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def read_preset(group: str, name: str) -> dict[str, Any]:
    path = conf_dir() / group / f"{name}.yaml"
    if not path.is_file():
        valid = ", ".join(list_presets(group))
        raise ConfigError(f"unknown {group} preset {name!r}; valid: {valid}")
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    return data


def load_model(name: str, **overrides: Any) -> ModelSpec:
    """A ``ModelSpec`` from ``conf/model/<name>.yaml`` with optional field overrides."""
    data = {**read_preset("model", name), **overrides}
    try:
        return ModelSpec(**data)
    except TypeError as exc:  # unknown or missing field in the YAML
        raise ConfigError(f"model preset {name!r}: {exc}") from None


def _convert(
    kind: str, data: dict[str, Any], units: dict[str, tuple[str, float]], spec_type: type
) -> Any:
    fields = {f for f in spec_type.__dataclass_fields__}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in units:
            field, factor = units[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{kind}.{key} must be a number, got {value!r}")
            if value < 0:
                raise ConfigError(f"{kind}.{key} must be >= 0, got {value!r}")
            out[field] = float(value) * factor
        elif key in fields:
            out[key] = value
        else:
            valid = ", ".join(sorted({*units, *(fields - {u[0] for u in units.values()})}))
            raise ConfigError(f"{kind}.{key} is not a known field; valid: {valid}")
    try:
        return spec_type(**out)
    except TypeError as exc:
        raise ConfigError(f"{kind}: {exc}") from None
    except ConfigError as exc:
        # name the key the user wrote (hbm_gib), not the field it became (hbm_bytes)
        message = str(exc)
        for key, (field, _) in units.items():
            if key in data:
                message = message.replace(f"{kind}.{field}", f"{kind}.{key}")
        raise ConfigError(message) from None


def hardware_from_dict(data: dict[str, Any]) -> HardwareSpec:
    """A ``HardwareSpec`` from YAML-style keys in human units (``hbm_gib``, ``hbm_tb_s``, ...)."""
    return _convert("hardware", data, HARDWARE_UNITS, HardwareSpec)


def cluster_from_dict(data: dict[str, Any]) -> ClusterSpec:
    """A ``ClusterSpec`` from YAML-style keys in human units (``intra_gb_s``, ...)."""
    return _convert("cluster", data, CLUSTER_UNITS, ClusterSpec)


def load_hardware(name: str, **overrides: Any) -> HardwareSpec:
    return hardware_from_dict({**read_preset("hardware", name), **overrides})


def load_cluster(name: str, **overrides: Any) -> ClusterSpec:
    return cluster_from_dict({**read_preset("cluster", name), **overrides})


FRAMEWORK_FIELDS = tuple(f.name for f in dataclasses.fields(FrameworkSpec) if f.name != "name")
"""Fields a framework profile (``conf/framework/<name>.yaml``) sets: what the framework does,
not what the user chooses (:class:`stage_dse.spec.framework.FrameworkSpec`)."""


def load_engine(name: str, **overrides: Any) -> EngineSpec:
    """An ``EngineSpec`` from ``conf/engine/<name>.yaml`` (costs in microseconds there)."""
    return engine_from_dict({**read_preset("engine", name), **overrides})


def engine_from_dict(data: dict[str, Any]) -> EngineSpec:
    data = dict(data)
    for key in ("step_overhead", "request_overhead"):
        if f"{key}_us" in data:
            value = data.pop(f"{key}_us")
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"engine.{key}_us must be a number, got {value!r}")
            data[f"{key}_s"] = value * 1e-6
    if isinstance(data.get("large_gpu_excludes"), list):
        data["large_gpu_excludes"] = tuple(data["large_gpu_excludes"])
    fields = {f.name for f in dataclasses.fields(EngineSpec)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(
            f"engine.{unknown[0]} is not a known field; valid: step_overhead_us, "
            "request_overhead_us, "
            + ", ".join(sorted(fields - {"step_overhead_s", "request_overhead_s"}))
        )
    return EngineSpec(**data)


def load_framework(name: str) -> FrameworkSpec:
    """A framework profile (``conf/framework/<name>.yaml``)."""
    data = read_preset("framework", name)
    return framework_from_dict({"name": name, **data})


def framework_from_dict(data: dict[str, Any]) -> FrameworkSpec:
    """A framework profile from its fields (a preset's, or one written inline in a sweep)."""
    unknown = sorted(set(data) - {"name", *FRAMEWORK_FIELDS})
    if unknown:
        raise ConfigError(
            f"framework.{unknown[0]} is not a known field; valid: name, "
            + ", ".join(FRAMEWORK_FIELDS)
        )
    if "name" not in data:
        raise ConfigError("framework.name is missing: a profile written inline needs a name")
    return FrameworkSpec(**data)
