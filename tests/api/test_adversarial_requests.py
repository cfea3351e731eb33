"""Adversarial submissions and route arguments (DESIGN.md §7, kiln-contract §1.6): each gets the
contract's code in the envelope with the right status, names what is wrong, and leaves no row, no
queue message and no file -- on SQLite and Postgres alike (no 500 from what one database refuses)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.exc import OperationalError

from kiln.store import Job
from tests.api import resume_support
from tests.api.conftest import example, sft_body, snapshot, storage_listing, unique_name, write_base_adapter
from tests.api.resume_support import ADAPTER, STEP, resume_body

checkpoint = resume_support.checkpoint  # fixture

CONFIG = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}
ROW = example(0)


def _raw(text: str) -> bytes:
    return text.encode("utf-8")


# name -> (raw body, fragment the error message must contain)
BAD_BODIES = {
    # json.loads turns 1e400 into inf, which then slipped into the stored examples (Postgres 500).
    "number_out_of_range_in_an_example": (
        _raw(
            '{"examples":[{"messages":'
            + json.dumps(ROW["messages"])
            + ',"score":1e400}],"config":'
            + json.dumps(CONFIG)
            + "}"
        ),
        "the number 1e400 is out of range",
    ),
    "number_out_of_range_in_config": (
        _raw('{"examples":[' + json.dumps(ROW) + '],"config":{"lora_alpha":-1e999}}'),
        "the number -1e999 is out of range",
    ),
    # Which duplicate wins is up to the parser; the fingerprint and the admitted job disagreed.
    "duplicate_key": (
        _raw(
            '{"examples":['
            + json.dumps(ROW)
            + '],"config":'
            + json.dumps(CONFIG)
            + ',"config":'
            + json.dumps({**CONFIG, "epochs": 2})
            + "}"
        ),
        "duplicate key 'config'",
    ),
    # RecursionError escaped the parser as a 500.
    "nesting_too_deep": (_raw('{"examples":' + "[" * 50_000 + "]" * 50_000 + "}"), "nested too deeply"),
    # A lone surrogate escape broke the request fingerprint (UnicodeEncodeError, 500).
    "lone_surrogate_in_content": (
        _raw(
            '{"examples":[{"messages":[{"role":"user","content":"a\\ud800"},'
            '{"role":"assistant","content":"b"}]}],"config":' + json.dumps(CONFIG) + "}"
        ),
        "examples[0].messages[0].content contains a lone UTF-16 surrogate",
    ),
    # Postgres cannot hold U+0000 in JSONB/text: the admission transaction failed with a 500.
    "nul_in_content": (
        json.dumps(
            {
                "examples": [
                    {
                        "messages": [
                            {"role": "user", "content": "a\u0000b"},
                            {"role": "assistant", "content": "c"},
                        ]
                    }
                ],
                "config": CONFIG,
            }
        ).encode(),
        "examples[0].messages[0].content contains U+0000 (NUL)",
    ),
    "nul_in_an_ignored_example_key": (
        json.dumps({"examples": [{**ROW, "note": "x\u0000"}], "config": CONFIG}).encode(),
        "examples[0].note contains U+0000",
    ),
    "nul_in_a_smoke_prompt": (
        json.dumps(
            {
                "examples": [ROW],
                "config": {**CONFIG, "adapter_smoke_test": True, "adapter_smoke_prompts": ["hi\u0000"]},
            }
        ).encode(),
        "config.adapter_smoke_prompts[0] contains U+0000",
    ),
    "nul_in_resume_checkpoint": (
        json.dumps({"examples": [ROW], "config": {**CONFIG, "resume_checkpoint": "a\u0000"}}).encode(),
        "config.resume_checkpoint contains U+0000",
    ),
    # Names the trainer refuses only after the queue wait (or that break publication) are 400 now.
    "output_name_with_trailing_newline": (
        json.dumps(sft_body(1, output_name="adapter\n")).encode(),
        "config.output_name: 'adapter\\n' must be one path segment",
    ),
    "output_name_hidden": (
        json.dumps(sft_body(1, output_name=".hidden")).encode(),
        "config.output_name: '.hidden' must be one path segment",
    ),
    "output_name_like_a_checkpoint": (
        json.dumps(sft_body(1, output_name="x-checkpoint-step-00000001")).encode(),
        "config.output_name: 'x-checkpoint-step-00000001' must be one path segment",
    ),
    "output_name_too_long_for_its_checkpoints": (
        json.dumps(sft_body(1, output_name="a" * 200)).encode(),
        "config.output_name is 200 bytes",
    ),
    "base_adapter_path": (
        json.dumps(sft_body(1, base_adapter="../../etc")).encode(),
        "config.base_adapter '../../etc' must be one path segment",
    ),
    "resume_checkpoint_missing": (
        json.dumps(sft_body(1, resume_checkpoint="x")).encode(),
        "config.resume_checkpoint: checkpoint 'x': does not exist",
    ),
    "base_adapter_missing": (
        json.dumps(sft_body(1, base_adapter="no-such-adapter")).encode(),
        "config.base_adapter 'no-such-adapter' is not an adapter in the registry",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_body_is_400_and_leaves_nothing(case, client, engine, broker, storage, runner):
    raw, fragment = BAD_BODIES[case]
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", data=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.get_data(as_text=True)[:500]
    error = response.get_json()["error"]
    assert set(error) == {"code", "message", "hint"}
    assert error["code"] == "training_invalid_request"
    assert error["message"].startswith("Invalid training request: ")
    assert fragment in error["message"], error["message"]
    assert snapshot(engine, broker, storage) == before


def test_dataset_path_longer_than_its_column_is_400(client, engine, broker, storage, settings, runner):
    """`./` repeated resolves to a real file but overflows the admission row's varchar(1024):
    Postgres refused the insert (500), SQLite kept it."""
    (settings.datasets_dir / "rows.jsonl").write_text(json.dumps(ROW) + "\n", encoding="utf-8")
    path = "./" * 600 + "rows.jsonl"
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json={"dataset_path": path, "config": CONFIG})
    assert response.status_code == 400, response.get_data(as_text=True)[:300]
    error = response.get_json()["error"]
    assert error["code"] == "training_invalid_request"
    assert "dataset_path is 1210 characters; at most 1024" in error["message"]
    assert snapshot(engine, broker, storage) == before
    ok = client.post("/v1/train/sft", json={"dataset_path": "./rows.jsonl", "config": CONFIG})
    assert ok.status_code == 200, ok.get_json()


def test_longest_output_name_that_fits_is_admitted(client, sessions, runner):
    name = "a" * 165  # 255 - len(".-checkpoint-step-00000001.kiln-checkpoint.incomplete-<uuid4>")
    response = client.post("/v1/train/sft", json=sft_body(1, output_name=name))
    assert response.status_code == 200, response.get_json()
    with sessions() as session:
        assert session.get(Job, response.get_json()["job_id"]).adapter_name == name
    too_long = client.post("/v1/train/sft", json=sft_body(1, output_name="b" * 166))
    assert too_long.status_code == 400
    assert "use at most 165 bytes" in too_long.get_json()["error"]["message"]


def test_base_adapter_in_the_registry_is_admitted(client, settings, runner, runner_kwargs):
    write_base_adapter(settings.adapters_dir / "warm", runner_kwargs["model_config"])
    response = client.post("/v1/train/sft", json=sft_body(1, base_adapter="warm"))
    assert response.status_code == 200, response.get_json()


@pytest.mark.parametrize(
    "rank,cfg,match",
    [
        (8, {}, "base adapter rank 8 differs from lora_rank 4"),
        (4, {"lora_alpha": 4.0}, "base adapter lora_alpha 4 differs from lora_alpha 8"),
        (4, {"use_dora": True}, "base adapter sets use_dora: true"),
        (4, {"target_modules": ["q_proj"]}, "base adapter targets ['q_proj'] differ"),
        (4, {"peft_type": "IA3"}, "base adapter peft_type IA3 is not LORA"),
    ],
)
def test_a_base_adapter_that_cannot_warm_start_this_run_is_400_before_queueing(
    client, settings, runner, runner_kwargs, engine, broker, rank, cfg, match
):
    write_base_adapter(settings.adapters_dir / "warm", runner_kwargs["model_config"], rank=rank, **cfg)
    before = snapshot(engine, broker, settings.storage.root)
    response = client.post("/v1/train/sft", json=sft_body(1, base_adapter="warm"))
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "training_invalid_request"
    assert "config.base_adapter 'warm': " in error["message"] and match in error["message"]
    assert snapshot(engine, broker, settings.storage.root) == before


def test_a_base_adapter_of_another_model_shape_is_400(client, settings, runner, runner_kwargs):
    other = {**runner_kwargs["model_config"]}
    text = dict(other.get("text_config", other))
    text["intermediate_size"] = text["intermediate_size"] * 2
    other = {**other, "text_config": text} if "text_config" in other else text
    write_base_adapter(settings.adapters_dir / "warm", other)
    response = client.post("/v1/train/sft", json=sft_body(1, base_adapter="warm"))
    assert response.status_code == 400
    assert "has shape" in response.get_json()["error"]["message"]


def test_a_resume_ignores_base_adapter_at_admission(client, settings, runner):
    """kiln-contract §5: a resume ignores base_adapter; the resume checkpoint decides instead."""
    body = sft_body(
        1, base_adapter="no-such-adapter", resume_checkpoint="x-checkpoint-step-00000001.kiln-checkpoint"
    )
    message = client.post("/v1/train/sft", json=body).get_json()["error"]["message"]
    assert "base_adapter" not in message and "resume_checkpoint" in message


JOB_ROUTES = [
    ("get", "/v1/train/status/{}"),
    ("get", "/v1/train/jobs/{}"),
    ("get", "/v1/train/jobs/{}/events"),
    ("delete", "/v1/train/jobs/{}"),
    ("delete", "/v1/train/queue/{}"),
]


@pytest.mark.parametrize(("method", "route"), JOB_ROUTES)
@pytest.mark.parametrize("job_id", ["a%00b", "%00", "x" * 65, "not-a-uuid"])
def test_impossible_job_ids_are_404_not_found(method, route, job_id, client, engine, broker, storage, runner):
    """A NUL in a job id made Postgres refuse the query (500)."""
    client.post("/v1/train/sft", json=sft_body(1))
    before = snapshot(engine, broker, storage)
    response = getattr(client, method)(route.format(job_id))
    assert response.status_code == 404, response.get_data(as_text=True)
    assert response.get_json()["error"]["code"] == "training_job_not_found"
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize("after", ["2147483648", "9223372036854775808", "99999999999999999999999"])
def test_event_cursor_beyond_any_event_id_is_400(after, client, runner):
    """Cursors past the id column's range overflowed the driver (500 on both databases)."""
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    response = client.get(f"/v1/train/jobs/{job_id}/events?after={after}")
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "training_invalid_request"
    assert "query parameter after=" in error["message"]
    last = client.get(f"/v1/train/jobs/{job_id}/events?after=2147483647")
    assert last.status_code == 200 and last.get_json()["data"] == []


