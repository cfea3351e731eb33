"""Admission's checks of a submission that only the service makes: the `dataset_path` length
(step 1), the Idempotency-Key and the request's fingerprint (step 2). The checks a library run
makes too (names, static gates, the base adapter) live in `kiln_train/plan/names.py` and
`kiln_train/plan/gates.py`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from api.request_bounds import check_example_sizes
from kiln.store import Admission
from kiln_train.errors import invalid_request
from kiln_train.ground.digest import json_sha256
from kiln_train.sft_config import SftRequest

IDEMPOTENCY_KEY_MAX = 255
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


def check_example_lengths(request: SftRequest) -> None:
    """Each inline example (training and validation) within the size of one JSON Lines row."""
    check_example_sizes(request.examples, "examples")
    check_example_sizes(
        request.validation.examples if request.validation is not None else None, "validation.examples"
    )


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
