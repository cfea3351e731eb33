"""The browser UI: `/` (the page), `/ui/defaults.json` (the form's defaults), `/ui/<file>`."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, send_from_directory

from api.ui import CONTENT_SECURITY_POLICY, STATIC_DIR
from kiln.demo import DEMO_RUN
from kiln_train.optim.kinds import registered
from kiln_train.sft_config import BUILTIN_SMOKE_PROMPTS, MAX_LORA_ALPHA_OVER_RANK, SftConfig

bp = Blueprint("ui", __name__)


@bp.after_request
def _ui_headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-cache"  # revalidate: an upgraded server serves a new UI
    return response


@bp.get("/")
def index() -> Response:
    return send_from_directory(STATIC_DIR, "index.html", mimetype="text/html")


@bp.get("/ui/defaults.json")
def defaults() -> Response:
    """What the SFT form shows before anything is typed: the server's own defaults, and every
    registered optimizer kind with its fields' defaults (the form builds its choices from these)."""
    config = SftConfig().model_dump(mode="json")
    kinds = registered()
    return jsonify(
        {
            "config": config,
            "optimizer_kinds": [e.kind for e in kinds],
            "optimizers": {e.kind: e.default_config().model_dump(mode="json") for e in kinds},
            "learning_rate": {e.kind: e.default_learning_rate for e in kinds},
            "optimizer_titles": {e.kind: e.title for e in kinds},
            # A list per kind, so the form keeps the declaration order (JSON objects here are sorted).
            "optimizer_fields": {
                e.kind: [{"name": n, "type": t} for n, t in e.field_types().items()] for e in kinds
            },
            "builtin_smoke_prompts": list(BUILTIN_SMOKE_PROMPTS),
            "max_lora_alpha_over_rank": MAX_LORA_ALPHA_OVER_RANK,
            # what `kiln demo` trains with, so the form can say how the demo's run differs
            "demo": DEMO_RUN,
        }
    )


@bp.get("/ui/<path:filename>")
def static_file(filename: str) -> Response:
    """A file of the UI (404 envelope for anything else, `..` included)."""
    return send_from_directory(STATIC_DIR, filename)
