"""`POST /v1/train/hf/peft/imports/{name}`: a run's adapter is registered only after its checks
against the live runner; a registered import is listed, downloadable and a job's base_adapter;
each refusal names the first difference and leaves nothing behind."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import update

from kiln.store import Runner, register_adapter
from tests.api.conftest import RUNNER_ID, sft_body, snapshot
from tests.api.hf_support import export_body
from tests.api.no_torch_support import assert_app_runs_without_torch
from tests.kiln_train.interop.support import fake_run_output, read_json, rewrite_result, tar_gz, write_json

GZIP = {"Content-Type": "application/gzip"}
RUN_FILES = ["adapter_config.json", "adapter_model.safetensors", "kiln_hf_result.json", "step_losses.jsonl"]
B3 = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"


@pytest.fixture
def run_output(client, runner, settings, tmp_path) -> Path:
    """A bundle exported over HTTP and what train.py would leave for it."""
    answer = client.post("/v1/train/hf/sft/exports", json=export_body())
    assert answer.status_code == 201, answer.get_json()
    return fake_run_output(settings.storage_root / "hf-exports" / "bundle.kiln-hf", tmp_path / "trl-output")


def _import(client, name: str, data: bytes, headers=GZIP):
    return client.post(f"/v1/train/hf/peft/imports/{quote(name, safe='')}", data=data, headers=headers)


def test_import_registers_lists_downloads_and_warm_starts(client, run_output, settings):
    answer = _import(client, "tuned", tar_gz(run_output, RUN_FILES))
    assert answer.status_code == 201, answer.get_json()
    body = answer.get_json()
    adapter, receipt = body["adapter"], body["import_receipt"]
    path = settings.adapters_dir / "tuned"
    assert adapter["name"] == "tuned" and adapter["path"] == str(path) and adapter["job_id"] is None
    assert (adapter["rank"], adapter["alpha"]) == (4, 8.0)
    assert adapter["safetensors_sha256"] == receipt["published"]["adapter_model_sha256"]
    assert adapter["base_model_sha256"] == receipt["resident"]["base_weights_sha256"]
    assert (
        adapter["adapter_manifest"]["origin"] == "peft_import" and adapter["adapter_manifest_error"] is None
    )
    assert receipt["origin"] == "kiln_hf_trl_run" and receipt["run"]["export"]["name"] == "bundle"
    assert read_json(path / "kiln_import_receipt.json") == receipt
    assert [a["name"] for a in client.get("/v1/adapters").get_json()["adapters"]] == ["tuned"]
    download = client.get("/v1/adapters/tuned/download")
    with tarfile.open(fileobj=io.BytesIO(download.get_data()), mode="r:gz") as tar:
        assert "tuned/adapter_model.safetensors" in tar.getnames()
    ours, theirs = (
        load_file(str(path / "adapter_model.safetensors")),
        load_file(str(run_output / "adapter_model.safetensors")),
    )
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # a job may start from it
    job = client.post("/v1/train/sft", json=sft_body(2, base_adapter="tuned", output_name="next"))
    assert job.status_code == 200, job.get_json()
    assert job.get_json()["state"] == "queued"
    # its receipt is the import receipt (in the download): it has no train_receipt.json
    assert client.get("/v1/adapters/tuned/receipt").get_json()["error"]["code"] == "adapter_not_found"
    busy = client.delete("/v1/adapters/tuned")  # a queued job warm-starts from it
    assert busy.status_code == 409 and busy.get_json()["error"]["code"] == "adapter_active"
    assert client.delete(f"/v1/train/queue/{job.get_json()['job_id']}").status_code == 200
    assert client.delete("/v1/adapters/tuned").get_json()["status"] == "deleted"
    assert not path.exists()


def test_a_plain_peft_adapter_is_accepted_on_shapes(client, run_output, settings):
    answer = _import(
        client, "plain", tar_gz(run_output, ["adapter_config.json", "adapter_model.safetensors"], None)
    )
    assert answer.status_code == 201, answer.get_json()
    body = answer.get_json()
    assert body["import_receipt"]["origin"] == "peft" and body["adapter"]["base_model_sha256"] is None


def _edit_config(out, **changes):
    write_json(out / "adapter_config.json", {**read_json(out / "adapter_config.json"), **changes})
    rewrite_result(out)


def _edit_tensors(out, edit, resign=True):
    tensors = load_file(str(out / "adapter_model.safetensors"))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    if resign:
        rewrite_result(out)


def _nan(tensors):
    tensors[B3].view(-1)[3] = float("nan")


def _reshape(tensors):
    tensors[B3] = torch.zeros(tensors[B3].shape[0] + 1, tensors[B3].shape[1])


def _other_base_model(sessions):
    with sessions.begin() as session:
        runner = session.get(Runner, RUNNER_ID)
        config = {**runner.model_config, "base_weights_sha256": "sha256:" + "e" * 64}
        session.execute(update(Runner).where(Runner.id == RUNNER_ID).values(model_config=config))


CASES = {
    "wrong_rank": (lambda out, s: _edit_config(out, r=8), 400, "peft_import_invalid", "wrong rank: tensor"),
    "foreign_target": (
        lambda out, s: _edit_config(out, target_modules=["q_proj", "embed_tokens"]),
        400,
        "peft_import_invalid",
        "target module 'embed_tokens' is not one of Kiln's ten",
    ),
    "shape_mismatch": (
        lambda out, s: _edit_tensors(out, _reshape),
        400,
        "peft_import_invalid",
        f"shape mismatch: tensor '{B3}'",
    ),
    "nan_tensor": (lambda out, s: _edit_tensors(out, _nan), 400, "peft_import_invalid", "non-finite value"),
    "tampered_file_hash": (
        lambda out, s: _edit_tensors(out, lambda t: t[B3].add_(0.5), resign=False),
        409,
        "peft_import_mismatch",
        "adapter_model.safetensors has sha256",
    ),
    "another_base_model": (
        lambda out, s: _other_base_model(s),
        409,
        "peft_import_mismatch",
        "base_model.base_weights_sha256",
    ),
    "dora": (lambda out, s: _edit_config(out, use_dora=True), 400, "peft_import_invalid", "use_dora"),
    "rank_above_the_model": (
        lambda out, s: _edit_config(out, r=8192),
        400,
        "peft_import_invalid",
        "r = 8192 is above",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapters_are_refused_and_leave_nothing(
    case, client, run_output, sessions, engine, broker, storage
):
    edit, status, code, fragment = CASES[case]
    edit(run_output, sessions)
    before = snapshot(engine, broker, storage)
    answer = _import(client, "refused", tar_gz(run_output, RUN_FILES))
    assert answer.status_code == status, answer.get_json()
    error = answer.get_json()["error"]
    assert error["code"] == code and fragment in error["message"], error
    assert snapshot(engine, broker, storage) == before
    assert client.get("/v1/adapters").get_json() == {"adapters": []}


DEEP = b"[" * 100_000 + b"]" * 100_000  # 200 KB; a recursive parser gives up long before the end


def _deep_safetensors(out: Path) -> None:
    (out / "adapter_model.safetensors").write_bytes(len(DEEP).to_bytes(8, "little") + DEEP)


@pytest.mark.parametrize(
    "target",
    ["adapter_config.json", "adapter_model.safetensors", "kiln_hf_result.json", "kiln_hf_export.json"],
)
def test_deeply_nested_json_in_any_uploaded_file_is_a_400(
    target, client, run_output, settings, engine, broker, storage
):
    names = [*RUN_FILES, "kiln_hf_export.json"]
    bundle = settings.storage_root / "hf-exports" / "bundle.kiln-hf"
    (run_output / "kiln_hf_export.json").write_bytes((bundle / "kiln_hf_export.json").read_bytes())
    if target == "adapter_model.safetensors":
        _deep_safetensors(run_output)
    else:
        (run_output / target).write_bytes(DEEP)
    if target != "kiln_hf_result.json":
        rewrite_result(run_output)  # the run vouches for the hostile file: only its nesting is wrong
    before = snapshot(engine, broker, storage)
    answer = _import(client, "deep", tar_gz(run_output, names))
    assert answer.status_code == 400, answer.get_json()
    error = answer.get_json()["error"]
    assert error["code"] == "peft_import_invalid" and "nested deeper than 64 levels" in error["message"], (
        error
    )
    assert target in error["message"] or "header" in error["message"], error
    assert snapshot(engine, broker, storage) == before


def test_names_in_use_are_409_and_bad_names_400(
    client, run_output, sessions, settings, engine, broker, storage
):
    with sessions.begin() as session:
        register_adapter(
            session,
            name="taken",
            job_id=None,
            path=str(settings.adapters_dir / "taken"),
            size_bytes=1,
            safetensors_sha256="sha256:" + "0" * 64,
            rank=4,
            alpha=8.0,
        )
    (settings.adapters_dir / "on-disk").mkdir()
    queued = client.post("/v1/train/sft", json=sft_body(1, output_name="pending"))
    assert queued.status_code == 200
    upload = tar_gz(run_output, RUN_FILES)
    before = snapshot(engine, broker, storage)
    for name in ("taken", "on-disk", "pending"):
        answer = _import(client, name, upload)
        assert answer.status_code == 409 and answer.get_json()["error"]["code"] == "adapter_already_exists", (
            name
        )
    for name in ("-x", ".x", "a.kiln-checkpoint", "a-checkpoint-step-00000001"):
        answer = _import(client, name, upload)
        assert answer.status_code == 400 and answer.get_json()["error"]["code"] == "invalid_adapter_name", (
            name
        )
    assert snapshot(engine, broker, storage) == before


def test_media_type_archive_and_runner_are_required(client, run_output, engine, broker, storage, sessions):
    before = snapshot(engine, broker, storage)
    wrong = _import(client, "x", tar_gz(run_output, RUN_FILES), headers={"Content-Type": "application/json"})
    assert wrong.status_code == 415 and "application/gzip" in wrong.get_json()["error"]["hint"]
    broken = _import(client, "x", b"\x1f\x8b not really")
    assert broken.status_code == 400 and broken.get_json()["error"]["code"] == "peft_import_invalid"
    with sessions.begin() as session:
        session.execute(update(Runner).values(state="stopped"))
    gone = _import(client, "x", tar_gz(run_output, RUN_FILES))
    assert gone.status_code == 503 and gone.get_json()["error"]["code"] == "training_no_runner"
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize(
    "name", ["a", "Z9", "x" * 255, "x" * 256, "-x", ".x", "a.kiln-checkpoint", "a-checkpoint-step-1", "é"]
)
def test_import_name_parameter_is_what_the_route_accepts(client, runner, name):
    doc = client.get("/openapi.json").get_json()
    operation = doc["paths"]["/v1/train/hf/peft/imports/{name}"]["post"]
    assert set(operation["requestBody"]["content"]) == {"application/gzip"}
    assert set(operation["responses"]) == {"201", "default"}
    (param,) = operation["parameters"]
    schema = param["schema"]
    valid = bool(re.search(schema["pattern"].replace("$", r"\Z"), name)) and not any(
        re.search(s["pattern"].replace("$", r"\Z"), name) for s in schema["not"]["anyOf"]
    )
    answer = _import(client, name, b"\x1f\x8b not a tarball")
    expected = ("peft_import_invalid", 400) if valid else ("invalid_adapter_name", 400)
    assert (answer.get_json()["error"]["code"], answer.status_code) == expected, name


def test_export_and_import_do_not_import_torch(tmp_path, runner_kwargs, broker):
    """Both directions run in the api process, which never imports torch (a fresh interpreter)."""
    body = """
        import hashlib, io, tarfile
        from pathlib import Path

        rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
        body = {"name": "nt", "examples": rows, "config": {"lora_rank": 4, "lora_alpha": 8, "epochs": 1}}
        answer = client.post("/v1/train/hf/sft/exports", json=body)
        assert answer.status_code == 201, answer.get_json()
        manifest = answer.get_json()["manifest"]
        bundle = Path(answer.get_json()["path"])
        files = {n: (bundle / "initial_adapter" / n).read_bytes()
                 for n in ("adapter_config.json", "adapter_model.safetensors")}
        sha = lambda b: "sha256:" + hashlib.sha256(b).hexdigest()
        result = {
            "schema": "kiln.hf-trl-result.v1", "status": "success",
            "export": {"name": "nt", "bundle_digest": manifest["bundle_digest"]},
            "script": {"sha256": manifest["files"]["train.py"]["sha256"]},
            "base_model": manifest["base_model"], "tokenizer": manifest["tokenizer"],
            "template": manifest["template"], "lora": manifest["lora"],
            "adapter": {n: sha(b) for n, b in files.items()},
        }
        files["kiln_hf_result.json"] = json.dumps(result).encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        imported = client.post("/v1/train/hf/peft/imports/nt", data=buffer.getvalue(),
                               headers={"Content-Type": "application/gzip"})
        assert imported.status_code == 201, imported.get_json()
        assert client.get("/v1/train/hf/exports/nt/download").status_code == 200
        """
    assert_app_runs_without_torch(
        body, root=tmp_path, queue=broker.queue, runner_kwargs=runner_kwargs, timeout=300
    )
