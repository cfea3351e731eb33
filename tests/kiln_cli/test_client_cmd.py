"""`kiln jobs ...` and `kiln adapters ...` against a real api: listing, showing, cancelling,
deleting, event pages and --follow, adapter downloads and extraction."""

from __future__ import annotations

import json
import os
import tarfile
import threading

from kiln.store import claim_job, register_adapter
from kiln_cli import client_cmd
from tests.kiln_cli.api_server import Server, http_json, name, submit


def test_jobs_list_show_cancel_delete(kiln, server, tmp_path):
    queued = submit(kiln, tmp_path)
    cancelled = submit(kiln, tmp_path)

    code, out, err = kiln("jobs", "cancel", cancelled["job_id"])
    assert (code, out) == (0, f"job {cancelled['job_id']} cancelled\n"), err
    code, out, err = kiln("jobs", "cancel", cancelled["job_id"])
    assert code == 1 and out == ""
    assert "kiln: training_job_not_cancellable (HTTP 409): " in err and cancelled["job_id"] in err
    assert "  hint: The job already finished; nothing to cancel." in err

    code, out, err = kiln("jobs", "list", "--json")
    assert code == 0, err
    states = {j["job_id"]: j["state"] for j in json.loads(out)}
    assert states[queued["job_id"]] == "queued" and states[cancelled["job_id"]] == "failed"
    code, out, _ = kiln("jobs", "list", "--state", "failed", "--json")
    assert {j["state"] for j in json.loads(out)} == {"failed"}
    assert cancelled["job_id"] in {j["job_id"] for j in json.loads(out)}

    code, out, _ = kiln("jobs", "list")
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "STATE", "ADAPTER", "PROGRESS", "LOSS", "SUBMITTED"]
    row = next(r for r in rows if r.startswith(queued["job_id"]))
    assert row.split()[1:2] == ["queued"] and "0/2 0%" in row
    code, out, _ = kiln("jobs", "list", "--state", "bogus")
    assert code == 2

    code, out, err = kiln("jobs", "show", cancelled["job_id"])
    assert code == 0, err
    assert f"job        {cancelled['job_id']}" in out
    assert "state      failed" in out and "failure    cancelled: " in out
    assert "data       inline: 2 row(s) kept, 0 rejected" in out
    code, out, _ = kiln("jobs", "show", queued["job_id"])
    assert "(queue position " in out

    code, _out, err = kiln("jobs", "delete", queued["job_id"])
    assert code == 1 and "training_job_active (HTTP 409)" in err
    code, out, err = kiln("jobs", "delete", cancelled["job_id"])
    assert (code, out) == (0, f"job {cancelled['job_id']} deleted\n"), err
    code, out, _ = kiln("jobs", "list", "--json")
    assert cancelled["job_id"] not in {j["job_id"] for j in json.loads(out)}


def test_cancelling_a_running_job_is_cooperative(kiln, server, tmp_path):
    job_id = submit(kiln, tmp_path)["job_id"]
    with server.sessions.begin() as session:
        assert claim_job(session, job_id, "w-cli", 60) is not None
    code, out, err = kiln("jobs", "cancel", job_id)
    assert code == 0, err
    assert out == f"job {job_id} cancelling: stop requested — the trainer aborts at the next step boundary\n"
    code, out, err = kiln("jobs", "cancel", job_id, "--json")
    assert json.loads(out)["status"] == "cancelling"
    code, out, _ = kiln("jobs", "show", job_id)
    assert "state      running" in out and "epoch 1/1" in out


def test_unknown_job_is_the_servers_404(kiln):
    for args in (("jobs", "show", "no-such-job"), ("jobs", "cancel", "no-such-job"), ("jobs", "events", "x")):
        code, out, err = kiln(*args)
        assert code == 1 and out == "", args
        assert err.startswith("kiln: training_job_not_found (HTTP 404): "), err
        assert "  hint: List jobs with GET /v1/train/status." in err


def test_a_job_id_cannot_escape_its_path_segment(kiln, server):
    code, _out, err = kiln("jobs", "show", "../adapters")
    assert code == 1 and "HTTP 404" in err
    assert server.recorder.requests[-1].path == "/v1/train/jobs/../adapters"  # one segment, not a route


def test_events_are_read_page_by_page(kiln, server, tmp_path, monkeypatch):
    admission = submit(kiln, tmp_path)
    job_id = admission["job_id"]
    http_json(server, "DELETE", f"/v1/train/queue/{job_id}")
    expected = http_json(server, "GET", f"/v1/train/jobs/{job_id}/events")["data"]
    assert len(expected) >= 2

    monkeypatch.setattr(client_cmd, "EVENT_PAGE", 1)
    before = len(server.recorder.requests)
    code, out, err = kiln("jobs", "events", job_id, "--json")
    assert code == 0, err
    assert [json.loads(line) for line in out.splitlines()] == expected
    pages = [r for r in server.recorder.requests[before:] if r.path.endswith("/events")]
    assert [p.query.get("after") for p in pages] == [None, *(str(e["id"]) for e in expected[:-1])]

    code, out, _ = kiln("jobs", "events", job_id)
    lines = out.splitlines()
    assert len(lines) == len(expected)
    assert lines[0].split()[2] == "queued" and expected[0]["message"] in lines[0]


