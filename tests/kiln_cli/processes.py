"""The live `kiln` processes started for one storage root, for the tests that start `kiln demo`
and `kiln up` and check that nothing is left behind; and a terminal's Ctrl-C disposition for a
child a test interrupts."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil


def demo_processes(root: Path) -> list[psutil.Process]:
    """Live processes started for this demo root (their environment names it)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "kiln_cli.main" not in " ".join(proc.info["cmdline"] or []):
                continue
            if proc.environ().get("KILN_STORAGE_ROOT") == str(root) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def ctrl_c_default() -> None:
    """`preexec_fn` for a child that a test interrupts with SIGINT: Ctrl-C's default disposition,
    as under a terminal, even when the suite itself runs with SIGINT ignored (a non-interactive
    shell starts background jobs so, and an ignored SIGINT is inherited through exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
