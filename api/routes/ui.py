"""The browser UI: `/` (the page), `/ui/defaults.json` (the form's defaults), `/ui/<file>`."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, send_from_directory

from api.ui import CONTENT_SECURITY_POLICY, STATIC_DIR
from kiln.demo import DEMO_RUN
from kiln_train.sft_config import (
    BUILTIN_SMOKE_PROMPTS,
    MAX_LORA_ALPHA_OVER_RANK,
    OPTIMIZER_KINDS,
    SFT_DEFAULT_LEARNING_RATE,
    AdamWConfig,
    MuonConfig,
    SftConfig,
    SgdConfig,
)

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
    """What the SFT form shows before anything is typed: the server's own defaults."""
    config = SftConfig().model_dump(mode="json")
    optimizers = {
        "muon": MuonConfig(kind="muon").model_dump(mode="json"),
        "adam_w": AdamWConfig(kind="adam_w").model_dump(mode="json"),
        "sgd": SgdConfig(kind="sgd").model_dump(mode="json"),
    }
    return jsonify(
        {
            "config": config,
            "optimizer_kinds": list(OPTIMIZER_KINDS),
            "optimizers": optimizers,
            "learning_rate": SFT_DEFAULT_LEARNING_RATE,
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
