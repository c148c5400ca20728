"""Named presets from the YAML files under ``conf/`` (the Hydra config groups).

The same files serve Hydra composition and plain Python use (``load_model("llama3_70b")``).
Human units stay in YAML; this module turns a preset into a domain spec and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stage_dse.errors import ConfigError
from stage_dse.spec import ModelSpec

__all__ = ["conf_dir", "list_presets", "load_model", "read_preset"]


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
