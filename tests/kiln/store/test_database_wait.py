"""wait_for_database: a Postgres server that comes up late is waited for (then migrated), one that
never comes gives up with its last reason and the time waited, one that answers "no" fails at once.

The late server is the real test Postgres behind a TCP forwarder that starts listening only after
a delay, as a container's database does while it initialises.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from kiln.store import (
    DatabaseUnavailable,
    current_revision,
    head_revision,
    make_engine,
    upgrade_database,
    wait_for_database,
)
from tests.kiln.store.store_support import POSTGRES_ADMIN_URL, fresh_postgres_database

pytestmark = pytest.mark.postgres


def _reserved_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@contextmanager
def late_postgres(url: str, delay_s: float) -> Iterator[str]:
    """`url` reached through 127.0.0.1:<port>, where nothing listens for the first `delay_s`."""
    target = make_url(url)
    port = _reserved_port()
    stop = threading.Event()
    opened: list[socket.socket] = []

    def serve() -> None:
        time.sleep(delay_s)
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(0.2)
            while not stop.is_set():
                try:
                    client, _ = server.accept()
                except TimeoutError:
                    continue
                upstream = socket.create_connection((target.host, target.port or 5432))
                opened.extend((client, upstream))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield target.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    finally:
        stop.set()
        thread.join(timeout=10)
        for s in opened:
            s.close()


def test_a_server_that_starts_late_is_waited_for_then_migrated():
    with fresh_postgres_database() as url, late_postgres(url, delay_s=2.5) as late:
        lines: list[str] = []
        started = time.monotonic()
        attempts = wait_for_database(late, 30, poll_s=0.25, report=lines.append)
        waited = time.monotonic() - started
        assert 2.0 <= waited < 20
        assert attempts >= 3
        assert lines and lines[0].startswith("waiting for the job database (")
        assert "Connection refused" in lines[0] and "s left" in lines[0]
        upgrade_database(late)
        engine = make_engine(late)
        try:
            assert current_revision(engine) == head_revision()
        finally:
            engine.dispose()


def test_a_server_that_never_comes_gives_up_with_the_last_reason():
    down = f"postgresql+psycopg://kiln:secret@127.0.0.1:{_reserved_port()}/kiln"
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as caught:
        wait_for_database(down, 2.0, poll_s=0.25, report=lines.append)
    waited = time.monotonic() - started
    assert 1.5 <= waited < 10
    assert isinstance(caught.value, sa_exc.OperationalError)  # reported like any connection failure
    message = str(caught.value.orig)
    assert "Connection refused" in message and "no answer after waiting 2 s" in message
    assert caught.value.attempts >= 5
    assert len(lines) == 1  # one line at the first failure, the next only after ~10 s


def test_an_unknown_host_is_waited_for_like_a_starting_one():
    """A compose service name resolves only once its container exists."""
    url = "postgresql+psycopg://kiln:secret@kiln-no-such-host.invalid:5432/kiln"
    with pytest.raises(DatabaseUnavailable) as caught:
        wait_for_database(url, 1.0, poll_s=0.2)
    assert caught.value.attempts >= 2


def test_a_refusal_from_the_server_fails_at_once():
    missing = make_url(POSTGRES_ADMIN_URL).set(database="kiln_no_such_database_x")
    started = time.monotonic()
    with pytest.raises(sa_exc.OperationalError) as caught:
        wait_for_database(missing.render_as_string(hide_password=False), 30, poll_s=0.25)
    assert time.monotonic() - started < 5
    assert not isinstance(caught.value, DatabaseUnavailable)
    assert "does not exist" in str(caught.value.orig)


def test_sqlite_needs_no_waiting(tmp_path):
    assert wait_for_database(f"sqlite:///{tmp_path / 'kiln.db'}", 30) == 0
