"""Server paths out of error messages: an answer names `<registry>/x`, never `/srv/kiln/adapters/x`.

Messages are written where the failure is understood (the ingestion, a checkpoint reader, a
tokenizer check), often with the path that failed. The caller needs to know which file, not where
the server keeps its storage, so the envelope's message has each known root replaced by a label
before it is sent (docs/security.md#paths-in-answers). Data fields that are paths by contract (an
adapter's `path`) are left as they are: only authenticated callers see those.
"""

from __future__ import annotations

from flask import current_app, has_app_context

LABELS = (
    ("model_path", "<model>"),
    ("adapters_dir", "<registry>"),
    ("datasets_dir", "<datasets>"),
    ("storage_root", "<storage>"),
)


def server_paths(settings) -> list[tuple[str, str]]:
    """(absolute path, label) of the server's roots, the longest first so the most specific wins."""
    pairs = [(str(getattr(settings, attr)), label) for attr, label in LABELS]
    return sorted({(p, label) for p, label in pairs if len(p) > 1}, key=lambda pair: -len(pair[0]))


def redact(text: str, paths: list[tuple[str, str]]) -> str:
    for path, label in paths:
        text = text.replace(path, label)
    return text


def redact_for_app(text: str) -> str:
    """`text` with the roots of the serving app's settings replaced (as is outside an app)."""
    services = current_app.extensions.get("kiln") if has_app_context() else None
    settings = getattr(services, "settings", None)
    return redact(text, server_paths(settings)) if settings is not None else text
