"""The `kiln` command: one entry point, one subcommand module per area (`kiln_cli/*_cmd.py`)."""

from __future__ import annotations

import logging

import click

# Each module defines `register(group)` and stays torch-free at import time. Imported by name so
# that a renamed or missing module fails at start-up instead of silently dropping its commands.
from kiln_cli import (
    client_cmd,
    config_cmd,
    data_cmd,
    demo_cmd,
    hf_cmd,
    local_cmd,
    model_cmd,
    qualify_cmd,
    service_cmd,
    tokenizer_cmd,
    up_cmd,
    worker_cmd,
)

COMMAND_MODULES = (
    config_cmd,
    tokenizer_cmd,
    data_cmd,
    model_cmd,
    qualify_cmd,
    service_cmd,
    worker_cmd,
    client_cmd,
    hf_cmd,  # `kiln train hf ...`: after client_cmd, which makes the `train` group
    local_cmd,  # `kiln train local`: likewise
    demo_cmd,
    up_cmd,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
def cli(verbose: bool) -> None:
    """Kiln: turn conversations into LoRA adapters for Qwen3.5."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # Alembic announces each of its autogenerate plugins at INFO on every migration run.
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def _register_all() -> None:
    for module in COMMAND_MODULES:
        module.register(cli)


_register_all()


def main() -> None:
    cli(prog_name="kiln")


if __name__ == "__main__":
    main()
