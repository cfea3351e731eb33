"""Runners on SQLite and Postgres: registration, heartbeats, liveness and stop."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kiln.store import get_runner, heartbeat_runner, live_runner, register_runner, states, stop_runner, utcnow

# --- runners -----------------------------------------------------------------------------------


def _register(session, runner_id: str, **overrides):
    fields = dict(
        hostname="gpu-host",
        pid=4242,
        backend="cpu",
        device="cpu",
        base_weight_dtype="f32",
        lora_dtype="f32",
        loss_route="kt_tape_flce",
        optimizer_support={"id": "kiln.training-optimizer-support", "version": 1, "tuples": []},
        execution_identity_digest="sha256:" + "77" * 32,
        model_path="/models/tiny",
        model_config={"hidden_size": 64},
        free_memory_bytes=1 << 30,
        total_memory_bytes=1 << 31,
    )
    fields.update(overrides)
    return register_runner(session, runner_id, **fields)


def test_runner_liveness(factory):
    with factory.begin() as session:
        assert live_runner(session, stale_after_seconds=60) is None
        _register(session, "runner-a")
        _register(session, "runner-boot", state=states.RUNNER_STARTING)
    with factory.begin() as session:
        live = live_runner(session, stale_after_seconds=60)
        assert live.id == "runner-a" and live.optimizer_support["id"] == "kiln.training-optimizer-support"
        assert live_runner(session, stale_after_seconds=60, now=utcnow() + timedelta(seconds=120)) is None
        _register(session, "runner-b", device="cuda:0")
    with factory.begin() as session:
        assert live_runner(session, stale_after_seconds=60).id == "runner-b"  # most recent heartbeat
        assert heartbeat_runner(
            session, "runner-a", free_memory_bytes=5, state=states.RUNNER_BUSY, current_job_id="j"
        )
    with factory.begin() as session:
        live = live_runner(session, stale_after_seconds=60)
        assert (live.id, live.state, live.free_memory_bytes, live.current_job_id) == (
            "runner-a",
            "busy",
            5,
            "j",
        )
        assert heartbeat_runner(session, "runner-a", current_job_id=None)
        assert get_runner(session, "runner-a").current_job_id is None
        assert get_runner(session, "runner-a").free_memory_bytes == 5  # unchanged when not given
        assert stop_runner(session, "runner-a") and stop_runner(session, "runner-b")
        assert stop_runner(session, "nobody") is False
    with factory.begin() as session:
        assert live_runner(session, stale_after_seconds=60) is None
        assert heartbeat_runner(session, "runner-a") is False  # a stopped runner stays stopped
        assert heartbeat_runner(session, "nobody") is False
        with pytest.raises(ValueError, match="runner state"):
            heartbeat_runner(session, "runner-boot", state="dancing")
        again = _register(session, "runner-a", pid=5151)  # a restarted worker re-registers
        assert (again.pid, again.state) == (5151, states.RUNNER_READY)
    with factory() as session:
        assert live_runner(session, stale_after_seconds=60).id == "runner-a"
