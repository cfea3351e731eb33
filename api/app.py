"""The app factory: `create_app(settings, celery=...)` (docs/ARCHITECTURE.md#routes).

Torch-free by construction: the api imports kiln_train's torch-free parts, the store and the
Celery client only (a test checks `torch` never enters `sys.modules`).
"""

from __future__ import annotations

from flask import Flask

from api.auth import install_auth, install_host_check
from api.errors import register_error_handlers
from api.response_headers import install_response_headers
from api.routes import BLUEPRINTS
from api.services import build_services
from kiln.settings import Settings

MIB = 1 << 20


def create_app(settings: Settings | None = None, *, celery=None) -> Flask:
    """Build the api for `settings` (default: the process's kiln.toml / KILN_* settings).

    `celery` is the broker client to publish through (default: `kiln.broker.make_broker_client`).
    """
    if settings is None:
        from kiln.settings import load_settings

        settings = load_settings().settings
    app = Flask("kiln.api", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = int(settings.server.max_request_mb * MIB)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    # No rule may redirect: `/v1/train/jobs/%2F/events` (an id of "/") would merge its slashes
    # and answer 308 to `/v1/train/jobs/events`, another route, with an HTML body. Unmerged, it
    # is the 404 envelope. Set before the rules are added: each rule copies the map's default.
    app.url_map.merge_slashes = False
    app.extensions["kiln"] = build_services(settings, celery)
    register_error_handlers(app)
    install_response_headers(app)
    install_host_check(app, settings.server.allowed_host_names())  # before auth: refused first
    install_auth(app, settings.server.api_tokens)
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    return app
