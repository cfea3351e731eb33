"""HF/TRL interop routes (`/v1/train/hf/...`): SFT export bundles and PEFT imports; see api.hf."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, request

from api import hf
from api.archive import tar_gz_download
from api.errors import UNSUPPORTED_MEDIA_TYPE, ApiError
from api.http import discard_body, json_body, json_response, read_body, services
from api.routes.adapters import remove_trees
from api.routes.training import admission_slot
from kiln_train.interop.bundle import bundle_dir_name

bp = Blueprint("hf", __name__)

GZIP_HINT = (
    "Send the adapter directory as a gzip tar with `Content-Type: application/gzip` "
    "(curl: --data-binary @adapter.tar.gz -H 'Content-Type: application/gzip'), "
    "or use `kiln train hf import-peft --bundle DIR --name NAME`."
)


@bp.post("/v1/train/hf/sft/exports")
def create_export() -> Response:
    """Build and publish an SFT export bundle; 201 with its description."""
    svc = services()
    with admission_slot(svc):  # ingestion and tokenization: the same cost as a submission
        body, _raw = json_body()
        info = hf.create_export(svc, body)
    return json_response(info, status=201)


@bp.get("/v1/train/hf/exports")
def list_exports() -> Response:
    return json_response(hf.list_exports(services()))


@bp.get("/v1/train/hf/exports/<name>")
def get_export(name: str) -> Response:
    path, manifest = hf.find_export(services(), name)
    return json_response(hf.export_info(path, manifest))


@bp.delete("/v1/train/hf/exports/<name>")
def delete_export(name: str) -> Response:
    svc = services()
    path, _ = hf.find_export(svc, name)
    remove_trees([path], hf.exports_dir(svc))
    return json_response(hf.HfDeletedExport(name=name, status="deleted"))


@bp.get("/v1/train/hf/exports/<name>/download")
def download_export(name: str) -> Response:
    """The bundle as a gzip tar (`NAME.kiln-hf/...`), streamed."""
    path, _ = hf.find_export(services(), name)
    return tar_gz_download(path, bundle_dir_name(name))


@bp.post("/v1/train/hf/peft/imports/<name>")
def import_peft(name: str) -> Response:
    """Check an uploaded PEFT LoRA adapter and register it as adapter `name`; 201."""
    svc = services()
    if request.mimetype not in hf.GZIP_TYPES:
        discard_body()
        raise ApiError(
            UNSUPPORTED_MEDIA_TYPE,
            f"the request body must be a gzip tar (Content-Type: application/gzip), not "
            f"{request.mimetype or 'unlabelled'}",
            hint=GZIP_HINT,
        )
    with admission_slot(svc):
        archive = read_body()
        limit = current_app.config["MAX_CONTENT_LENGTH"] or len(archive)
        answer = hf.import_peft(svc, name, archive, max_bytes=hf.UNPACK_FACTOR * limit)
    return json_response(answer, status=201)
