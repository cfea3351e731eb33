"""What one api process holds: settings, the job store, the broker, the admission slots, the
tokenizer cache, metrics.

Built once by `create_app` and kept in `app.extensions["kiln"]`; views reach it through
`api.http.services()`. Nothing here reads the environment: the settings object is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.admission_slots import AdmissionSlots
from api.metrics import Metrics
from api.tokenizer_cache import PROCESS_TOKENIZERS, TokenizerCache
from kiln.broker import make_broker_client
from kiln.settings import Settings
from kiln.store import make_engine, session_factory


@dataclass
class Services:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    celery: Any  # celery.Celery: the broker client (kiln.broker.make_broker_client)
    admission_slots: AdmissionSlots  # submissions validated and tokenized at once, server-wide
    tokenizers: TokenizerCache = field(default_factory=lambda: PROCESS_TOKENIZERS)
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()


def build_services(settings: Settings, celery: Any | None = None) -> Services:
    """Open the job store and the broker client for `settings`."""
    settings.ensure_dirs()
    engine = make_engine(
        settings.database_url,
        echo=settings.database.echo,
        idle_in_transaction_timeout_seconds=settings.training.lease_seconds,  # kiln/store/engine.py
    )
    if celery is None:
        celery = make_broker_client(settings)
    return Services(
        settings=settings,
        engine=engine,
        sessions=session_factory(engine),
        celery=celery,
        admission_slots=AdmissionSlots(settings.storage_root, settings.server.max_concurrent_admissions),
    )
