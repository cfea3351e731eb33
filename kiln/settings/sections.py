"""The typed settings: one pydantic model per `kiln.toml` section, and `Settings` holding them
with the values derived from them (paths, default URLs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.settings.broker_url import kombu_url
from kiln.settings.errors import ConfigError
from kiln.settings.hosts import _HOST_NAME, LOOPBACK_NAMES, _is_ip, host_name, is_loopback_host

# Largest integer setting: fits a PostgreSQL integer and any timedelta / sleep (68 years of seconds).
MAX_INT = 2**31 - 1

# A job's lease spans this many heartbeats, so a renewal or two may be late without losing it.
HEARTBEATS_PER_LEASE = 3
_SECTION = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _not_blank(v: Any) -> Any:
    """A text setting (host, queue, URL, path) given as blank or with a NUL is a mistake, not a value.

    Runs before type validation: pydantic would turn "" into Path(".") (the working directory).
    """
    if isinstance(v, str) and not v.strip():
        raise ValueError("must not be blank (leave it out for the default)")
    if isinstance(v, str) and "\x00" in v:
        raise ValueError("must not contain a NUL character")
    return v


class ServerSettings(BaseModel):
    model_config = _SECTION
    host: str = Field("127.0.0.1", description="Address the HTTP api binds to.")
    port: int = Field(8420, ge=1, le=65535, description="TCP port of the HTTP api.")
    api_tokens: list[str] = Field(
        default_factory=list,
        description="Bearer tokens accepted by the api; empty means no auth (loopback only).",
    )
    allow_unauthenticated_remote: bool = Field(
        False, description="Permit binding a non-loopback address without api_tokens."
    )
    max_request_mb: float = Field(64.0, gt=0, description="Largest accepted request body, in MiB.")
    workers: int = Field(2, ge=1, le=64, description="gunicorn worker processes for `kiln serve`.")
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host header names a token-less api answers (DNS-rebinding guard; any port); "
        'null: localhost, 127.0.0.1, ::1 and server.host on a loopback bind, any elsewhere; "*": any.',
    )
    max_concurrent_admissions: int = Field(
        1,
        ge=1,
        le=64,
        description="Submissions the api validates and tokenizes at once (all `kiln serve` worker "
        "processes together); beyond it 503 admission_busy.",
    )

    _host = field_validator("host", mode="before")(_not_blank)

    @field_validator("allowed_hosts")
    @classmethod
    def _allowed_hosts(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v:
            raise ValueError(
                'must name at least one host (["*"] accepts any Host; leave it out for the default)'
            )
        names = []
        for entry in v:
            name = host_name(entry.strip())
            if name != "*" and not _HOST_NAME.fullmatch(name) and not _is_ip(name):
                raise ValueError(f"{entry!r} is not a host name or IP address (no scheme, no port)")
            names.append(name)
        return names

    @field_validator("api_tokens")
    @classmethod
    def _tokens(cls, v: list[str]) -> list[str]:
        for i, t in enumerate(v):
            if not t.strip():
                raise ValueError("api tokens must not be blank")
            # The token travels as `Authorization: Bearer <token>`: the api strips the header value and
            # reads it as latin-1, so whitespace or non-ASCII in a token makes it impossible to present.
            if not all(33 <= ord(c) <= 126 for c in t):
                raise ValueError(
                    f"api token {i + 1} must be printable ASCII without spaces (it is sent in an "
                    "Authorization: Bearer header)"
                )
            if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
                raise ValueError(
                    f"api token {i + 1} is wrapped in quotes, which would be part of the token; remove them "
                    "(an env file passed to docker keeps quotes literally)"
                )
        return v

    def allowed_host_names(self) -> frozenset[str] | None:
        """The Host names the api answers, or None for any: with api tokens a page elsewhere
        cannot authenticate, and an unauthenticated remote bind without a list was chosen open."""
        if self.api_tokens:
            return None
        names = self.allowed_hosts
        if names is None:
            if not is_loopback_host(self.host):
                return None
            names = [*LOOPBACK_NAMES, host_name(self.host)]
        return None if "*" in names else frozenset(names)


class DatabaseSettings(BaseModel):
    model_config = _SECTION
    url: str | None = Field(
        None,
        description="SQLAlchemy URL; default SQLite at <storage.root>/kiln.db. "
        "Production: postgresql+psycopg://user:pass@host/db.",
    )
    echo: bool = Field(False, description="Log every SQL statement.")

    _url_text = field_validator("url", mode="before")(_not_blank)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        # Only the form is checked here; an unknown dialect or driver is named when the database is
        # opened (`kiln serve`, `kiln worker`, `kiln db upgrade`).
        try:
            make_url(v)
        except ArgumentError:
            raise ValueError(
                "not a SQLAlchemy URL (dialect+driver://user:password@host/database, e.g. "
                "postgresql+psycopg://kiln:secret@db/kiln or sqlite:////var/lib/kiln/kiln.db)"
            ) from None
        return v


class QueueSettings(BaseModel):
    model_config = _SECTION
    broker_url: str | None = Field(
        None,
        description="Celery broker URL; default a local SQLite-backed broker under the storage root. "
        "Production: redis://host:6379/0.",
    )
    queue_name: str = Field("gpu", min_length=1, description="Celery queue the GPU worker consumes.")
    visibility_timeout_s: int = Field(
        172800, ge=60, le=MAX_INT, description="Redis visibility timeout; must exceed the longest job."
    )

    _text = field_validator("broker_url", "queue_name", mode="before")(_not_blank)

    @field_validator("broker_url")
    @classmethod
    def _broker(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from kombu.transport import TRANSPORT_ALIASES

        scheme, sep, _ = v.partition("://")
        if not sep:
            raise ValueError("not a broker URL (transport://..., e.g. redis://host:6379/0)")
        if scheme.partition("+")[0] not in TRANSPORT_ALIASES:
            raise ValueError(f"unknown broker transport {scheme!r} (use redis://host:6379/0)")
        kombu_url(v)  # a password given twice stops start-up here, not in the worker
        return v


class StorageSettings(BaseModel):
    model_config = _SECTION
    root: Path = Field(
        Path(".kiln"),
        description="Shared storage root: adapters/, datasets/, models/ (and the default SQLite files).",
    )

    _root = field_validator("root", mode="before")(_not_blank)


class ModelSettings(BaseModel):
    model_config = _SECTION
    path: Path | None = Field(
        None, description="Hugging Face Qwen3.5 checkpoint directory; default <storage.root>/models/default."
    )
    device: str = Field("cpu", description="Device of the resident model: cpu, cuda or cuda:N.")

    _path = field_validator("path", mode="before")(_not_blank)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and v != "cuda" and not (v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError("device must be cpu, cuda or cuda:N")
        return v


class TrainingSettings(BaseModel):
    model_config = _SECTION
    checkpoint_interval: int | None = Field(
        None,
        le=MAX_INT,
        ge=1,
        description="Default exact-checkpoint interval (steps) when a request omits it.",
    )
    max_queued_jobs: int = Field(
        32, le=MAX_INT, ge=1, description="Queued jobs beyond this get 503 training_queue_full."
    )
    max_tracked_jobs: int = Field(
        1024, le=MAX_INT, ge=1, description="Non-deleted jobs kept before 503 training_tracked_full."
    )
    lease_seconds: int = Field(
        120,
        le=MAX_INT,
        ge=5,
        description="A running job whose lease ran out is taken over (resumed or restarted); on "
        "Postgres also the longest a transaction may sit idle before the server ends it.",
    )
    heartbeat_seconds: float = Field(
        5.0, gt=0, le=MAX_INT, description="Runner and job heartbeat period; at most lease_seconds / 3."
    )
    runner_stale_seconds: int = Field(
        60, le=MAX_INT, ge=5, description="A runner silent this long is not alive; at least two heartbeats."
    )
    reconcile_interval_seconds: float = Field(
        30.0, gt=0, le=MAX_INT, description="Period of the worker's reconciler."
    )
    max_attempts: int = Field(
        3,
        le=MAX_INT,
        ge=1,
        description="Ended deliveries of one job that made no progress before it fails worker_lost.",
    )

    @model_validator(mode="after")
    def _timings_agree(self) -> TrainingSettings:
        """A lease must outlive a few missed heartbeats, and a runner is only judged silent after
        it missed at least one: otherwise a live worker's jobs are taken from it and run twice."""
        beats = HEARTBEATS_PER_LEASE
        if self.heartbeat_seconds * beats > self.lease_seconds:
            raise ValueError(
                f"heartbeat_seconds ({self.heartbeat_seconds:g}) must be at most lease_seconds / {beats} "
                f"({self.lease_seconds / beats:g}): a lease that a single late heartbeat lets expire "
                "hands a live worker's job to another one"
            )
        if self.runner_stale_seconds < 2 * self.heartbeat_seconds:
            raise ValueError(
                f"runner_stale_seconds ({self.runner_stale_seconds}) must be at least twice "
                f"heartbeat_seconds ({self.heartbeat_seconds:g}): a runner is silent only after it "
                "missed a heartbeat"
            )
        return self


