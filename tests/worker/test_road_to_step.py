"""The road from the Celery task to the gradient step (docs/ARCHITECTURE.md#the-path-of-one-job):
the calls a queue message makes before `SftRun.step` runs, measured on a real job's stack."""

from __future__ import annotations

import inspect
from pathlib import Path

from kiln_train.train.run import SftRun
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import submit
from worker import tasks

ROOT = Path(__file__).resolve().parents[2]
# Every call from the task to the step, in order (`module:function`).
ROAD = [
    "worker/tasks.py:train_sft",
    "worker/runtime.py:run_job",
    "worker/runtime.py:_run_one",
    "worker/runtime.py:_verify_and_train",
    "worker/runtime.py:_train",
    "kiln_train/train/trainer.py:train_sft",
    "kiln_train/train/run.py:run",
    "kiln_train/train/run.py:step",
]


class _Task:
    """What `train_sft` uses of its bound Celery task (nothing, unless the store is down)."""

    def retry(self, **kwargs):  # pragma: no cover - the store stays up here
        raise AssertionError(f"unexpected retry {kwargs}")


def test_a_queue_message_reaches_the_step_in_eight_calls_across_four_files(client, runtime, monkeypatch):
    roads: list[list[str]] = []
    real_step = SftRun.step

    def step(self, row_pos):
        frames = [f for f in inspect.stack()[1:] if Path(f.filename).resolve().is_relative_to(ROOT)]
        names = [f"{Path(f.filename).resolve().relative_to(ROOT)}:{f.function}" for f in reversed(frames)]
        start = names.index("worker/tasks.py:train_sft")
        roads.append([*names[start:], "kiln_train/train/run.py:step"])
        return real_step(self, row_pos)

    monkeypatch.setattr(SftRun, "step", step)
    monkeypatch.setattr(tasks, "_RUNTIME", runtime)
    job_id = submit(client, sft_body(2, epochs=1, output_name=unique_name("road"), seed=3))
    assert tasks.train_sft(_Task(), job_id) == "completed"
    assert len(roads) == 2 and roads[0] == roads[1]
    assert roads[0] == ROAD
    assert len({entry.split(":")[0] for entry in ROAD}) == 4
