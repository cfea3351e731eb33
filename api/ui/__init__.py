"""The browser UI's files and the rules its responses follow.

The UI is static: `index.html`, a script, a stylesheet and vendored third-party files under
`static/` (each vendored file's version, source and sha256 in `static/vendor/VENDOR.json`). No
build step, nothing fetched from elsewhere. Its pages carry no data, so they are served without
a token; every piece of data comes from the api with the token the page asks for.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
UI_PREFIX = "/ui/"

# Scripts and styles only from this origin, no inline script or style, no plugins, no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def is_ui_path(path: str) -> bool:
    """The UI's own files (public: they hold no data)."""
    return path == "/" or path.startswith(UI_PREFIX)
