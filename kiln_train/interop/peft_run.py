"""Check 4 of a PEFT import: the run that made the adapter belongs here (docs/interop.md#import).

When the upload holds `kiln_hf_result.json`: a finished run (`kiln.hf-trl-result.v1`), whose
recorded adapter file hashes are the uploaded files', whose export (by bundle digest) is one this
server published or the uploaded `kiln_hf_export.json`, run by that bundle's own `train.py`, on
the rank, alpha and targets the adapter claims, with the base model, tokenizer and training
template identities of the resident runner.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln_train.artifacts.adapter import ADAPTER_CONFIG, ADAPTER_MODEL
from kiln_train.ground import json_bounded
from kiln_train.ground.digest import sha256_prefixed
from kiln_train.interop.bundle import EXPORT_SCHEMA, MANIFEST, RUNNER_FILE, ResidentFacts, manifest_digest
from kiln_train.interop.errors import import_invalid, import_mismatch
from kiln_train.interop.peft_upload import RESULT_FILE, Upload

RESULT_SCHEMA = "kiln.hf-trl-result.v1"
RUN_ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_MODEL)


def _json_file(upload: Upload, name: str) -> dict:
    try:
        value = json_bounded.loads(upload.files[name])
    except (UnicodeDecodeError, ValueError) as exc:
        raise import_invalid(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise import_invalid(f"{name} is not a JSON object")
    return value


def get_path(obj: dict, path: str):
    """The member at the dotted `path` of nested objects, or None where one is missing."""
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def check_run(
    upload: Upload,
    resident: ResidentFacts,
    rank: int,
    alpha: float,
    targets: list[str],
    find_export: Callable[[str], dict | None],
) -> tuple[dict, dict]:
    """(result, export manifest) of a run whose manifest vouches for the upload on this server."""
    result = _finished_result(upload)
    export = _export_of(upload, get_path(result, "export.bundle_digest"), find_export)
    files = export.get("files") if isinstance(export.get("files"), dict) else {}
    entry = files.get(RUNNER_FILE)
    script = entry.get("sha256") if isinstance(entry, dict) else None
    if get_path(result, "script.sha256") != script:
        raise import_mismatch(
            f"the run executed a train.py with sha256 {get_path(result, 'script.sha256')}, the export's is {script}"
        )
    _check_identities(result, export, resident)
    _check_lora_claims(result, export, rank, alpha, targets)
    return result, export


def _finished_result(upload: Upload) -> dict:
    """The run's result manifest, for a run that finished and left the uploaded adapter files."""
    result = _json_file(upload, RESULT_FILE)
    if result.get("schema") != RESULT_SCHEMA:
        raise import_invalid(f"{RESULT_FILE}: schema is {result.get('schema')!r}, not {RESULT_SCHEMA}")
    if result.get("status") != "success":
        raise import_invalid(
            f"{RESULT_FILE}: the run did not finish ({result.get('message') or result.get('status')})"
        )
    recorded = result.get("adapter") if isinstance(result.get("adapter"), dict) else {}
    for name in RUN_ADAPTER_FILES:
        got = sha256_prefixed(upload.files[name])
        if recorded.get(name) != got:
            raise import_mismatch(
                f"{name} has sha256 {got}, but the run recorded {recorded.get(name)} in {RESULT_FILE}: the file was "
                "changed after training"
            )
    return result


def _export_of(upload: Upload, digest, find_export: Callable[[str], dict | None]) -> dict:
    """The export manifest the run names: the uploaded one (intact), or one this server published."""
    if MANIFEST in upload.files:
        export = _json_file(upload, MANIFEST)
        if export.get("schema") != EXPORT_SCHEMA or manifest_digest(export) != export.get("bundle_digest"):
            raise import_mismatch(
                f"the uploaded {MANIFEST} does not recompute to its bundle_digest: it was changed"
            )
        if export.get("bundle_digest") != digest:
            raise import_mismatch(
                f"{RESULT_FILE} names export {digest}, the uploaded {MANIFEST} is {export.get('bundle_digest')}"
            )
        return export
    export = find_export(digest) if isinstance(digest, str) else None
    if export is None:
        raise import_mismatch(
            f"{RESULT_FILE} names export bundle_digest {digest}, which is no export of this server; upload "
            f"the bundle's {MANIFEST} with the adapter"
        )
    return export


def _recorded(result: dict, export: dict, path: str) -> tuple[tuple[str, object], ...]:
    """(where, value) of `path` in the run's result and in its export manifest, in that order."""
    return ((RESULT_FILE, get_path(result, path)), (f"the export's {MANIFEST}", get_path(export, path)))


def _check_identities(result: dict, export: dict, resident: ResidentFacts) -> None:
    pairs = (
        ("base_model.model_config_sha256", resident.identity["model_config_sha256"]),
        ("base_model.base_weights_sha256", resident.base_weights_sha256),
        ("tokenizer.tokenizer_vocab_sha256", resident.identity["tokenizer_vocab_sha256"]),
        ("template.training_chat_template_sha256", resident.identity["training_chat_template_sha256"]),
    )
    for path, pinned in pairs:
        for source, value in _recorded(result, export, path):
            if value != pinned:
                raise import_mismatch(
                    f"{source}: {path} is {value}, the resident runner's is {pinned}: the adapter was trained "
                    f"against another {path.split('.')[0].replace('_', ' ')}"
                )


def _check_lora_claims(result: dict, export: dict, rank: int, alpha: float, targets: list[str]) -> None:
    claims = (
        ("lora.rank", lambda v: v == rank, rank),
        ("lora.alpha", lambda v: isinstance(v, int | float) and float(v) == alpha, alpha),
        ("lora.target_modules", lambda v: isinstance(v, list) and sorted(v) == sorted(targets), targets),
    )
    for path, same, mine in claims:
        for source, value in _recorded(result, export, path):
            if not same(value):
                raise import_mismatch(f"{source}: {path} is {value}, {ADAPTER_CONFIG} says {mine}")