class MemorySettings(BaseModel):
    model_config = _SECTION
    reserve_gb: float = Field(1.0, ge=0, description="GiB kept free beside the training estimate.")
    training_memory_gb: float | None = Field(
        None, gt=0, description="Cap on the GiB training may use, below what the device reports."
    )


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server: ServerSettings = Field(default_factory=ServerSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)

    # ----- derived values -------------------------------------------------------------
    @property
    def storage_root(self) -> Path:
        return self.storage.root.expanduser().resolve()

    @property
    def database_url(self) -> str:
        return self.database.url or f"sqlite:///{self.storage_root / 'kiln.db'}"

    @property
    def broker_url(self) -> str:
        return self.queue.broker_url or f"sqla+sqlite:///{self.storage_root / 'broker.db'}"

    @property
    def model_path(self) -> Path:
        return (self.model.path or self.storage_root / "models" / "default").expanduser().resolve()

    @property
    def adapters_dir(self) -> Path:
        return self.storage_root / "adapters"

    @property
    def datasets_dir(self) -> Path:
        return self.storage_root / "datasets"

    def ensure_dirs(self) -> None:
        for d in (self.storage_root, self.adapters_dir, self.datasets_dir, self.storage_root / "models"):
            d.mkdir(parents=True, exist_ok=True)


# Settings holding a connection URL: shown only through `redact_url`.
URL_SETTINGS = (("database", "url"), ("queue", "broker_url"))

SECTIONS: dict[str, type[BaseModel]] = {
    name: f.annotation  # type: ignore[misc]
    for name, f in Settings.model_fields.items()
}


def check_bind_safety(settings: Settings) -> None:
    """Refuse to serve a non-loopback address without tokens unless explicitly allowed."""
    host = settings.server.host
    if (
        not is_loopback_host(host)
        and not settings.server.api_tokens
        and not settings.server.allow_unauthenticated_remote
    ):
        raise ConfigError(
            f"server.host={host} is not a loopback address and server.api_tokens is empty; set "
            "KILN_SERVER_API_TOKENS or server.allow_unauthenticated_remote=true"
        )
