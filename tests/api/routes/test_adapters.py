"""Adapters: list (with manifest and checkpoints), streamed tar.gz download, receipt, delete
(with its checkpoint dirs; 409 while a job targets it)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from tests.api.registry_support import publish_adapter
from tests.kiln.store.store_support import admit


def test_list_adapters(client, sessions, settings):
    publish_adapter(sessions, settings, "alpha")
    publish_adapter(sessions, settings, "beta", checkpoints=(), manifest=False, big=10)
    body = client.get("/v1/adapters").get_json()
    by_name = {a["name"]: a for a in body["adapters"]}
    assert set(by_name) == {"alpha", "beta"}
    alpha = by_name["alpha"]
    assert alpha["adapter_manifest"] == {"schema_version": 1, "adapter_name": "alpha"}
    assert alpha["adapter_manifest_error"] is None
    assert alpha["checkpoints"] == [
        "alpha-checkpoint-step-00000002.kiln-checkpoint",
        "alpha-checkpoint-step-00000004.kiln-checkpoint",
    ]
    assert (alpha["rank"], alpha["alpha"]) == (4, 8.0) and alpha["created_at"].endswith("Z")
    assert by_name["beta"]["adapter_manifest"] is None
    assert by_name["beta"]["adapter_manifest_error"] == "adapter_manifest.json is missing"


def test_download_streams_a_gzip_tar_of_the_adapter_directory(client, sessions, settings):
    files = publish_adapter(sessions, settings, "alpha")
    response = client.get("/v1/adapters/alpha/download")
    assert response.status_code == 200
    assert response.mimetype == "application/gzip"
    assert response.headers["Content-Disposition"] == 'attachment; filename="alpha.tar.gz"'
    with tarfile.open(fileobj=io.BytesIO(response.get_data()), mode="r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert members == {f"alpha/{rel}": data for rel, data in files.items()}


def test_receipt(client, sessions, settings):
    publish_adapter(sessions, settings, "alpha")
    response = client.get("/v1/adapters/alpha/receipt")
    assert response.status_code == 200
    assert response.get_json() == {"schema": "kiln.train-receipt", "final_loss": 0.5}
    (settings.adapters_dir / "alpha" / "train_receipt.json").unlink()
    missing = client.get("/v1/adapters/alpha/receipt")
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "adapter_not_found"


def test_a_receipt_that_is_not_strict_json_is_an_explained_error(client, sessions, settings):
    publish_adapter(sessions, settings, "beta")
    (settings.adapters_dir / "beta" / "train_receipt.json").write_text(
        '{"final_loss": NaN}', encoding="utf-8"
    )
    response = client.get("/v1/adapters/beta/receipt")
    assert response.status_code == 500
    error = response.get_json()["error"]
    assert error["code"] == "internal_error" and "NaN or Infinity" in error["message"]


def test_delete_removes_the_adapter_and_its_checkpoints_only(client, sessions, settings):
    publish_adapter(sessions, settings, "alpha")
    publish_adapter(sessions, settings, "alpha-2", big=10)  # a name that shares the prefix
    response = client.delete("/v1/adapters/alpha")
    assert response.status_code == 200
    assert response.get_json() == {
        "name": "alpha",
        "status": "deleted",
        "removed_checkpoints": [
            "alpha-checkpoint-step-00000002.kiln-checkpoint",
            "alpha-checkpoint-step-00000004.kiln-checkpoint",
        ],
    }
    left = sorted(p.name for p in settings.adapters_dir.iterdir())
    assert left == [
        "alpha-2",
        "alpha-2-checkpoint-step-00000002.kiln-checkpoint",
        "alpha-2-checkpoint-step-00000004.kiln-checkpoint",
    ]
    assert [a["name"] for a in client.get("/v1/adapters").get_json()["adapters"]] == ["alpha-2"]
    assert client.get("/v1/adapters/alpha/download").status_code == 404
    again = client.delete("/v1/adapters/alpha")
    assert again.status_code == 404 and again.get_json()["error"]["code"] == "adapter_not_found"


def test_delete_while_a_job_targets_the_adapter_is_409(client, sessions, settings):
    publish_adapter(sessions, settings, "alpha", big=10)
    with sessions.begin() as session:
        admit(session, adapter_name="alpha")  # a queued job that will write "alpha"
    response = client.delete("/v1/adapters/alpha")
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "adapter_active"
    assert (settings.adapters_dir / "alpha" / "adapter_config.json").exists()
    assert [a["name"] for a in client.get("/v1/adapters").get_json()["adapters"]] == ["alpha"]


@pytest.mark.parametrize("name", ["bad%20name", "x.kiln-checkpoint", "..."])
def test_invalid_adapter_names_are_400(client, name):
    for method, path in (("get", f"/v1/adapters/{name}/download"), ("delete", f"/v1/adapters/{name}")):
        response = getattr(client, method)(path)
        if name == "...":  # three dots is a valid single segment; it just does not exist
            assert response.status_code == 404
            continue
        assert response.status_code == 400, (method, name)
        assert response.get_json()["error"]["code"] == "invalid_adapter_name"


def test_unknown_adapter_is_404(client):
    for path in ("/v1/adapters/none/download", "/v1/adapters/none/receipt"):
        response = client.get(path)
        assert response.status_code == 404
        assert json.loads(response.get_data())["error"]["code"] == "adapter_not_found"
