"""`kiln qualify adamw-pytorch-oracle-v1`: stages, verdicts, receipts and exit codes."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kiln_cli.main import cli
from kiln_train.ground.digest import file_sha256_hex
from kiln_train.qualify.workload import (
    NO_CUDA_REASON,
    RECEIPT_SCHEMA,
    fixture_problems,
    load_workload,
    qualify_adamw_oracle,
    repo_root,
    verdict_of,
    write_receipt,
)

WORKLOAD = "adamw-pytorch-oracle-v1"
REPO = repo_root()
FIXTURE_REL = "qualification/fixtures/adamw_pytorch_oracle_v1.json"
WORKLOAD_REL = f"qualification/workloads/{WORKLOAD}.json"


def _stages(receipt: dict) -> dict:
    return {s["id"]: s for s in receipt["stages"]}


def _copy_root(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    for rel in (FIXTURE_REL, WORKLOAD_REL):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, root / rel)
    return root


def _repin(root: Path) -> None:
    """Point the copied workload at the (edited) copied fixture."""
    path = root / WORKLOAD_REL
    workload = json.loads(path.read_text())
    workload["fixture"]["sha256"] = file_sha256_hex(root / FIXTURE_REL)
    path.write_text(json.dumps(workload))


def test_workload_pins_the_committed_fixture():
    workload = load_workload(WORKLOAD)
    assert workload["fixture"]["path"] == FIXTURE_REL
    assert workload["fixture"]["sha256"] == file_sha256_hex(REPO / FIXTURE_REL)
    assert [c["id"] for c in workload["cases"]] == [
        "ordinary_float32",
        "ordinary_bfloat16",
        "low_gradient_float32",
        "low_gradient_bfloat16",
    ]
    assert workload["bounds"]["bfloat16"]["parameter_ulps"] == 1
    assert workload["exit_codes"] == {"pass": 0, "fail": 1, "incomplete": 3}
    with pytest.raises(ValueError, match="unknown qualification workload"):
        load_workload("nope-v1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the missing-device path")
def test_without_cuda_the_resident_stage_is_not_run_and_the_verdict_incomplete():
    receipt = qualify_adamw_oracle("cuda")
    assert receipt["schema"] == RECEIPT_SCHEMA
    assert receipt["workload"] == WORKLOAD
    stages = _stages(receipt)
    assert list(stages) == ["fixture_contract", "portable_reference", "resident_backend"]
    assert stages["fixture_contract"]["outcome"] == "pass"
    assert stages["fixture_contract"]["sha256"] == file_sha256_hex(REPO / FIXTURE_REL)
    ref = stages["portable_reference"]
    assert ref["outcome"] == "pass" and ref["device"] == "cpu"
    assert sorted(r["case_id"] for r in ref["results"]) == [
        "low_gradient_bfloat16",
        "low_gradient_float32",
        "ordinary_bfloat16",
        "ordinary_float32",
    ]
    for r in ref["results"]:
        assert r["passed"] and r["checked_lanes"] == 1920
        if r["dtype"] == "float32":
            assert r["mode"] == "trajectory"
            assert all(f["max_bound_ratio"] <= 1.0 for f in r["fields"].values())
        else:
            assert r["mode"] == "per_step"
            assert r["fields"]["parameter"]["max_ulps"] <= 1
            assert r["fields"]["exp_avg"]["max_ulps"] <= 4
            assert r["fields"]["exp_avg_sq"]["max_ulps"] <= 3
    assert {d["case_id"] for d in ref["bf16_free_running_drift_ulps"]} == {
        "ordinary_bfloat16",
        "low_gradient_bfloat16",
    }
    assert stages["resident_backend"] == {
        "id": "resident_backend",
        "outcome": "not_run",
        "reason": NO_CUDA_REASON,
        "device": "cuda",
        "results": [],
    }
    assert receipt["verdict"] == "incomplete"
    env = receipt["environment"]
    assert env["torch_version"] == torch.__version__ and env["python_version"]
    assert env["requested_device"] == "cuda" and env["cuda_available"] is False


def test_cpu_device_never_claims_the_resident_path():
    receipt = qualify_adamw_oracle("cpu")
    resident = _stages(receipt)["resident_backend"]
    assert resident["outcome"] == "not_run" and "portable_reference" in resident["reason"]
    assert receipt["verdict"] == "incomplete"


def test_a_changed_fixture_fails_the_contract(tmp_path):
    root = _copy_root(tmp_path)
    path = root / FIXTURE_REL
    path.write_text(path.read_text().replace('"ordinary"', '"ordinary" '))  # same JSON, other bytes
    receipt = qualify_adamw_oracle("cpu", root=root)
    stages = _stages(receipt)
    assert stages["fixture_contract"]["outcome"] == "fail"
    assert "sha256" in stages["fixture_contract"]["reason"]
    assert stages["portable_reference"]["outcome"] == "fail"
    assert receipt["verdict"] == "fail"
    assert receipt["git_commit"] is None  # the copy is not a git checkout


def test_a_wrong_oracle_value_fails_the_reference_stage(tmp_path):
    root = _copy_root(tmp_path)
    path = root / FIXTURE_REL
    fixture = json.loads(path.read_text())
    case = next(c for c in fixture["cases"] if c["id"] == "ordinary_bfloat16")
    lanes = case["trajectory"][4]["params"]["lora_A"]["parameter"]
    lanes["bits"][7] += 2  # two bf16 ULPs away: beyond the 1-ULP parameter envelope
    lanes["values"][7] = struct.unpack("<f", struct.pack("<I", lanes["bits"][7] << 16))[0]
    path.write_text(json.dumps(fixture))
    _repin(root)
    receipt = qualify_adamw_oracle("cpu", root=root)
    stages = _stages(receipt)
    assert stages["fixture_contract"]["outcome"] == "pass"
    ref = stages["portable_reference"]
    assert ref["outcome"] == "fail"
    assert "ordinary_bfloat16 step 5 lora_A.parameter[7]" in ref["reason"]
    assert receipt["verdict"] == "fail"


def test_fixture_problems_name_what_is_wrong():
    workload = load_workload(WORKLOAD)
    good = json.loads((REPO / FIXTURE_REL).read_text())
    assert fixture_problems(workload, good) == []

    bad = json.loads(json.dumps(good))
    bad["cases"][1]["trajectory"][0]["params"]["lora_B"]["exp_avg"]["values"][0] = 123.0
    assert any("decode to" in p for p in fixture_problems(workload, bad))

    bad = json.loads(json.dumps(good))
    bad["cases"][0]["trajectory"][2]["params"]["lora_A"]["parameter"].pop()
    assert any("expected 32 f32 lanes" in p for p in fixture_problems(workload, bad))

    bad = json.loads(json.dumps(good))
    bad["cases"][0]["trajectory"][2]["params"]["lora_A"]["parameter"][0] = 0.1  # not an f32 value
    assert any("not an exact f32 value" in p for p in fixture_problems(workload, bad))

    bad = json.loads(json.dumps(good))
    low = next(c for c in bad["cases"] if c["id"] == "low_gradient_float32")
    low["hyperparameters"]["eps"] = 1e-12
    assert any("not epsilon-dominated" in p for p in fixture_problems(workload, bad))

    bad = json.loads(json.dumps(good))
    bad["tolerances"]["bfloat16"]["parameter_ulps"] = 2
    assert any("bfloat16 tolerances" in p for p in fixture_problems(workload, bad))

    bad = json.loads(json.dumps(good))
    bad["cases"].pop()
    assert any("differ from the workload's" in p for p in fixture_problems(workload, bad))


def test_verdicts():
    assert verdict_of([{"outcome": "pass"}, {"outcome": "pass"}]) == "pass"
    assert verdict_of([{"outcome": "pass"}, {"outcome": "not_run"}]) == "incomplete"
    assert verdict_of([{"outcome": "fail"}, {"outcome": "not_run"}]) == "fail"


def test_receipts_are_never_overwritten(tmp_path):
    receipt = {
        "workload": WORKLOAD,
        "started_at": "2026-01-02T03:04:05.000006Z",
        "environment": {"requested_device": "cuda"},
        "verdict": "incomplete",
    }
    first = write_receipt(receipt, tmp_path / "r")
    second = write_receipt(receipt, tmp_path / "r")
    assert first != second
    assert first.name == f"{WORKLOAD}-cuda-20260102T030405000006Z.json"
    assert json.loads(first.read_text()) == json.loads(second.read_text()) == receipt
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([first.name, second.name])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the missing-device exit code")
def test_cli_writes_the_receipt_and_exits_3_when_incomplete(tmp_path):
    result = CliRunner().invoke(cli, ["qualify", WORKLOAD, "--out", str(tmp_path)])
    assert result.exit_code == 3, result.output
    assert "resident_backend     not_run  (no CUDA device)" in result.output
    assert "verdict: incomplete" in result.output
    (path,) = tmp_path.iterdir()
    receipt = json.loads(path.read_text())
    assert receipt["schema"] == RECEIPT_SCHEMA and receipt["verdict"] == "incomplete"
    assert f"receipt: {path}" in result.output


def test_cli_rejects_unknown_workloads():
    result = CliRunner().invoke(cli, ["qualify", "adamw-pytorch-oracle-v2"])
    assert result.exit_code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_resident_path_passes(tmp_path):
    result = CliRunner().invoke(cli, ["qualify", WORKLOAD, "--device", "cuda", "--out", str(tmp_path)])
    (path,) = tmp_path.iterdir()
    receipt = json.loads(path.read_text())
    resident = _stages(receipt)["resident_backend"]
    assert resident["outcome"] == "pass", resident.get("reason")
    assert resident["device"] == "cuda" and resident["device_name"]
    assert receipt["verdict"] == "pass" and result.exit_code == 0
