"""Run configuration: frozen dataclasses, YAML files with a base, and ``key=value`` overrides.

A config file is a YAML mapping of sections (``model``, ``data``, ``rollout``, ``reward``,
``algo``, ``optim``, ``run``). It may name a ``base:`` file (relative to itself) whose values it
overrides; bases chain. Command-line overrides are ``section.key=value`` strings parsed as YAML
scalars and checked against the field's type. Every mistake (unknown section or key, wrong type,
invalid choice) is a single-line :class:`ConfigError` naming the key and, for unknown keys, the
closest valid ones.

The sections and their fields (:mod:`~delta_jax.config.sections`), the cross-field checks
(:mod:`~delta_jax.config.checks`) and the reading of files and overrides
(:mod:`~delta_jax.config.loading`).
"""

from delta_jax.config.checks import GYM_PREFIX, validate
from delta_jax.config.loading import build_config, load_config, parse_override
from delta_jax.config.sections import (
    SECTIONS,
    AlgoConfigSection,
    Config,
    ConfigError,
    DataConfigSection,
    LoraTarget,
    LossName,
    ModelConfigSection,
    OptimConfigSection,
    RewardConfigSection,
    RolloutConfigSection,
    RunConfigSection,
    field_range,
    ranged,
)

__all__ = [
    "GYM_PREFIX",
    "SECTIONS",
    "AlgoConfigSection",
    "Config",
    "ConfigError",
    "DataConfigSection",
    "LoraTarget",
    "LossName",
    "ModelConfigSection",
    "OptimConfigSection",
    "RewardConfigSection",
    "RolloutConfigSection",
    "RunConfigSection",
    "build_config",
    "field_range",
    "load_config",
    "parse_override",
    "ranged",
    "validate",
]
