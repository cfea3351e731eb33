"""Fixtures for the api tests: a migrated job store (SQLite and Postgres), a real Redis broker,
a live runner registered from a tiny Qwen3.5 model, and the app with its test client.

Each module runs against both databases (`db_url` is parametrised per module, Postgres gets a
fresh database that is dropped afterwards and fails, not skips, when unreachable). The broker is
Redis db 11 with a queue of its own per test (`kiln-api-test-<random>`, deleted afterwards), so
test runs in parallel never see each other's messages.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from api import create_app
from kiln.settings import Settings
from kiln.store import Base, make_engine, register_runner, session_factory
from tests.kiln.store.store_support import BACKENDS, clear_tables, migrated_database
from tests.services import redis_url

REDIS_URL = redis_url(11)
RUNNER_ID = "runner-test"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """A complete tiny random Qwen3.5 checkpoint with the real tokenizer."""
    from kiln_train.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-model"), preset="tiny", tokenizer=qwen_tokenizer
    )


@pytest.fixture(scope="session")
def runner_kwargs(tiny_model_dir) -> dict[str, Any]:
    """What a real worker writes into `runners` for the tiny model (worker.runner)."""
    from kiln_train.train.resident import load_resident
    from worker.runner import runner_registration

    kwargs = runner_registration(load_resident(tiny_model_dir))
    # A fixed, generous budget so admission does not depend on this machine's free memory.
    kwargs["free_memory_bytes"] = 16 << 30
    kwargs["total_memory_bytes"] = 24 << 30
    return kwargs


@pytest.fixture(scope="module", params=BACKENDS)
def db_url(request, tmp_path_factory) -> Iterator[str]:
    with migrated_database(request.param, tmp_path_factory.mktemp("db")) as url:
        yield url


@pytest.fixture
def engine(db_url):
    engine = make_engine(db_url)
    clear_tables(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def sessions(engine):
    return session_factory(engine)


@dataclass
class Broker:
    """The test's own queue on the Redis broker."""

    client: redis.Redis
    queue: str

    def keys(self) -> list[bytes]:
        return list(self.client.scan_iter(match=f"{self.queue}*"))

    def depth(self) -> int:
        """Messages waiting in the queue (every priority sub-list kombu may use)."""
        return sum(self.client.llen(k) for k in self.keys() if self.client.type(k) == b"list")

    def task_ids(self) -> list[str]:
        """The task ids (= job ids) of the queued messages, oldest first."""
        raw = reversed(self.client.lrange(self.queue, 0, -1))  # kombu LPUSHes, workers BRPOP
        return [json.loads(message)["headers"]["id"] for message in raw]


@pytest.fixture
def broker() -> Iterator[Broker]:
    client = redis.Redis.from_url(REDIS_URL)
    broker = Broker(client, f"kiln-api-test-{uuid.uuid4().hex[:10]}")
    yield broker
    for key in client.scan_iter(match=f"*{broker.queue}*"):  # the queue and kombu's bindings
        client.delete(key)
    client.close()


@pytest.fixture
def storage(tmp_path) -> Path:
    root = tmp_path / "storage"
    root.mkdir()
    return root


def make_settings(storage: Path, db_url: str, queue_name: str, **sections: dict) -> Settings:
    values: dict[str, Any] = {
        "storage": {"root": str(storage)},
        "database": {"url": db_url},
        "queue": {"broker_url": REDIS_URL, "queue_name": queue_name},
        "training": {"max_queued_jobs": 64, "max_tracked_jobs": 256},
    }
    for name, overrides in sections.items():
        values[name] = {**values.get(name, {}), **overrides}
    return Settings.model_validate(values)


@pytest.fixture
def settings(storage, db_url, engine, broker) -> Settings:
    return make_settings(storage, db_url, broker.queue)


@pytest.fixture
def app(settings):
    app = create_app(settings)
    yield app
    app.extensions["kiln"].close()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def runner(sessions, runner_kwargs):
    """A live runner (fresh heartbeat) for the tiny model."""
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **runner_kwargs)
    return RUNNER_ID


# ----- request builders and observation helpers ----------------------------------------------


def example(i: int = 0) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
        ]
    }


def sft_body(n: int = 2, **config: Any) -> dict:
    body: dict[str, Any] = {"examples": [example(i) for i in range(n)]}
    body["config"] = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0, **config}
    return body


def write_base_adapter(path: Path, model_config: dict, rank: int = 4, alpha: float = 8.0, **cfg: Any) -> Path:
    """A PEFT LoRA adapter directory (zero tensors) of the right shapes for `model_config`."""
    import torch
    from safetensors.torch import save_file

    from kiln_train.artifacts.adapter import expected_shapes
    from kiln_train.model.config import LORA_TARGET_MODULES, parse_config

    path.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(parse_config(model_config), rank)
    save_file({k: torch.zeros(shape) for k, shape in shapes.items()}, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(LORA_TARGET_MODULES),
    }
    (path / "adapter_config.json").write_text(json.dumps({**config, **cfg}))
    return path


def unique_name(prefix: str = "adapter") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def row_counts(engine) -> dict[str, int]:
    """Rows in every table of the store."""
    with engine.connect() as connection:
        return {
            t.name: int(connection.execute(select(func.count()).select_from(t)).scalar_one())
            for t in Base.metadata.sorted_tables
        }


def storage_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def snapshot(engine, broker: Broker, storage: Path) -> dict:
    """Everything a rejected request must leave unchanged."""
    return {"rows": row_counts(engine), "broker": broker.depth(), "files": storage_listing(storage)}
