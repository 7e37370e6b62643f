"""Typed run configuration (see :mod:`dflash_ipc.config.loader`)."""

from dflash_ipc.config.loader import *  # noqa: F403
from dflash_ipc.config.loader import (  # noqa: F401
    RESOLVED_CONFIG_FILE,
    SECTIONS,
    ConfigError,
    DataConfig,
    DFlashConfig,
    DrafterConfig,
    RunConfig,
    TargetConfig,
    TopologyConfig,
    TrainingConfig,
    TransportConfig,
    config_from_dict,
    load_config,
    load_resolved_config,
    read_resolved_config,
    write_resolved_config,
)
