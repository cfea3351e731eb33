"""Typed service configuration: `kiln.toml` + `KILN_<SECTION>_<FIELD>` + CLI flags (docs/configuration.md).

Precedence is CLI > environment > TOML > default. Unknown keys and bad values stop start-up with
the key's path and the reason. Settings are read once, at start, and passed down; nothing deeper
in the code reads the environment. Backend-owned behaviour (SFT loss route, tape, rounding) has
no setting on purpose.
"""

from kiln.settings.errors import ConfigError
from kiln.settings.hosts import LOOPBACK_NAMES, host_name, is_loopback_host
from kiln.settings.loading import (
    CONFIG_ENV,
    DEFAULT_CONFIG_FILE,
    ENV_PREFIX,
    NON_SETTING_ENV,
    RETIRED_ENV,
    LoadedSettings,
    load_settings,
)
from kiln.settings.sections import (
    HEARTBEATS_PER_LEASE,
    MAX_INT,
    SECTIONS,
    URL_SETTINGS,
    DatabaseSettings,
    MemorySettings,
    ModelSettings,
    QueueSettings,
    ServerSettings,
    Settings,
    StorageSettings,
    TrainingSettings,
    check_bind_safety,
)

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_FILE",
    "ENV_PREFIX",
    "HEARTBEATS_PER_LEASE",
    "LOOPBACK_NAMES",
    "MAX_INT",
    "NON_SETTING_ENV",
    "RETIRED_ENV",
    "SECTIONS",
    "URL_SETTINGS",
    "ConfigError",
    "DatabaseSettings",
    "LoadedSettings",
    "MemorySettings",
    "ModelSettings",
    "QueueSettings",
    "ServerSettings",
    "Settings",
    "StorageSettings",
    "TrainingSettings",
    "check_bind_safety",
    "host_name",
    "is_loopback_host",
    "load_settings",
]
