"""Typed run configuration: one torch-free module per TOML section, the field toolkit and the loader.

=====================  ===========================================================
module                 holds
=====================  ===========================================================
``config.run``         ``[run]``: name, directory, seed, liveness, launcher
``config.topology``    ``[topology]``: one process per device entry
``config.transport``   ``[transport]``: the slot rings
``config.data``        ``[data]``, ``[synth]``, ``[chat_template]``
``config.target``      ``[target]`` with its quantization
``config.drafter``     ``[drafter]``
``config.training``    ``[training]``
``config.fields``      the field toolkit: coercion, errors naming the key, field docs
``config.loader``      ``DFlashConfig``, :func:`load_config`, ``--set`` overrides, resolved configs
``config.docs``        ``docs/CONFIG.md``, generated from the field docs
=====================  ===========================================================

The public names are re-exported here: ``from dflash_ipc.config import load_config, DFlashConfig``.
"""

from dflash_ipc.config.data import RESERVED_KWARGS, ChatTemplateConfig, DataConfig, SynthConfig, check_mix_weights
from dflash_ipc.config.drafter import DrafterConfig
from dflash_ipc.config.fields import ConfigError, FieldError, require
from dflash_ipc.config.loader import (
    RESOLVED_CONFIG_FILE,
    SECTIONS,
    SET_SOURCE,
    DFlashConfig,
    blame_sets,
    config_from_dict,
    load_config,
    load_resolved_config,
    parse_sets,
    read_resolved_config,
    write_resolved_config,
)
from dflash_ipc.config.run import MAX_TIMEOUT_S, RunConfig
from dflash_ipc.config.target import Quantization, TargetConfig
from dflash_ipc.config.topology import TopologyConfig, valid_device
from dflash_ipc.config.training import TrainingConfig
from dflash_ipc.config.transport import TransportConfig

__all__ = [
    "MAX_TIMEOUT_S",
    "RESERVED_KWARGS",
    "RESOLVED_CONFIG_FILE",
    "SECTIONS",
    "SET_SOURCE",
    "ChatTemplateConfig",
    "ConfigError",
    "DFlashConfig",
    "DataConfig",
    "DrafterConfig",
    "FieldError",
    "Quantization",
    "RunConfig",
    "SynthConfig",
    "TargetConfig",
    "TopologyConfig",
    "TrainingConfig",
    "TransportConfig",
    "blame_sets",
    "check_mix_weights",
    "config_from_dict",
    "load_config",
    "load_resolved_config",
    "parse_sets",
    "read_resolved_config",
    "require",
    "valid_device",
    "write_resolved_config",
]
