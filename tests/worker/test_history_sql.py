"""SQL over job history seeded by the real service: jobs admitted over HTTP and run by the
worker runtime, then the documented queries of deploy/queries.sql and the views, on SQLite and
Postgres."""

from __future__ import annotations

from sqlalchemy import text

from kiln import store
from tests.api.conftest import sft_body, unique_name
from tests.deploy.queries_sql import QUERIES


def submit(client, body) -> str:
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 200, response.get_json()
    return response.get_json()["job_id"]


def query(engine, name: str, **params) -> list[dict]:
    with engine.connect() as connection:
        return [dict(r._mapping) for r in connection.execute(text(QUERIES[name][1]), params)]


def test_people_questions_answered_from_service_history(client, runtime, engine, sessions):
    done_a = submit(client, sft_body(3, epochs=2, output_name=unique_name("a"), lora_rank=4))
    assert runtime.run_job(done_a) == "completed"
    done_b = submit(client, sft_body(2, output_name=unique_name("b"), lora_rank=8, lora_alpha=16.0))
    assert runtime.run_job(done_b) == "completed"
    cancelled = submit(client, sft_body(2))
    assert client.delete(f"/v1/train/queue/{cancelled}").status_code == 200
    waiting = submit(client, sft_body(2))

    curve = query(engine, "loss_curve", job_id=done_a)
    with sessions() as s:
        recorded = [(r.global_step, r.loss) for r in store.loss_history(s, done_a)]
    assert [(r["global_step"], r["loss"]) for r in curve] == recorded and len(curve) == 6

    by_rank = {r["lora_rank"]: r for r in query(engine, "mean_step_time_by_rank")}
    assert by_rank[4]["steps"] == 6 and by_rank[8]["steps"] == 2
    assert by_rank[4]["jobs"] == 1 and by_rank[4]["mean_step_ms"] > 0

    failures = {r["failure_reason"]: r["jobs"] for r in query(engine, "failures_by_reason")}
    assert failures == {"cancelled": 1}

    assert [r["job_id"] for r in query(engine, "queue")] == [waiting]

    with engine.connect() as connection:
        history = {
            r.job_id: r
            for r in connection.execute(
                text("SELECT job_id, state, lora_rank, final_loss FROM v_job_history")
            )
        }
    assert history[done_a].state == "completed" and history[done_a].final_loss == recorded[-1][1]
    assert history[cancelled].state == "failed" and history[waiting].state == "queued"
