"""Published adapters: list, download (streamed tar.gz), receipt, delete (docs/artifacts.md#peft-adapter).

The `adapters` table is the registry; the files live under `<storage>/adapters/<name>/`, with
exact checkpoints as siblings `<name>-checkpoint-step-<8 digits>.kiln-checkpoint/`
(docs/ARCHITECTURE.md#storage-root).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from pathlib import Path

from flask import Blueprint, Response, current_app

from api import schemas
from api.admission import lock_admissions
from api.archive import tar_gz_download
from api.errors import ADAPTER_ACTIVE, INTERNAL_ERROR, ApiError
from api.http import json_response, services
from api.queries import active_jobs_for_adapter, jobs_warm_starting_from
from api.serializers import adapter_info, read_json_file
from kiln.store import delete_adapter, get_adapter, list_adapters
from kiln.store.errors import ADAPTER_NOT_FOUND
from kiln_train.artifacts.adapter import TRAIN_RECEIPT
from kiln_train.checkpoint import CHECKPOINT_SUFFIX
from kiln_train.errors import INVALID_ADAPTER_NAME, KilnError

log = logging.getLogger(__name__)

bp = Blueprint("adapters", __name__)

ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,255}")
TRASH_PREFIX = ".trash-"


def check_adapter_name(name: str) -> str:
    if not ADAPTER_NAME_RE.fullmatch(name) or name in (".", "..") or name.endswith(CHECKPOINT_SUFFIX):
        raise KilnError(INVALID_ADAPTER_NAME, f"{name!r} is not an adapter name")
    return name


def checkpoint_dirs(adapters_dir: Path, name: str) -> list[Path]:
    """`<name>-checkpoint-step-<digits>.kiln-checkpoint` directories of one adapter, by step."""
    pattern = re.compile(rf"^{re.escape(name)}-checkpoint-step-[0-9]{{8,}}{re.escape(CHECKPOINT_SUFFIX)}$")
    if not adapters_dir.is_dir():
        return []
    return sorted(p for p in adapters_dir.iterdir() if pattern.match(p.name))


def _require_adapter(name: str):
    check_adapter_name(name)
    with services().sessions() as session:
        adapter = get_adapter(session, name)
    if adapter is None:
        raise KilnError(ADAPTER_NOT_FOUND, f"no adapter named {name!r}")
    return adapter


@bp.get("/v1/adapters")
def list_view() -> Response:
    svc = services()
    with svc.sessions() as session:
        adapters = list_adapters(session)
    root = svc.settings.adapters_dir
    return json_response(
        schemas.AdapterList(
            adapters=[adapter_info(a, [p.name for p in checkpoint_dirs(root, a.name)]) for a in adapters]
        )
    )


@bp.get("/v1/adapters/<name>/download")
def download(name: str) -> Response:
    """The adapter directory as a gzip tar (`<name>/adapter_model.safetensors`, ...), streamed."""
    adapter = _require_adapter(name)
    root = Path(adapter.path)
    if not root.is_dir():
        raise KilnError(
            ADAPTER_NOT_FOUND, f"adapter {name!r} is registered but its directory {root} is missing"
        )
    return tar_gz_download(root, name)


@bp.get("/v1/adapters/<name>/receipt")
def receipt(name: str) -> Response:
    """The adapter's `train_receipt.json`, as written by the trainer."""
    adapter = _require_adapter(name)
    path = Path(adapter.path) / TRAIN_RECEIPT
    value, error = read_json_file(path)
    if value is None:
        raise KilnError(ADAPTER_NOT_FOUND, error or f"adapter {name!r} has no {TRAIN_RECEIPT}")
    # Served from what was parsed (one read: the file may go between two), as strict JSON.
    try:
        body = json.dumps(value, ensure_ascii=False, allow_nan=False, indent=2)
    except ValueError:
        raise ApiError(
            INTERNAL_ERROR, f"adapter {name!r}: {TRAIN_RECEIPT} holds NaN or Infinity, which is not JSON"
        ) from None
    return current_app.response_class(body, mimetype="application/json")


@bp.delete("/v1/adapters/<name>")
def delete(name: str) -> Response:
    """Delete an idle adapter and its exact checkpoints; 409 `adapter_active` while a queued or
    running job targets it or warm-starts from it."""
    check_adapter_name(name)
    svc = services()
    with svc.sessions.begin() as session:
        lock_admissions(session)  # no admission may target the name while it is being removed
        active = active_jobs_for_adapter(session, name)
        if active:
            raise KilnError(ADAPTER_ACTIVE, f"job {active[0]} targets adapter {name!r}")
        readers = jobs_warm_starting_from(session, name)
        if readers:
            raise KilnError(
                ADAPTER_ACTIVE, f"job {readers[0]} warm-starts from adapter {name!r} (config.base_adapter)"
            )
        adapter = delete_adapter(session, name)
        adapter_dir = Path(adapter.path)
    root = svc.settings.adapters_dir
    removed = checkpoint_dirs(root, name)
    remove_trees([adapter_dir, *removed], root)
    return json_response(
        schemas.DeletedAdapter(name=name, status="deleted", removed_checkpoints=[p.name for p in removed])
    )


def remove_trees(paths: list[Path], root: Path) -> None:
    """Move each directory into a hidden trash dir (one rename each, so a reader never sees half a
    directory), then delete the trash."""
    trash = root / f"{TRASH_PREFIX}{uuid.uuid4().hex}"
    trash.mkdir(parents=True)
    try:
        for path in paths:
            if not path.exists():
                continue
            try:
                path.rename(trash / path.name)
            except OSError:  # outside the registry's filesystem: delete in place
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(trash, ignore_errors=True)
