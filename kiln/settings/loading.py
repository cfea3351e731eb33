"""Loading the settings: `kiln.toml`, then `KILN_<SECTION>_<FIELD>` overrides, then CLI flags,
each value checked with the key's path in the error, and where every value came from."""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.redact import redact_url
from kiln.settings.errors import ConfigError
from kiln.settings.sections import SECTIONS, URL_SETTINGS, Settings

ENV_PREFIX = "KILN_"
CONFIG_ENV = "KILN_CONFIG"
DEFAULT_CONFIG_FILE = "kiln.toml"

# Retired switches of the Rust implementation; the loader refuses them so a stale service definition
# is noticed.
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
    "KILN_TEST_REDIS",
)


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
