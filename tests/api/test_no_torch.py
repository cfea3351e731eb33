"""The api never imports torch (nor Triton): build the app and serve requests in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.api.no_torch_support import assert_app_runs_without_torch


def test_app_factory_and_requests_do_not_import_torch(tmp_path, runner_kwargs, broker):
    body = """
        body = {"examples": [{"messages": [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "hello"}]}], "config": {"lora_rank": 4, "lora_alpha": 8}}
        submitted = client.post("/v1/train/sft", json=body)
        assert submitted.status_code == 200, submitted.get_json()
        job = submitted.get_json()["job_id"]
        for path in ("/health", "/v1/config", "/v1/train/status/" + job, "/v1/train/jobs/" + job, "/metrics"):
            assert client.get(path).status_code == 200, path
        """
    assert_app_runs_without_torch(
        body, root=tmp_path, queue=broker.queue, runner_kwargs=runner_kwargs, timeout=120
    )
    assert broker.depth() == 1  # the admission was published


def test_importing_the_api_imports_neither_the_worker_nor_torch_and_reads_no_settings(tmp_path):
    """The api publishes through `kiln.broker`; the Celery app is built only from settings given
    to `make_celery`, so a broken KILN_CONFIG cannot break an import."""
    script = textwrap.dedent(
        f"""
        import json, sys
        import api.app
        from kiln.settings import Settings
        api.app.create_app(Settings.model_validate({{"storage": {{"root": {str(tmp_path)!r}}}}}))
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("worker", "torch", "triton"))
        import worker.celery_app, worker.tasks  # the factory module reads no settings either
        print(json.dumps(loaded))
        """
    )
    env = {**os.environ, "KILN_CONFIG": str(tmp_path / "missing" / "kiln.toml")}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
