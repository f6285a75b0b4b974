"""Typed configuration: one class per YAML section, defaults < YAML < ``--set key=value``.

``load_config`` reports every problem at once, each naming its key and what would fix it.
The resolved config is saved in each run directory, so a run can be rebuilt from it alone.

sections.py holds the typed sections, reading.py reading and checking a config, keys.py the list of
every key (``qatune config --keys``), columns.py how names in a config match a sheet's columns.
"""

from qatune.config.columns import PLACEHOLDER, column_key, template_fields
from qatune.config.keys import field_names, key_lines, key_table
from qatune.config.reading import (
    READING_KEYS,
    differences,
    load_config,
    validate_config,
    with_reading_overrides,
)
from qatune.config.sections import (
    Config,
    DataConfig,
    GenerateConfig,
    LoraSettings,
    ModelConfig,
    SchedulerConfig,
    ScratchModel,
    Section,
    TrainConfig,
    delimiter_character,
)

__all__ = [
    "PLACEHOLDER",
    "READING_KEYS",
    "Config",
    "DataConfig",
    "GenerateConfig",
    "LoraSettings",
    "ModelConfig",
    "SchedulerConfig",
    "ScratchModel",
    "Section",
    "TrainConfig",
    "column_key",
    "delimiter_character",
    "differences",
    "field_names",
    "key_lines",
    "key_table",
    "load_config",
    "template_fields",
    "validate_config",
    "with_reading_overrides",
]
