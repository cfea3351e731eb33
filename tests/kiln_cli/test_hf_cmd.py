"""`kiln train hf export-sft` and `kiln train hf import-peft` against a real api (a thread over a
migrated SQLite store with a live runner row for the tiny model: the `server` fixture)."""

from __future__ import annotations

import io
import json
import tarfile
import urllib.request

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln_cli.main import cli
from kiln_train.interop.bundle import verify_bundle
from tests.api.conftest import example
from tests.kiln_cli.api_server import write_jsonl
from tests.kiln_train.interop.support import fake_run_output, rewrite_result


@pytest.fixture
def kiln(server, monkeypatch):
    monkeypatch.delenv("KILN_API_TOKEN", raising=False)
    monkeypatch.delenv("KILN_API_URL", raising=False)

    def run(*args: str):
        result = CliRunner().invoke(cli, [*args, "--url", server.url], catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run


@pytest.fixture
def bundle(kiln, server, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", [example(i) for i in range(3)], blank_lines=True)
    code, out, err = kiln(
        "train", "hf", "export-sft", "--file", str(rows), "--name", "cli", "--output", str(tmp_path / "out"),
        "--epochs", "1", "--rank", "4", "--alpha", "8", "--optimizer", "sgd", "--seed", "3",
    )  # fmt: skip
    assert code == 0, err
    yield tmp_path / "out" / "cli.kiln-hf", out
    # the server's copy goes too, so the next test may export the same name
    request = urllib.request.Request(server.url + "/v1/train/hf/exports/cli", method="DELETE")
    urllib.request.urlopen(request, timeout=30).close()


def test_export_sends_the_given_flags_and_unpacks_the_bundle(bundle, server):
    path, out = bundle
    manifest = verify_bundle(path)
    assert manifest["name"] == "cli" and manifest["data"]["rows_kept"] == 3
    (post,) = [r for r in server.recorder.posts() if r.path == "/v1/train/hf/sft/exports"][-1:]
    body = post.json()
    assert body["name"] == "cli" and len(body["examples"]) == 3
    assert body["config"] == {
        "epochs": 1,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "seed": 3,
        "optimizer": {"kind": "sgd"},
    }
    assert "invalid_row_policy" not in body and "input_adapter" not in body
    assert f"unpacked to {path}" in out and "python " in out and "import-peft --bundle" in out


def test_an_existing_target_is_refused_locally(bundle, kiln, tmp_path):
    path, _ = bundle
    rows = write_jsonl(tmp_path / "again.jsonl", [example(0)])
    code, _, err = kiln(
        "train", "hf", "export-sft", "--file", str(rows), "--name", "cli", "--output", str(path.parent)
    )
    assert code == 2 and "exists" in err


def test_the_servers_refusal_is_printed(kiln, tmp_path):
    rows = write_jsonl(tmp_path / "r.jsonl", [example(0)])
    code, _, err = kiln(
        "train", "hf", "export-sft", "--file", str(rows), "--name", "m", "--output", str(tmp_path),
        "--alpha", "64", "--rank", "4",
    )  # fmt: skip
    assert code == 1 and "training_invalid_request (HTTP 400)" in err and "unsafe LoRA scaling" in err
    assert not (tmp_path / "m.kiln-hf").exists()


def test_import_sends_the_run_and_the_export_manifest(bundle, kiln, server):
    path, _ = bundle
    fake_run_output(path, path / "trl-output")
    code, out, err = kiln("train", "hf", "import-peft", "--bundle", str(path), "--name", "cli-tuned")
    assert code == 0, err
    assert "adapter cli-tuned imported from a TRL run of export cli: r=4 alpha=8" in out
    (post,) = [r for r in server.recorder.posts() if r.path == "/v1/train/hf/peft/imports/cli-tuned"]
    with tarfile.open(fileobj=io.BytesIO(post.body), mode="r:gz") as tar:
        names = sorted(tar.getnames())
    assert names == [
        f"trl-output/{n}"
        for n in (
            "adapter_config.json",
            "adapter_model.safetensors",
            "kiln_hf_export.json",
            "kiln_hf_result.json",
            "step_losses.jsonl",
        )
    ]
    code, out, err = kiln("adapters", "list", "--json")
    assert code == 0 and "cli-tuned" in [a["name"] for a in json.loads(out)]
    code, _, err = kiln(
        "train", "hf", "import-peft", "--bundle", str(path / "trl-output"), "--name", "cli-tuned"
    )
    assert code == 1 and "adapter_already_exists (HTTP 409)" in err


def test_import_refusals(bundle, kiln, tmp_path):
    path, _ = bundle
    run = fake_run_output(path, tmp_path / "run")
    tensors = load_file(str(run / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(run / "adapter_model.safetensors"))
    rewrite_result(run)
    code, _, err = kiln("train", "hf", "import-peft", "--bundle", str(run), "--name", "nan")
    assert code == 1 and "peft_import_invalid (HTTP 400)" in err and "non-finite" in err
    (tmp_path / "empty").mkdir()
    code, _, err = kiln("train", "hf", "import-peft", "--bundle", str(tmp_path / "empty"), "--name", "x")
    assert code == 2 and "no adapter_config.json" in err
