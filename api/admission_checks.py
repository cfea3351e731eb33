"""Admission's checks of a submission that need no job store: the request's names and lengths
(step 1), the Idempotency-Key and the request's fingerprint (step 2), the output name against
the longest path derived from it, and a warm start's base adapter (step 5).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from api.resume_gate import NAME_MAX_BYTES
from kiln.store import Admission
from kiln_train.artifacts.adapter import ADAPTER_NAME_RE, check_base_adapter_files
from kiln_train.artifacts.digest import json_sha256
from kiln_train.checkpoint.manifest import CHECKPOINT_SUFFIX, checkpoint_dir_name
from kiln_train.checkpoint.publish import staging_dir_name
from kiln_train.errors import TrainingFailure, invalid_request
from kiln_train.model.config import Qwen35Config
from kiln_train.sft_config import SftConfig, SftRequest

IDEMPOTENCY_KEY_MAX = 255
CHECKPOINT_NAME_MARK = "-checkpoint-step-"
DATASET_PATH_MAX = Admission.__table__.c.dataset_path.type.length


def request_fingerprint(body: object) -> str:
    """SHA-256 of the body's canonical JSON: the same request, however it was formatted."""
    return json_sha256(body)


@dataclass(frozen=True)
class IdempotencyKey:
    given: str  # the header, as the caller sent it (named in messages)
    stored: str  # the job row's value: the key itself, or scoped to the caller's token


def scoped_key(key: str, scope: str) -> str:
    """The stored form of `key` for a caller scope ("" on a token-less server: the key itself)."""
    if not scope:
        return key
    return "bearer:" + hmac.new(scope.encode("ascii"), key.encode("ascii"), hashlib.sha256).hexdigest()


def check_idempotency_key(key: str | None, scope: str = "") -> IdempotencyKey | None:
    if key is None:
        return None
    if not key or len(key) > IDEMPOTENCY_KEY_MAX or not key.isascii() or not key.isprintable():
        raise invalid_request(
            f"the Idempotency-Key header must be 1..={IDEMPOTENCY_KEY_MAX} printable ASCII characters"
        )
    return IdempotencyKey(key, scoped_key(key, scope))


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter directory the trainer will write, or None."""
    if not ADAPTER_NAME_RE.fullmatch(name):
        return (
            "must be one path segment of [A-Za-z0-9._-] starting with a letter or digit (at most 255 bytes)"
        )
    if name.endswith(CHECKPOINT_SUFFIX) or CHECKPOINT_NAME_MARK in name:
        return f"must not look like an exact checkpoint (contain {CHECKPOINT_NAME_MARK!r} or end {CHECKPOINT_SUFFIX!r})"
    return None


def check_request_names(config: SftConfig) -> None:
    """Names the worker would refuse only after the queue wait are refused now (step 1)."""
    for field in ("output_name", "base_adapter"):
        name = getattr(config, field)
        if name is None:
            continue
        problem = adapter_name_problem(name)
        if problem is not None:
            raise invalid_request(f"config.{field} {name!r} {problem}")


def check_dataset_path_length(request: SftRequest) -> None:
    """The admission row keeps `dataset_path` verbatim in a bounded column (Postgres would refuse
    a longer one inside the admission transaction; SQLite would silently keep it)."""
    path = request.dataset_path
    if path is not None and len(path) > DATASET_PATH_MAX:
        raise invalid_request(
            f"dataset_path is {len(path)} characters; at most {DATASET_PATH_MAX} are accepted"
        )
    path = request.validation.dataset_path if request.validation is not None else None
    if path is not None and len(path) > DATASET_PATH_MAX:
        raise invalid_request(
            f"validation.dataset_path is {len(path)} characters; at most {DATASET_PATH_MAX} are accepted"
        )


def check_output_name_fits(name: str, total_steps: int) -> None:
    """Every name derived from the adapter's must fit one path segment: the longest is the hidden
    staging directory of its last checkpoint (kiln-contract §5.5)."""
    longest = staging_dir_name(checkpoint_dir_name(name, max(total_steps, 1)))
    if len(longest.encode("utf-8")) > NAME_MAX_BYTES:
        overhead = len(longest) - len(name)
        raise invalid_request(
            f"config.output_name is {len(name)} bytes; with {total_steps} step(s) its checkpoint staging "
            f"directories need {overhead} more bytes and a path segment holds {NAME_MAX_BYTES}: use at "
            f"most {NAME_MAX_BYTES - overhead} bytes"
        )


def check_base_adapter(config: SftConfig, adapters_dir: Path, model: Qwen35Config) -> None:
    """A warm start needs a base adapter in the registry that fits the resident model, the run's
    rank and alpha (adapter_config.json and the safetensors header; no tensor is read). The
    trainer re-checks everything, values and provenance included, at dequeue. A resume ignores
    `base_adapter` (kiln-contract §5), so it is not checked then."""
    name = config.base_adapter
    if name is None or config.resume_checkpoint is not None:
        return
    path = adapters_dir / name
    if not path.is_dir():
        raise invalid_request(f"config.base_adapter {name!r} is not an adapter in the registry")
    try:
        check_base_adapter_files(path, model, config.lora_rank, config.lora_alpha)
    except TrainingFailure as exc:
        raise invalid_request(f"config.base_adapter {name!r}: {exc.message}") from None
