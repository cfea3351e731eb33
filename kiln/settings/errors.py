"""The one exception of configuration loading."""

from __future__ import annotations


class ConfigError(Exception):
    """Start-up configuration error: the key's path (or env name) and the reason."""
