"""Typed service configuration: `kiln.toml` + `KILN_<SECTION>_<FIELD>` + CLI flags (DESIGN §6).

Precedence is CLI > environment > TOML > default. Unknown keys and bad values stop start-up with
the key's path and the reason. Settings are read once, at start, and passed down; nothing deeper
in the code reads the environment. Backend-owned behaviour (SFT loss route, tape, rounding) has
no setting on purpose.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.redact import redact_url

ENV_PREFIX = "KILN_"
CONFIG_ENV = "KILN_CONFIG"
DEFAULT_CONFIG_FILE = "kiln.toml"

# Retired switches of the original; the loader refuses them so a stale service definition is noticed.
RETIRED_ENV = (
    "KILN_USE_FLCE",
    "KILN_BF16_STOCHASTIC_ROUND",
    "KILN_USE_TAPE_FORWARD",
    "KILN_USE_TAPE_FLASH_ATTN",
    "KILN_USE_TAPE_SDPA",
    "KILN_USE_TAPE_LORA_ADD",
    "KILN_USE_TAPE_GDN",
    "KILN_USE_TAPE_GDN_CONV",
    "KILN_USE_TAPE_GDN_QK_NORM",
    "KILN_USE_TAPE_GDN_GATED_NORM",
)

# Environment variables with the KILN_ prefix that are not settings: the client's (README "Client"),
# docker compose's .env interpolation (.env.example) and the test suites'. Not warned about.
NON_SETTING_ENV = (
    CONFIG_ENV,
    "KILN_API_URL",
    "KILN_API_TOKEN",
    "KILN_API_TOKENS",
    "KILN_API_PORT",
    "KILN_MODEL_NAME",
    "KILN_GPU_DEVICE",
    "KILN_TEST_POSTGRES_URL",
)
# Largest integer setting: fits a PostgreSQL integer and any timedelta / sleep (68 years of seconds).
MAX_INT = 2**31 - 1

# A job's lease spans this many heartbeats, so a renewal or two may be late without losing it.
HEARTBEATS_PER_LEASE = 3
_SECTION = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(host: str) -> str:
    """The host of a Host header or an address without its port and IPv6 brackets, lower case."""
    host = host.lower()
    if host.startswith("["):
        inside, bracket, rest = host[1:].partition("]")
        return inside if bracket and (not rest or rest[1:].isdigit() and rest[0] == ":") else host
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:  # an unbracketed IPv6 address keeps its colons
        return name
    return host


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback_host(host: str) -> bool:
    """Whether a bind address is loopback: `localhost` or a loopback IP address, parsed
    (`127.attacker.example` is a name, not 127.0.0.0/8)."""
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


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
        description="A running job whose lease ran out is taken over (resumed or restarted).",
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
        description="Claims of one job (resumes and restarts) before it fails worker_lost.",
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


class ConfigError(Exception):
    """Start-up configuration error: the key's path (or env name) and the reason."""


@dataclass
class LoadedSettings:
    settings: Settings
    sources: dict[str, str] = field(default_factory=dict)  # "section.field" -> where it came from
    config_file: Path | None = None
    warnings: list[str] = field(default_factory=list)  # KILN_ variables that are not settings

    def effective(self) -> list[tuple[str, Any, str]]:
        rows = []
        for section in SECTIONS:
            sec = getattr(self.settings, section)
            for name in type(sec).model_fields:
                key = f"{section}.{name}"
                value = getattr(sec, name)
                if isinstance(value, Path):
                    value = str(value)
                if section == "server" and name == "api_tokens":
                    value = [f"<redacted {len(t)} chars>" for t in value]
                if (section, name) in URL_SETTINGS and value is not None:
                    value = redact_url(value)
                rows.append((key, value, self.sources.get(key, "default")))
        derived = [
            ("derived.storage_root", str(self.settings.storage_root)),
            ("derived.database_url", redact_url(self.settings.database_url)),
            ("derived.broker_url", redact_url(self.settings.broker_url)),
            ("derived.model_path", str(self.settings.model_path)),
        ]
        rows.extend((k, v, "derived") for k, v in derived)
        return rows


def _field_kind(section: str, name: str) -> str:
    ann = str(SECTIONS[section].model_fields[name].annotation)
    if "list" in ann:
        return "list"
    if "bool" in ann:
        return "bool"
    return "scalar"


def _nullable(section: str, name: str) -> bool:
    return SECTIONS[section].model_fields[name].default is None


def _env_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{name.upper()}"


def _parse_env_value(section: str, name: str, raw: str) -> Any:
    kind = _field_kind(section, name)
    env = _env_name(section, name)
    if kind == "list":
        raw = raw.strip()
        if _nullable(section, name) and raw.lower() in ("", "null", "none"):
            return None
        if raw.startswith(("[", "{")):
            try:
                value = json.loads(raw)
            except ValueError as exc:
                raise ConfigError(
                    f"{env}: not a JSON list ({exc}); write a JSON array of strings or comma-separated values"
                ) from None
            if not isinstance(value, list):
                raise ConfigError(
                    f"{env}: a JSON {type(value).__name__} is not a list; write a JSON array of strings or "
                    "comma-separated values"
                )
            return value
        return [p.strip() for p in raw.split(",") if p.strip()]
    if kind == "bool":
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{env}: expected a boolean (true/false, 1/0, yes/no, on/off), got {raw!r}")
    if _nullable(section, name):
        if raw.strip().lower() in ("", "null", "none"):
            return None
    elif not raw.strip():
        default = SECTIONS[section].model_fields[name].get_default(call_default_factory=True)
        raise ConfigError(
            f"{env}: empty value; unset the variable to use the default ({json.dumps(str(default))})"
        )
    return raw


