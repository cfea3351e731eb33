"""Where the tests find the real Redis server: KILN_TEST_REDIS (default redis://127.0.0.1:6379).

Each test module that needs a broker owns one database number, so a second checkout's run can
point KILN_TEST_REDIS at its own server and never flush another run's queue.
"""

from __future__ import annotations

import os

REDIS_BASE = os.environ.get("KILN_TEST_REDIS", "redis://127.0.0.1:6379").rstrip("/")


def redis_url(db: int) -> str:
    """The URL of database `db` on the test Redis server."""
    return f"{REDIS_BASE}/{db}"
