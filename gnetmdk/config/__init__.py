"""Typed configuration: BaseConfig fields, configs.py loading, command-line overrides."""
from .base import BaseConfig, ConfigError, ConfigSection, register_section
from .overrides import (build_config, config_from_dict, config_value, convert_value, load_config, load_config_class,
                        parse_overrides, validate_config)
from .recipe import quantized_stages

__all__ = ["BaseConfig", "ConfigError", "ConfigSection", "build_config", "config_from_dict", "config_value",
           "convert_value", "load_config", "load_config_class", "parse_overrides", "quantized_stages",
           "register_section", "validate_config"]
