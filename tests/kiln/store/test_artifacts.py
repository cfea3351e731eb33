"""Adapters in the store on SQLite and Postgres: register, list, delete, and names reused."""

from __future__ import annotations

import pytest

from kiln.store import delete_adapter, get_adapter, list_adapters, register_adapter
from kiln.store.errors import ADAPTER_NOT_FOUND
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError
from tests.kiln.store.store_support import running_job

# --- artifacts ---------------------------------------------------------------------------------


def test_adapters_register_list_delete_and_reuse_names(factory):
    job = running_job(factory)
    fields = dict(path="/s/adapters/bot", size_bytes=2048, safetensors_sha256="sha256:" + "11" * 32, rank=8)
    with factory.begin() as session:
        register_adapter(session, name="bot", job_id=job.id, alpha=16.0, **fields)
        register_adapter(session, name="bot-2", job_id=None, alpha=8.0, **fields)
        with pytest.raises(KilnError) as caught:
            register_adapter(session, name="bot", job_id=None, alpha=1.0, **fields)
        assert caught.value.code == ADAPTER_ALREADY_EXISTS
    with factory.begin() as session:
        assert {a.name for a in list_adapters(session)} == {"bot", "bot-2"}
        assert get_adapter(session, "bot").job_id == job.id
        delete_adapter(session, "bot")
        assert get_adapter(session, "bot") is None
        assert [a.name for a in list_adapters(session)] == ["bot-2"]
        with pytest.raises(KilnError) as caught:
            delete_adapter(session, "bot")
        assert caught.value.code == ADAPTER_NOT_FOUND
        reborn = register_adapter(session, name="bot", job_id=None, alpha=4.0, **fields)
        assert reborn.deleted_at is None and reborn.alpha == 4.0