@pytest.mark.parametrize("method", ["get", "delete"])
def test_adapter_name_with_a_trailing_newline_is_invalid(method, client, engine, broker, storage):
    before = snapshot(engine, broker, storage)
    path = "/v1/adapters/abc%0A" + ("/download" if method == "get" else "")
    response = getattr(client, method)(path)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "invalid_adapter_name"
    assert snapshot(engine, broker, storage) == before


def test_publish_mark_failing_still_answers_the_admitted_job(client, sessions, broker, runner, monkeypatch):
    """The message went out but recording it failed: the job exists, so the answer is 200 (a 500
    would invite a duplicate submission); the reconciler rings again later."""
    import api.admission

    def unavailable(session, job_id, now=None):
        raise OperationalError("UPDATE training_jobs", {}, ConnectionError("database went away"))

    monkeypatch.setattr(api.admission, "mark_published", unavailable)
    name = unique_name("marked")
    response = client.post("/v1/train/sft", json=sft_body(1, output_name=name))
    assert response.status_code == 200, response.get_json()
    job_id = response.get_json()["job_id"]
    assert broker.task_ids() == [job_id]
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job.state == "queued" and job.published_at is None


def test_new_job_named_like_an_earlier_runs_checkpoints_is_409(
    client, engine, broker, storage, settings, runner
):
    """A failed or cancelled run leaves its exact checkpoints; a new job under that name is refused
    at admission rather than failing when it reaches a step whose checkpoint name is taken."""
    (settings.adapters_dir / "left-checkpoint-step-00000002.kiln-checkpoint").mkdir()
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(3, output_name="left", checkpoint_interval=2))
    assert response.status_code == 409, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "adapter_already_exists"
    assert "'left-checkpoint-step-00000002.kiln-checkpoint'" in error["message"]
    assert "from an earlier run" in error["message"]
    assert snapshot(engine, broker, storage) == before
    assert client.post("/v1/train/sft", json=sft_body(3, output_name="left-2")).status_code == 200


