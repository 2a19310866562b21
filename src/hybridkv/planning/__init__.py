"""Capacity planning: model presets and Hugging Face configs to layer specs, GPUs, the planner."""

from hybridkv.planning.hf_config import ConfigError, ModelKVConfig, layer_specs, load_config, parse_config
from hybridkv.planning.presets import PRESETS, ModelPreset, get_preset

__all__ = [
    "PRESETS",
    "ConfigError",
    "ModelKVConfig",
    "ModelPreset",
    "get_preset",
    "layer_specs",
    "load_config",
    "parse_config",
]
