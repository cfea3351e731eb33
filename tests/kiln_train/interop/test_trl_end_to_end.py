"""The round trip with the real pinned TRL: export over HTTP, `train.py` on the CPU, import over
HTTP, a Kiln job warm-started from the imported adapter; and TRL's run against Kiln's own.

The api runs in-process (Flask's test client) over a migrated SQLite store, the test's own Redis
queue and a live runner row for the tiny model. The bundle is downloaded as the tar.gz a user gets
and `train.py` runs in a fresh interpreter. With SGD on the same bundle (f32, CPU), TRL's per-step
losses must equal Kiln's within 1e-4 relative and the final adapters within 1e-3 relative (each
tensor's largest difference over its largest magnitude; the trained delta, which starts at zero,
is held to the same bound).
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from api import create_app
from kiln.store import Admission, make_engine, register_runner, session_factory
from kiln_train.interop.bundle import parse_lock, runner_bytes
from kiln_train.sft_config import SftConfig, parse_sft_config
from kiln_train.train.resident import load_resident
from tests.api.conftest import REDIS_URL, make_settings, runner_kwargs, tiny_model_dir  # noqa: F401
from tests.kiln.store.store_support import migrated_database
from tests.kiln_train.interop.support import kiln_run, read_json, relative_error, run_train_py, sha256, tar_gz
from tests.kiln_train.train.trainer_fixtures import conversations

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-4
ADAPTER_RTOL = 1e-3
ROWS = conversations(3)
CONFIG = {
    "epochs": 2,
    "lora_rank": 4,
    "lora_alpha": 8.0,
    "learning_rate": 0.05,
    "seed": 7,
    "optimizer": {"kind": "sgd"},
}


@dataclass
class Stack:
    client: object
    settings: object
    sessions: object


@pytest.fixture(scope="module")
def stack(tmp_path_factory, runner_kwargs):  # noqa: F811
    root = tmp_path_factory.mktemp("hf-e2e")
    storage = root / "storage"
    storage.mkdir()
    queue = f"kiln-hf-e2e-{uuid.uuid4().hex[:10]}"
    with migrated_database("sqlite", root) as db_url:
        settings = make_settings(storage, db_url, queue, training={"runner_stale_seconds": 3600})
        engine = make_engine(db_url)
        sessions = session_factory(engine)
        with sessions.begin() as session:
            register_runner(session, "runner-hf", **runner_kwargs)
        app = create_app(settings)
        try:
            yield Stack(app.test_client(), settings, sessions)
        finally:
            app.extensions["kiln"].close()
            engine.dispose()
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"*{queue}*"):
                client.delete(key)


@pytest.fixture(scope="module")
def resident(tiny_model_dir):  # noqa: F811
    return load_resident(tiny_model_dir)


@pytest.fixture(scope="module")
def trl_run(stack, tiny_model_dir, tmp_path_factory):  # noqa: F811
    """Export over HTTP, download and unpack the bundle, run its train.py."""
    answer = stack.client.post(
        "/v1/train/hf/sft/exports", json={"name": "e2e", "examples": ROWS, "config": CONFIG}
    )
    assert answer.status_code == 201, answer.get_json()
    work = tmp_path_factory.mktemp("trl")
    download = stack.client.get("/v1/train/hf/exports/e2e/download")
    assert download.status_code == 200 and download.mimetype == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(download.get_data()), mode="r:gz") as tar:
        tar.extractall(work, filter="data")
    bundle = work / "e2e.kiln-hf"
    out = work / "trl-output"
    proc = run_train_py(bundle, tiny_model_dir, out)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"export": answer.get_json(), "bundle": bundle, "out": out, "stdout": proc.stdout}


@pytest.fixture(scope="module")
def kiln_sgd(resident, tmp_path_factory):
    config = parse_sft_config(CONFIG).resolve()
    result = kiln_run(resident, config, ROWS, tmp_path_factory.mktemp("kiln-registry"), "kiln-sgd")
    assert result.status == "success", result.failure_message
    return result


def _losses(out: Path) -> list[float]:
    lines = (out / "step_losses.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_trl_reproduces_kiln_sgd_run(trl_run, kiln_sgd):
    bundle, out = trl_run["bundle"], trl_run["out"]
    theirs = _losses(out)
    ours = kiln_sgd.loss_history
    assert len(theirs) == len(ours) == 2 * len(ROWS)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(theirs, ours, strict=True))
    trl_adapter = load_file(str(out / "adapter_model.safetensors"))
    kiln_adapter = load_file(str(kiln_sgd.adapter_path / "adapter_model.safetensors"))
    initial = load_file(str(bundle / "initial_adapter" / "adapter_model.safetensors"))
    assert set(trl_adapter) == set(kiln_adapter) == set(initial)
    adapter_err, where = relative_error(trl_adapter, kiln_adapter)
    delta_err, delta_where = relative_error(
        {k: trl_adapter[k] - initial[k] for k in initial}, {k: kiln_adapter[k] - initial[k] for k in initial}
    )
    print(
        f"\nSGD agreement over {len(ours)} steps: per-step loss max rel {loss_err:.3e}; "
        f"adapter max rel {adapter_err:.3e} ({where}); trained delta max rel {delta_err:.3e} ({delta_where})"
    )
    assert loss_err <= LOSS_RTOL
    assert adapter_err <= ADAPTER_RTOL
    assert delta_err <= ADAPTER_RTOL
    moved = max((kiln_adapter[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4  # the comparison is of a run that trained


def test_the_bundle_starts_where_kiln_starts(trl_run, resident):
    """The exported initial adapter is Kiln's seeded init for the export's seed, bit for bit."""
    from kiln_train.model import attach_lora

    initial = load_file(str(trl_run["bundle"] / "initial_adapter" / "adapter_model.safetensors"))
    lora = attach_lora(resident.model, CONFIG["lora_rank"], CONFIG["lora_alpha"], CONFIG["seed"])
    try:
        ours = {k: v.detach().clone() for k, v in lora.state_dict().items()}
    finally:
        lora.remove(resident.model)
    assert set(ours) == set(initial)
    assert all(torch.equal(ours[k], initial[k]) for k in ours)


def test_result_manifest_records_the_run(trl_run):
    bundle, out = trl_run["bundle"], trl_run["out"]
    manifest = read_json(bundle / "kiln_hf_export.json")
    result = read_json(out / "kiln_hf_result.json")
    assert result["schema"] == "kiln.hf-trl-result.v1" and result["status"] == "success"
    assert result["export"] == {"name": "e2e", "bundle_digest": manifest["bundle_digest"]}
    assert result["script"]["sha256"] == manifest["files"]["train.py"]["sha256"]
    lock = parse_lock(runner_bytes("requirements.lock").decode())
    for package, pinned in manifest["trl_runner"]["enforced_pins"].items():
        assert lock[package] == pinned
        assert result["versions"][package].split("+")[0] == pinned, package
    assert result["version_drift"] == []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert result["adapter"][name] == sha256((out / name).read_bytes())
    assert result["run"]["steps"] == manifest["schedule"]["total_steps"] == 6
    assert result["optimizer"]["class"] == "torch.optim.SGD"
    assert result["run"]["dtype"] == "float32" and result["run"]["device"] == "cpu"
    assert [
        json.loads(line)["row_sha256"] for line in (out / "step_losses.jsonl").read_text().splitlines()
    ] == [json.loads(line)["row_sha256"] for line in (bundle / "train.jsonl").read_text().splitlines()]


def test_import_lists_downloads_and_warm_starts_a_kiln_job(trl_run, stack, resident):
    client, out = stack.client, trl_run["out"]
    upload = tar_gz(
        out, ["adapter_config.json", "adapter_model.safetensors", "kiln_hf_result.json", "step_losses.jsonl"]
    )
    answer = client.post(
        "/v1/train/hf/peft/imports/from-trl", data=upload, headers={"Content-Type": "application/gzip"}
    )
    assert answer.status_code == 201, answer.get_json()
    body = answer.get_json()
    receipt = body["import_receipt"]
    assert receipt["origin"] == "kiln_hf_trl_run" and receipt["identity_vouched_by_run"] is True
    assert receipt["run"]["export"]["bundle_digest"] == trl_run["export"]["bundle_digest"]
    assert receipt["adapter"]["targets_filled"] == []
    assert body["adapter"]["name"] == "from-trl" and body["adapter"]["rank"] == 4
    imported = Path(body["adapter"]["path"])
    ours, theirs = (
        load_file(str(imported / "adapter_model.safetensors")),
        load_file(str(out / "adapter_model.safetensors")),
    )
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    listed = client.get("/v1/adapters").get_json()["adapters"]
    assert [a["name"] for a in listed] == ["from-trl"]
    assert listed[0]["adapter_manifest"]["origin"] == "peft_import"
    download = client.get("/v1/adapters/from-trl/download")
    with tarfile.open(fileobj=io.BytesIO(download.get_data()), mode="r:gz") as tar:
        names = sorted(m.name for m in tar.getmembers())
    assert "from-trl/adapter_model.safetensors" in names and "from-trl/kiln_import_receipt.json" in names

    # A job warm-started from it is admitted, and Kiln's trainer runs it from those tensors.
    job_config = {**CONFIG, "base_adapter": "from-trl", "output_name": "continued", "epochs": 1}
    admitted = client.post("/v1/train/sft", json={"examples": ROWS, "config": job_config})
    assert admitted.status_code == 200, admitted.get_json()
    job_id = admitted.get_json()["job_id"]
    with stack.sessions() as session:
        effective = session.get(Admission, job_id).effective_config
    config = SftConfig.model_validate({**effective, "seed": int(effective["seed"])})
    assert config.base_adapter == "from-trl"
    result = kiln_run(resident, config, ROWS, stack.settings.adapters_dir, "continued")
    assert result.status == "success", result.failure_message
    base = result.receipt["adapters"]["base"]
    assert base["path"] == str(imported)
    assert base["adapter_model_sha256"] == receipt["published"]["adapter_model_sha256"]
    assert result.loss_history[0] < _losses(out)[0]  # it starts from the trained adapter, not the init
