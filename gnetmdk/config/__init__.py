"""Typed configuration: BaseConfig fields, configs.py loading, command-line overrides."""
from .base import BaseConfig, ConfigError
from .overrides import (build_config, config_from_dict, convert_value, load_config, load_config_class,
                        parse_overrides, validate_config)

__all__ = ["BaseConfig", "ConfigError", "build_config", "config_from_dict", "convert_value", "load_config",
           "load_config_class", "parse_overrides", "validate_config"]
