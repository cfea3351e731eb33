"""`GET /metrics`: Prometheus text with admission counters/latency and the store's gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import sft_body


def _samples(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.content_type.startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_admissions_and_read_the_store(client, runner):
    assert client.post("/v1/train/sft", json=sft_body(1)).status_code == 200
    assert client.post("/v1/train/sft", json=sft_body(1, lora_alpha=64.0)).status_code == 400
    samples = _samples(client)
    assert samples[("kiln_admissions_total", (("code", ""), ("outcome", "admitted")))] == 1
    assert (
        samples[("kiln_admissions_total", (("code", "training_invalid_request"), ("outcome", "rejected")))]
        == 1
    )
    assert samples[("kiln_admission_seconds_count", ())] == 2
    assert samples[("kiln_jobs", (("state", "queued"),))] == 1
    assert samples[("kiln_jobs", (("state", "running"),))] == 0
    assert samples[("kiln_queue_depth", ())] == 1
    assert samples[("kiln_jobs_unpublished", ())] == 0
    assert samples[("kiln_runner_up", ())] == 1
    assert 0 <= samples[("kiln_runner_heartbeat_age_seconds", ())] < 60


def test_metrics_without_a_runner(client):
    samples = _samples(client)
    assert samples[("kiln_runner_up", ())] == 0
    assert ("kiln_runner_heartbeat_age_seconds", ()) not in samples
    assert samples[("kiln_queue_depth", ())] == 0
