"""The edge between configuration files and domain specs: presets and (later) Hydra schemas."""

from stage_dse.config.presets import (
    cluster_from_dict,
    conf_dir,
    engine_from_dict,
    hardware_from_dict,
    list_presets,
    load_cluster,
    load_engine,
    load_framework,
    load_hardware,
    load_model,
    read_preset,
)

__all__ = [
    "cluster_from_dict",
    "conf_dir",
    "engine_from_dict",
    "hardware_from_dict",
    "list_presets",
    "load_cluster",
    "load_engine",
    "load_framework",
    "load_hardware",
    "load_model",
    "read_preset",
]
