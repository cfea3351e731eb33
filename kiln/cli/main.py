"""The `kiln` command: one entry point, one subcommand module per room."""

from __future__ import annotations

import importlib
import logging

import click

# Each module defines `register(group)`; modules stay torch-free at import time.
COMMAND_MODULES = (
    "kiln.cli.config_cmd",
    "kiln.cli.tokenizer_cmd",
    "kiln.cli.data_cmd",
    "kiln.cli.model_cmd",
    "kiln.cli.qualify_cmd",
    "kiln.cli.service_cmd",
    "kiln.cli.worker_cmd",
    "kiln.cli.client_cmd",
    "kiln.cli.hf_cmd",  # `kiln train hf ...`: after client_cmd, which makes the `train` group
    "kiln.cli.demo_cmd",
    "kiln.cli.up_cmd",
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
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # room not built yet
                continue
            raise
        module.register(cli)


_register_all()


def main() -> None:
    cli(prog_name="kiln")


if __name__ == "__main__":
    main()
