"""The edge between configuration files and domain specs: presets and (later) Hydra schemas."""

from stage_dse.config.presets import conf_dir, list_presets, load_model, read_preset

__all__ = ["conf_dir", "list_presets", "load_model", "read_preset"]
