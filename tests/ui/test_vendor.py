"""Vendored front-end files are exactly what VENDOR.json records (pinned version, sha256), with
their licence beside them, and the api serves them byte for byte."""

from __future__ import annotations

import hashlib
import json

from api.ui import STATIC_DIR

VENDOR = STATIC_DIR / "vendor"


def manifest() -> dict:
    return json.loads((VENDOR / "VENDOR.json").read_text(encoding="utf-8"))


def test_every_vendored_file_matches_its_recorded_checksum():
    packages = manifest()["packages"]
    assert [(p["name"], p["version"]) for p in packages] == [("uplot", "1.6.32")]
    recorded = set()
    for package in packages:
        assert package["license"] and package["tarball_integrity"].startswith("sha512-")
        for name, entry in package["files"].items():
            data = (VENDOR / name).read_bytes()
            assert "sha256:" + hashlib.sha256(data).hexdigest() == entry["sha256"], name
            recorded.add(name)
    assert recorded | {"VENDOR.json"} == {p.name for p in VENDOR.iterdir()}  # nothing unrecorded
    assert "MIT License" in (VENDOR / "uPlot.LICENSE").read_text()
    assert (
        (VENDOR / "uPlot.iife.min.js")
        .read_text()
        .startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    )


def test_the_api_serves_the_vendored_files_unchanged(tmp_path):
    from api import create_app
    from kiln.settings import Settings

    app = create_app(Settings.model_validate({"storage": {"root": str(tmp_path)}}))
    try:
        client = app.test_client()
        for name in manifest()["packages"][0]["files"]:
            response = client.get(f"/ui/vendor/{name}")
            assert response.status_code == 200 and response.data == (VENDOR / name).read_bytes(), name
        page = client.get("/")
        assert page.status_code == 200 and b"/ui/vendor/uPlot.iife.min.js" in page.data
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert client.get("/ui/../pyproject.toml").status_code == 404
    finally:
        app.extensions["kiln"].close()
