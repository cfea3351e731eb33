"""`GET /v1/checkpoints`: the exact checkpoints in the adapter registry, published adapter or not.

A run that failed or was cancelled publishes no adapter but keeps its checkpoints; this is where
a client finds what `config.resume_checkpoint` can name. Each is read from its manifest only
(api.serializers.checkpoint_summary), never re-hashed.
"""

from __future__ import annotations

import re

from flask import Blueprint, Response, request

from api.http import json_response, services
from api.routes.adapters import check_adapter_name
from api.schemas import CheckpointEntry, CheckpointList
from api.serializers import checkpoint_summary
from kiln_train.checkpoint import CHECKPOINT_SUFFIX

bp = Blueprint("checkpoints", __name__)

CHECKPOINT_DIR_RE = re.compile(
    rf"^(?P<adapter>.+)-checkpoint-step-(?P<step>[0-9]{{8,}}){re.escape(CHECKPOINT_SUFFIX)}$"
)


@bp.get("/v1/checkpoints")
def list_view() -> Response:
    """Exact checkpoints by adapter, then step (`?adapter=NAME` for one adapter's)."""
    adapter = request.args.get("adapter")
    if adapter is not None:
        check_adapter_name(adapter)
    root = services().settings.adapters_dir
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = CHECKPOINT_DIR_RE.match(path.name)
        if match is None or not path.is_dir() or (adapter is not None and match["adapter"] != adapter):
            continue
        summary, error = checkpoint_summary(path)
        found.append(
            CheckpointEntry(
                adapter_name=match["adapter"],
                resume_checkpoint=path.name,
                global_step=int(match["step"]),
                summary=summary,
                error=error,
            )
        )
    found.sort(key=lambda e: (e.adapter_name, e.global_step))
    return json_response(CheckpointList(checkpoints=found))
