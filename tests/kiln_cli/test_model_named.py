"""The CLI names the model a job trains on: in the admission `kiln train sft` prints and in
`kiln jobs show`, saying when it is a random checkpoint Kiln drew."""

from __future__ import annotations

from tests.api.conftest import example
from tests.kiln_cli.api_server import write_jsonl


def test_the_admission_and_the_job_name_the_random_model(kiln, server, tmp_path, runner_kwargs):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1), example(2)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--epochs", "1", "--rank", "4", "--alpha", "8", "--no-wait"
    )
    assert code == 0, err
    expected = f"{runner_kwargs['model_path']} (a random tiny checkpoint: the mechanics, not a useful model)"
    model_lines = [line.strip() for line in out.splitlines() if line.strip().startswith("model ")]
    assert model_lines == [f"model            {expected}"], out
    job_id = out.split()[1]
    code, out, err = kiln("jobs", "show", job_id)
    assert code == 0, err
    assert any(
        line.strip().startswith("model") and line.strip().endswith(expected) for line in out.splitlines()
    ), out
