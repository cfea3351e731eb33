# ruff: noqa: F811  (fixtures imported from tests.api.conftest are used as parameters below)
"""Fixtures for the CLI tests: the tiny model and its runner row (shared with the api tests), an api
per module in a thread (`server`, and `secured` with a bearer token), and `kiln`, which runs
`kiln ARGS... --url <server>` in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from kiln_cli.main import cli
from tests.api.conftest import runner_kwargs, tiny_model_dir  # noqa: F401  (fixtures)
from tests.kiln_cli.api_server import TOKEN, Server, api_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, runner_kwargs) -> Iterator[Server]:
    with api_server(tmp_path_factory.mktemp("api"), runner_kwargs) as srv:
        yield srv


@pytest.fixture
def kiln(server, monkeypatch):
    """Run `kiln ARGS... --url <server>` in-process; (exit code, stdout, stderr)."""
    monkeypatch.delenv("KILN_API_TOKEN", raising=False)
    monkeypatch.delenv("KILN_API_URL", raising=False)

    def run(*args: str, url: str | None = server.url, env: dict | None = None):
        extra = ["--url", url] if url is not None else []
        result = CliRunner().invoke(cli, [*args, *extra], env=env, catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run


@pytest.fixture(scope="module")
def secured(tmp_path_factory, runner_kwargs) -> Iterator[Server]:
    with api_server(tmp_path_factory.mktemp("secured"), runner_kwargs, server={"api_tokens": [TOKEN]}) as srv:
        yield srv