def test_events_follow_until_the_job_finishes(kiln, server, tmp_path):
    job_id = submit(kiln, tmp_path)["job_id"]
    timer = threading.Timer(1.5, lambda: http_json(server, "DELETE", f"/v1/train/queue/{job_id}"))
    timer.start()
    code, out, err = kiln("jobs", "events", job_id, "--follow", "--json", "--poll-interval", "0.2")
    timer.join()
    assert code == 0, err
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds[0] == "queued" and "cancelled" in kinds
    final = http_json(server, "GET", f"/v1/train/jobs/{job_id}/events")["data"]
    assert kinds == [e["kind"] for e in final]  # every event once, nothing after the end missed


# ----- kiln adapters --------------------------------------------------------------------------


def publish_adapter(server: Server, adapter: str, checkpoints=(2,)) -> dict[str, bytes]:
    root = server.settings.adapters_dir / adapter
    root.mkdir(parents=True)
    files = {
        "adapter_config.json": b'{"r": 4}\n',
        "adapter_model.safetensors": os.urandom(3 << 20),
        "adapter_manifest.json": json.dumps({"schema_version": 1, "adapter_name": adapter}).encode(),
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    for step in checkpoints:
        ck = server.settings.adapters_dir / f"{adapter}-checkpoint-step-{step:08d}.kiln-checkpoint"
        ck.mkdir()
        (ck / "manifest.json").write_text("{}")
    with server.sessions.begin() as session:
        register_adapter(
            session, name=adapter, job_id=None, path=str(root), size_bytes=sum(map(len, files.values())),
            safetensors_sha256="sha256:" + "cd" * 32, rank=4, alpha=8.0,
        )  # fmt: skip
    return files


def test_adapters_list_download_extract_delete(kiln, server, tmp_path, monkeypatch):
    adapter = name("ad")
    files = publish_adapter(server, adapter)

    code, out, err = kiln("adapters", "list", "--json")
    assert code == 0, err
    listed = next(a for a in json.loads(out) if a["name"] == adapter)
    assert listed["checkpoints"] == [f"{adapter}-checkpoint-step-00000002.kiln-checkpoint"]
    code, out, _ = kiln("adapters", "list")
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "RANK", "ALPHA", "SIZE", "CREATED", "JOB", "CHECKPOINTS"]
    row = next(r for r in rows if r.startswith(adapter)).split()
    assert row[1:5] == ["4", "8", "3.0", "MiB"] and row[-1] == "1"

    archive = tmp_path / "out.tar.gz"
    code, out, err = kiln("adapters", "download", adapter, "-o", str(archive))
    assert code == 0, err
    assert out.startswith(f"adapter {adapter} saved to {archive}")
    with tarfile.open(archive, "r:gz") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()} == {
            f"{adapter}/{rel}": data for rel, data in files.items()
        }
    code, _out, err = kiln("adapters", "download", adapter, "-o", str(archive))
    assert code == 2 and "--force" in err
    code, _out, err = kiln("adapters", "download", adapter, "-o", str(archive), "--force")
    assert code == 0, err

    monkeypatch.chdir(tmp_path)
    code, out, err = kiln("adapters", "download", adapter, "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "name": adapter,
        "archive": f"{adapter}.tar.gz",
        "bytes": (tmp_path / f"{adapter}.tar.gz").stat().st_size,
    }

    code, out, err = kiln("adapters", "download", adapter, "--extract", str(tmp_path / "unpacked"))
    assert code == 0, err
    target = tmp_path / "unpacked" / adapter
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    assert [p.name for p in (tmp_path / "unpacked").iterdir()] == [adapter]  # no staging left behind
    code, _out, err = kiln("adapters", "download", adapter, "--extract", str(tmp_path / "unpacked"))
    assert code == 2 and "exists" in err
    code, _out, err = kiln("adapters", "download", adapter, "-o", "x.tar.gz", "--extract", "d")
    assert code == 2

    code, out, err = kiln("adapters", "delete", adapter)
    assert code == 0, err
    assert out.splitlines() == [
        f"adapter {adapter} deleted with 1 checkpoint(s)",
        f"  removed {adapter}-checkpoint-step-00000002.kiln-checkpoint",
    ]
    assert not (server.settings.adapters_dir / adapter).exists()
    for args in (
        ("adapters", "delete", adapter),
        ("adapters", "download", adapter, "-o", str(tmp_path / "n")),
    ):
        code, out, err = kiln(*args)
        assert code == 1 and err.startswith("kiln: adapter_not_found (HTTP 404): "), err
    assert not (tmp_path / "n").exists() and not list(tmp_path.glob(".n.*"))  # no partial file


def test_invalid_adapter_name_is_the_servers_400(kiln):
    code, _out, err = kiln("adapters", "delete", "bad name!")
    assert code == 1 and "invalid_adapter_name (HTTP 400)" in err
