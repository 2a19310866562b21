"""Model descriptions: presets of real models and Hugging Face ``config.json`` parsing."""

from __future__ import annotations

from hybridkv.errors import InvalidInputError
from hybridkv.models.hf_config import ConfigError, ModelKVConfig, layer_specs, load_config, parse_config
from hybridkv.models.presets import PRESETS, ModelPreset

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


def get_preset(name: str) -> ModelPreset:
    """A preset by id; the error lists the known ids."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidInputError(f"unknown model {name!r}; known presets: {', '.join(PRESETS)}") from None
