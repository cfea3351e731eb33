"""One local stack per storage root.

`kiln up` and `kiln demo` each start an api and a worker on a storage root. Two of them on one
root would share its job store and broker while loading different models, and either worker
could take the other's job (a demo's job trained on `kiln up`'s model). So each holds an
exclusive lock on `<root>/run/stack.lock` while it runs, with its command, pid and address
written inside; a second one on the same root is refused with that address. The kernel drops
the lock when its holder dies, so a killed stack never blocks the next.

Adding workers to a running stack stays the way to scale out: `kiln worker` takes no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import click

LOCK_FILE = "stack.lock"


class StackRunning(click.ClickException):
    """Another local stack holds this storage root."""


def describe_holder(text: str) -> str:
    """The holder's line as written by `stack_lock` (or what is known of an older one)."""
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return "another Kiln stack"
    return f"`{holder.get('command', 'kiln')}` (pid {holder.get('pid', '?')}) at {holder.get('address', 'an unknown address')}"


@contextlib.contextmanager
def stack_lock(root: Path, command: str, address: str) -> Iterator[None]:
    """Hold `root` for this stack while the block runs; StackRunning (exit 1) when another
    stack holds it, naming that stack's command, pid and address."""
    run = root / "run"
    try:
        run.mkdir(parents=True, exist_ok=True)
        lock = open(run / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 (held for the block)
    except OSError as exc:
        raise click.ClickException(f"cannot use the storage root {root}: {exc.strerror or exc}") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = describe_holder(lock.read().strip())
            raise StackRunning(
                f"a Kiln stack is already running on {root}: {holder}. Use that one (open its address; "
                "`kiln worker` with the same settings adds a worker to it), stop it first, or give this "
                "one a storage root of its own with --root DIR."
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({"command": command, "pid": os.getpid(), "address": address}) + "\n")
        lock.flush()
        try:
            yield
        finally:
            lock.seek(0)
            lock.truncate()