def test_resume_with_a_later_checkpoint_in_the_registry_is_409(
    client, engine, broker, storage, settings, checkpoint
):
    later = settings.adapters_dir / f"{ADAPTER}-checkpoint-step-{STEP + 2:08d}.kiln-checkpoint"
    later.mkdir()
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=resume_body(resume_checkpoint=checkpoint["path"].name))
    assert response.status_code == 409, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "adapter_already_exists"
    assert f"after the resume point (step {STEP})" in error["message"]
    assert snapshot(engine, broker, storage) == before
    later.rmdir()
    response = client.post("/v1/train/sft", json=resume_body(resume_checkpoint=checkpoint["path"].name))
    assert response.status_code == 200, response.get_json()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/v1/train/sft"),
        ("get", "/v1/train/status"),
        ("get", "/v1/train/queue"),
        ("delete", "/v1/train/queue/0b5c6c3e-3c4e-4a53-9b38-7a3c1c2b9f10"),
        ("get", "/v1/adapters"),
    ],
)
def test_unreachable_job_database_is_503_with_retry_after(method, path, tmp_path, broker):
    """A database that refuses connections is a 503 with Retry-After on every route, never a 500."""
    from api import create_app
    from tests.api.conftest import make_settings

    storage = tmp_path / "storage"
    storage.mkdir()
    settings = make_settings(storage, "postgresql://postgres@127.0.0.1:1/kiln", broker.queue)
    app = create_app(settings)
    try:
        before = storage_listing(storage)
        kwargs = {"json": sft_body(1)} if method == "post" else {}
        response = getattr(app.test_client(), method)(path, **kwargs)
        assert response.status_code == 503, response.get_data(as_text=True)
        assert response.headers["Retry-After"] == "5"
        error = response.get_json()["error"]
        assert error["code"] == "database_unavailable" and set(error) == {"code", "message", "hint"}
        assert broker.depth() == 0 and storage_listing(storage) == before
    finally:
        app.extensions["kiln"].close()


def test_deleting_an_adapter_a_queued_job_warm_starts_from_is_409(
    client, sessions, settings, runner, runner_kwargs
):
    """Refused while queued, so the job cannot fail at dequeue with base_adapter_missing."""
    from tests.api.registry_support import publish_adapter

    publish_adapter(sessions, settings, "base", checkpoints=(), big=10)
    write_base_adapter(settings.adapters_dir / "base", runner_kwargs["model_config"])
    job_id = client.post("/v1/train/sft", json=sft_body(1, base_adapter="base")).get_json()["job_id"]
    response = client.delete("/v1/adapters/base")
    assert response.status_code == 409
    error = response.get_json()["error"]
    assert error["code"] == "adapter_active" and job_id in error["message"]
    assert (settings.adapters_dir / "base").is_dir()
    assert client.get("/v1/adapters").get_json()["adapters"][0]["name"] == "base"
    assert client.delete(f"/v1/train/queue/{job_id}").get_json()["status"] == "cancelled"
    assert client.delete("/v1/adapters/base").status_code == 200
    assert not (settings.adapters_dir / "base").exists()
