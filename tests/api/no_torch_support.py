"""Runs api code in a fresh interpreter and checks that it imported no torch (docs/ARCHITECTURE.md#packages)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.api.conftest import REDIS_URL

# Builds the app on a fresh root with one registered runner (its fields come on stdin), runs the
# test's body with `app` and `client` in scope, then prints the torch modules it loaded.
_SCRIPT = """\
import json, sys
from kiln.settings import Settings
from api import create_app
from kiln.store import register_runner, upgrade_database

settings = Settings.model_validate({{
    "storage": {{"root": {root!r}}},
    "queue": {{"broker_url": {broker_url!r}, "queue_name": {queue!r}}},
}})
upgrade_database(settings.database_url)
app = create_app(settings)
with app.extensions["kiln"].sessions.begin() as session:
    register_runner(session, "r", **json.loads(sys.stdin.read()))
client = app.test_client()
{body}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))))
"""


def assert_app_runs_without_torch(
    body: str, *, root: Path, queue: str, runner_kwargs: dict, timeout: int
) -> None:
    """Runs `body` against a freshly built app in a new interpreter: it must succeed and load
    neither torch nor Triton."""
    script = _SCRIPT.format(
        root=str(root), broker_url=REDIS_URL, queue=queue, body=textwrap.dedent(body).strip()
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(runner_kwargs),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