def _setting_env_names() -> list[str]:
    return [_env_name(s, n) for s, model in SECTIONS.items() for n in model.model_fields]


def _env_overrides(
    environ: dict[str, str], warnings: list[str] | None = None
) -> dict[tuple[str, str], tuple[Any, str]]:
    """Settings from KILN_<SECTION>_<FIELD> variables.

    A variable of a known section with an unknown field, or one that is a near miss of a setting's
    name (KILN_SERVR_PORT), stops start-up like an unknown kiln.toml key: it was meant as a setting and
    would otherwise be ignored silently. Any other KILN_ variable that is not a setting is reported
    in `warnings` (it may belong to something else, e.g. a compose file's own variables).
    """
    out: dict[tuple[str, str], tuple[Any, str]] = {}
    names = _setting_env_names()
    for key in sorted(environ):
        if key in RETIRED_ENV:
            raise ConfigError(
                f"{key}: this switch was removed without a replacement (the SFT loss route, tape and "
                "rounding are backend-owned); delete it from the service definition"
            )
        if not key.startswith(ENV_PREFIX) or key in NON_SETTING_ENV:
            continue
        rest = key[len(ENV_PREFIX) :]
        for section in SECTIONS:
            prefix = section.upper() + "_"
            if rest.startswith(prefix):
                name = rest[len(prefix) :].lower()
                if name not in SECTIONS[section].model_fields:
                    raise ConfigError(f"{key}: unknown setting {section}.{name}")
                out[(section, name)] = (_parse_env_value(section, name, environ[key]), f"env:{key}")
                break
        else:
            close = difflib.get_close_matches(key.upper(), names, n=1, cutoff=0.85)
            if close:
                raise ConfigError(f"{key}: not a Kiln setting; did you mean {close[0]}?")
            if warnings is not None:
                warnings.append(f"{key} is not a Kiln setting and is ignored")
    return out


# TOML is typed: a value of the wrong TOML type is refused instead of coerced (port = true is not 1,
# echo = "yes" is not true). Ints are accepted where a float is expected.
_TOML_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "Path": (str,),
    "list[str]": (list,),
}


def _toml_type_error(section: str, name: str, value: Any) -> str | None:
    field_info = SECTIONS[section].model_fields[name]
    ann = str(field_info.annotation)
    base = next(
        (k for k in ("list[str]", "bool", "float", "int", "Path", "str") if k in ann), None
    )  # "bool" before "int": bool is an int in Python
    if base is None or (value is None and field_info.default is None):
        return None
    allowed = _TOML_TYPES[base]
    if isinstance(value, bool) and base != "bool" or not isinstance(value, allowed):
        expected = {
            "list[str]": "an array of strings",
            "Path": "a string (a path)",
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "str": "a string",
        }[base]
        got = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array"}
        got_type = got.get(type(value), f"a {type(value).__name__}")
        return f"expected {expected}, got {got_type} ({value!r})"
    return None


def _toml_values(path: Path) -> dict[tuple[str, str], Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark is tolerated
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    out: dict[tuple[str, str], Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table")
        for name, value in table.items():
            if name not in SECTIONS[section].model_fields:
                raise ConfigError(f"{path}: unknown key {section}.{name}")
            problem = _toml_type_error(section, name, value)
            if problem:
                raise ConfigError(f"{path}: {section}.{name}: {problem}")
            out[(section, name)] = value
    return out


def load_settings(
    config_file: str | Path | None = None,
    *,
    cli: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> LoadedSettings:
    """Build the effective settings; raises ConfigError naming the key and the reason."""
    environ = dict(os.environ if environ is None else environ)
    cwd = cwd or Path.cwd()
    path: Path | None = None
    if config_file is not None:
        path = Path(config_file)
        _check_config_file(f"--config {path}", path)
    elif environ.get(CONFIG_ENV):
        path = Path(environ[CONFIG_ENV])
        _check_config_file(f"{CONFIG_ENV}={path}", path)
    elif (cwd / DEFAULT_CONFIG_FILE).is_file():
        path = cwd / DEFAULT_CONFIG_FILE

    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    sources: dict[str, str] = {}
    if path is not None:
        for (s, n), v in _toml_values(path).items():
            values[s][n] = v
            sources[f"{s}.{n}"] = f"toml:{path}"
    warnings: list[str] = []
    for (s, n), (v, src) in _env_overrides(environ, warnings).items():
        values[s][n] = v
        sources[f"{s}.{n}"] = src
    for dotted, v in (cli or {}).items():
        if v is None:
            continue
        s, _, n = dotted.partition(".")
        if s not in SECTIONS or n not in SECTIONS[s].model_fields:
            raise ConfigError(f"command line: unknown setting {dotted}")
        values[s][n] = v
        sources[dotted] = "cli"
    try:
        settings = Settings.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            origin = sources.get(".".join(str(p) for p in err["loc"][:2]), "default")
            problems.append(f"{loc} ({origin}): {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
    return LoadedSettings(settings=settings, sources=sources, config_file=path, warnings=warnings)


def _check_config_file(what: str, path: Path) -> None:
    if path.is_dir():
        raise ConfigError(f"{what}: is a directory, not a kiln.toml file")
    if not path.is_file():
        raise ConfigError(f"{what}: no such file")


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
