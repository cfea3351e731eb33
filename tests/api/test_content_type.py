"""`POST /v1/train/sft` takes JSON only: 415 `unsupported_media_type` for anything a browser can
send cross-site without a CORS preflight (form, multipart, text/plain) or an unlabelled body, and
nothing is left behind."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from kiln.store.models import Admission, Job, JobEvent
from tests.api.conftest import sft_body

BODY = json.dumps(sft_body(1)).encode()


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        "application/jsonx",
        "text/json",
    ],
)
def test_a_body_not_labelled_json_is_415(client, runner, sessions, broker, storage, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post("/v1/train/sft", data=BODY, headers=headers)
    assert response.status_code == 415
    error = response.get_json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"] and "application/json" in error["hint"]
    with sessions() as s:
        for model in (Job, Admission, JobEvent):
            assert s.scalar(select(func.count()).select_from(model)) == 0
    assert broker.task_ids() == []
    assert list(storage.rglob("*.kiln-checkpoint")) == [] and list(storage.rglob("train_receipt.json")) == []


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.kiln+json"],
)
def test_json_labels_are_admitted(client, runner, content_type):
    response = client.post("/v1/train/sft", data=BODY, headers={"Content-Type": content_type})
    assert response.status_code == 200, response.get_json()
    assert response.get_json()["state"] == "queued"
