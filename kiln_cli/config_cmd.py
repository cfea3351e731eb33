"""`kiln config show`: the effective configuration and where each value came from."""

from __future__ import annotations

import json
import sys

import click

from kiln.settings import ConfigError, load_settings


def load_or_exit(config_file: str | None, cli: dict | None = None):
    """Load settings for a command; a bad configuration stops with its path and reason."""
    try:
        loaded = load_settings(config_file, cli=cli)
    except ConfigError as exc:
        click.echo(f"kiln: configuration error: {exc}", err=True)
        sys.exit(2)
    for warning in loaded.warnings:
        click.echo(f"kiln: warning: {warning}", err=True)
    return loaded


def register(cli: click.Group) -> None:
    @cli.group("config")
    def config_group() -> None:
        """Inspect the typed configuration (kiln.toml, KILN_* environment, flags)."""

    register_reference(config_group)

    @config_group.command("show")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    def show(config_file: str | None, as_json: bool) -> None:
        """Print every setting, its effective value and its source."""
        loaded = load_or_exit(config_file)
        rows = loaded.effective()
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "config_file": str(loaded.config_file) if loaded.config_file else None,
                        "settings": [{"key": k, "value": v, "source": s} for k, v, s in rows],
                    },
                    indent=2,
                )
            )
            return
        click.echo(f"# config file: {loaded.config_file or '(none)'}")
        width = max(len(k) for k, _, _ in rows)
        for key, value, source in rows:
            click.echo(f"{key:<{width}}  {json.dumps(value)}  [{source}]")


def configuration_reference() -> str:
    """Markdown reference of every setting, generated from the settings models (README section)."""
    from kiln.settings import ENV_PREFIX, SECTIONS

    lines = [
        "| key | environment | default | description |",
        "| --- | --- | --- | --- |",
    ]
    for section, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            shown = json.dumps(str(default) if hasattr(default, "as_posix") else default)
            env = f"{ENV_PREFIX}{section.upper()}_{name.upper()}"
            lines.append(f"| `{section}.{name}` | `{env}` | `{shown}` | {field.description or ''} |")
    return "\n".join(lines) + "\n"


def register_reference(config_group: click.Group) -> None:
    @config_group.command("reference")
    def reference() -> None:
        """Print the configuration reference (Markdown) generated from the settings models."""
        click.echo(configuration_reference(), nl=False)
