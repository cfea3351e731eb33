"""The connection options of the client commands (--url, --token, --config) and how their
failures are printed: the server's code, message and hint on stderr, and the exit status (1 for
an error envelope, 2 for bad usage or input, 3 when the api cannot be reached, 130 on Ctrl-C).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from kiln.settings import ConfigError
from kiln_cli.http_client import (
    EXIT_API_ERROR,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    TOKEN_ENV,
    URL_ENV,
    ApiClient,
    ApiError,
    ApiUnreachable,
    BadUrl,
    LocalFileError,
    resolve_connection,
)
from kiln_cli.sft_submit import EXIT_INTERRUPTED


def with_client(command: Callable) -> Callable:
    """Add --url/--token/--config and call `command(client, ...)`, turning API failures into
    their messages and exit statuses."""

    @functools.wraps(command)
    def run(*args: Any, url: str | None, token: str | None, config_file: str | None, **kwargs: Any) -> Any:
        try:
            connection = resolve_connection(url, token, config_file)
        except ConfigError as exc:
            click.echo(f"kiln: configuration error: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except BadUrl as exc:
            raise click.BadParameter(f"{exc} (from --url or {URL_ENV})", param_hint="'--url'") from None
        for key in ("job_id", "name"):
            if key in kwargs and not str(kwargs[key]).strip():
                raise click.BadParameter("must not be empty", param_hint=key.upper())
        with reporting_errors():
            return command(ApiClient(connection), *args, **kwargs)

    options = (
        click.option(
            "--url", envvar=URL_ENV, help=f"Api base URL [env {URL_ENV}; default from server.host/port]."
        ),
        click.option(
            "--token", envvar=TOKEN_ENV, help=f"Bearer token [env {TOKEN_ENV}; default server.api_tokens[0]]."
        ),
        click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml."),
    )
    for option in options:
        run = option(run)
    return run


@contextmanager
def reporting_errors() -> Iterator[None]:
    try:
        yield
    except ApiError as err:
        report_api_error(err)
        sys.exit(EXIT_API_ERROR)
    except ApiUnreachable as err:
        report_unreachable(err)
        sys.exit(EXIT_UNREACHABLE)
    except LocalFileError as exc:
        click.echo(f"kiln: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        click.echo("\nkiln: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)


def report_api_error(err: ApiError) -> None:
    click.echo(f"kiln: {err.code} (HTTP {err.status}): {err.message}", err=True)
    if err.hint:
        click.echo(f"  hint: {err.hint}", err=True)
    if err.retry_after:
        click.echo(f"  retry after: {err.retry_after} s", err=True)
    for note in err.notes:
        click.echo(f"  note: {note}", err=True)


def report_unreachable(err: ApiUnreachable) -> None:
    base = err.base_url
    click.echo(f"kiln: cannot reach the Kiln api: {err.url}: {err.reason}", err=True)
    click.echo(
        f"  is Kiln running at {base}? Start it with `kiln up` (api and worker on this machine; "
        f"`kiln serve` for the api alone), or pass --url (or set {URL_ENV}) for another address.",
        err=True,
    )
