"""How many submissions one server validates and tokenizes at once (`server.max_concurrent_admissions`).

A slot is a lock file under `<storage.root>/run/admission-slots/` held with `flock`, so the
slots are shared by every gunicorn worker process (and thread) serving the storage root, and the
kernel gives a slot back when its holder ends, however it ends. Admission is the costly part of
a request (parsing, validating and tokenizing a body of up to `server.max_request_mb`); with the
slots taken, a submission is refused at once instead of waiting for a thread, so the cores and
threads left keep answering `/health` and the status reads.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

SLOTS_DIR = Path("run") / "admission-slots"


class AdmissionSlots:
    def __init__(self, storage_root: Path, count: int) -> None:
        directory = storage_root / SLOTS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.count = count
        self.paths = [directory / f"slot-{i}.lock" for i in range(count)]
        for path in self.paths:  # made here, so that a request never leaves a file behind
            path.touch(exist_ok=True)

    def try_acquire(self) -> int | None:
        """A held slot (a descriptor to give to `release`), or None when every slot is taken."""
        for path in self.paths:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd
        return None

    def release(self, slot: int) -> None:
        os.close(slot)  # closing the descriptor drops its flock
