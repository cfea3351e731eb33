"""HF/TRL interop for the api: export bundles and PEFT imports (docs/interop.md).

- `POST /v1/train/hf/sft/exports` (`HfSftExportRequest`): the rows go through the same ingestion
  as a submission, with the live runner's tokenizer; the bundle binds that runner's identities and
  is published under `<storage.root>/hf-exports/<name>.kiln-hf/` (staging directory, then a
  no-replace rename: names are never overwritten). Nothing is queued; no GPU is touched.
- `GET`/`DELETE /v1/train/hf/exports[/{name}]`, `GET .../{name}/download` (tar.gz).
- `POST /v1/train/hf/peft/imports/{name}` (`Content-Type: application/gzip`): the adapter is
  checked against the live runner (`kiln_train.interop.peft_import`), published under
  `<storage.root>/adapters/<name>/` and recorded in `adapters` in one transaction, so it is listed,
  downloadable and usable as `base_adapter` like a trained one.

Every refusal happens before anything is written, so a refused request leaves no file and no row.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from api.admission import adapter_conflict, lock_admissions
from api.errors import TRAINING_NO_RUNNER
from api.queries import active_jobs_for_adapter
from api.request_bounds import check_example_sizes
from api.runner_gate import RunnerTarget, check_training_template, runner_target
from api.schemas import AdapterInfo
from api.serializers import adapter_info
from api.services import Services
from kiln.store import get_adapter, live_runner, register_adapter
from kiln_train.artifacts.adapter import check_adapter_name
from kiln_train.data.ingestion import resolve_dataset_path
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError, invalid_request
from kiln_train.ground import json_bounded
from kiln_train.interop import bundle as bundle_mod
from kiln_train.interop import peft_import
from kiln_train.interop.bundle import EXPORT_NAME_PATTERN, ResidentFacts
from kiln_train.interop.errors import HF_EXPORT_NOT_FOUND, InteropError
from kiln_train.interop.export import export_sft
from kiln_train.plan.gates import check_static_gates
from kiln_train.sft_config import (
    MAX_LORA_RANK,
    AdamWConfig,
    OptimizerConfig,
    SftConfig,
    check_one_row_source,
    describe_validation_error,
)

EXPORTS_DIR = "hf-exports"
GZIP_TYPES = ("application/gzip", "application/x-gzip")
# An upload may unpack to this many times the request limit (adapters barely compress).
UNPACK_FACTOR = 4
# A hidden staging or trash directory in the exports directory untouched this long belongs to a
# process that died mid-export or mid-delete (a live one finishes in seconds).
ABANDONED_AFTER_SECONDS = 3600.0


def exports_dir(svc: Services) -> Path:
    return svc.settings.storage_root / EXPORTS_DIR


# ----- the request --------------------------------------------------------------------------------


class HfExportConfig(BaseModel):
    """The run the bundle describes: the fields of an SFT `config` a TRL run can follow.

    Checked by the same rules as a submission's config (ranges, alpha/rank at most 2 unless
    `allow_high_lora_scale`, the learning-rate default, the seed drawn once when absent). The
    optimizer defaults to adam_w: Kiln's SFT default, muon, has no equivalent in the pinned stack
    and is refused (400 `hf_export_unsupported`).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    epochs: int = Field(default=3, ge=1, le=100_000)
    learning_rate: float | None = None
    lora_rank: int = Field(default=16, ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = 32.0
    seed: int | str | None = None
    optimizer: OptimizerConfig = Field(default_factory=lambda: AdamWConfig(kind="adam_w"))
    allow_high_lora_scale: bool = False


class HfSftExportRequest(BaseModel):
    """Body of `POST /v1/train/hf/sft/exports`: a name, exactly one data transport, the policy for
    rows that fail ingestion, an optional adapter to start from, and the run's config."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(
        pattern=EXPORT_NAME_PATTERN, description="The bundle is NAME.kiln-hf (never overwritten)."
    )
    examples: list[dict] | None = None
    dataset_path: str | None = None
    invalid_row_policy: Literal["fail", "skip"] = "fail"
    input_adapter: str | None = Field(
        default=None, description="A registry adapter to start from instead of Kiln's seeded initialisation."
    )
    config: HfExportConfig = Field(default_factory=HfExportConfig)

    @model_validator(mode="after")
    def _one_transport(self) -> HfSftExportRequest:
        check_one_row_source(self, ("examples", "dataset_path"))
        return self

    def sft_config(self) -> SftConfig:
        """The config as an SFT config (the same validators), resolved: lr default, seed drawn."""
        fields = self.config.model_dump(exclude_none=True, exclude={"optimizer"})
        fields["optimizer"] = self.config.optimizer
        fields["invalid_row_policy"] = self.invalid_row_policy
        try:
            config = SftConfig.model_validate(fields)
        except ValidationError as exc:
            parts = describe_validation_error(exc).split("; ")
            raise invalid_request(
                "; ".join(f"config.{p}" if ":" in p else f"config: {p}" for p in parts)
            ) from None
        return config.resolve()


def parse_export_request(body: object) -> HfSftExportRequest:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    try:
        request = HfSftExportRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(describe_validation_error(exc, model=HfSftExportRequest)) from None
    if request.input_adapter is not None:
        try:
            check_adapter_name(request.input_adapter)
        except KilnError:
            raise invalid_request(f"input_adapter {request.input_adapter!r} is not an adapter name") from None
    check_example_sizes(request.examples, "examples")
    return request


# ----- responses ----------------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HfExportInfo(_Out):
    name: str
    path: str
    created_at: str
    bundle_digest: str
    size_bytes: int
    rows_kept: int
    rows_rejected: int
    total_steps: int
    optimizer: str
    lora_rank: int
    lora_alpha: float
    seed: str = Field(description="u64 seed as a decimal string.")
    download: str = Field(description="The bundle as tar.gz (NAME.kiln-hf/...).")
    manifest: dict[str, Any] = Field(description="kiln_hf_export.json (schema kiln.hf-trl-export.v1).")


class HfExportList(_Out):
    exports: list[HfExportInfo]


class HfDeletedExport(_Out):
    name: str
    status: Literal["deleted"]


class HfImportResponse(_Out):
    adapter: AdapterInfo
    import_receipt: dict[str, Any] = Field(
        description="kiln_import_receipt.json (schema kiln.hf-peft-import.v1)."
    )


def export_info(path: Path, manifest: dict) -> HfExportInfo:
    name = manifest["name"]
    return HfExportInfo(
        name=name,
        path=str(path),
        created_at=manifest["created_at"],
        bundle_digest=manifest["bundle_digest"],
        size_bytes=sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
        rows_kept=manifest["data"]["rows_kept"],
        rows_rejected=manifest["data"]["rows_rejected"],
        total_steps=manifest["schedule"]["total_steps"],
        optimizer=manifest["optimizer"]["kind"],
        lora_rank=manifest["lora"]["rank"],
        lora_alpha=manifest["lora"]["alpha"],
        seed=manifest["seed"],
        download=f"/v1/train/hf/exports/{name}/download",
        manifest=manifest,
    )


# ----- the resident runner ------------------------------------------------------------------------


def resident_facts(svc: Services) -> tuple[RunnerTarget, ResidentFacts]:
    """The live runner as interop sees it; 503 `training_no_runner` when there is none."""
    settings = svc.settings
    with svc.sessions() as session:
        runner = live_runner(session, settings.training.runner_stale_seconds)
        if runner is None:
            raise KilnError(
                TRAINING_NO_RUNNER,
                "no live training runner: exports and imports are checked against the resident model, and "
                f"no worker has sent a heartbeat within {settings.training.runner_stale_seconds} s",
            )
        target = runner_target(runner)
        base_weights = runner.model_config.get("base_weights_sha256")
    facts = ResidentFacts(
        model_dir=Path(target.model_path),
        model=target.model,
        identity=dict(target.identity),
        base_weights_sha256=base_weights,
        base_weight_dtype=target.backend.base_weight_dtype,
        lora_dtype=target.backend.lora_dtype,
        loss_route=target.loss_route,
        runner_id=target.runner_id,
        execution_identity_digest=target.execution_identity_digest,
    )
    return target, facts


# ----- exports ------------------------------------------------------------------------------------


def sweep_abandoned(root: Path, now: float | None = None) -> list[str]:
    """Delete hidden staging and trash directories of exports that outlived their process."""
    swept = []
    now = time.time() if now is None else now
    if not root.is_dir():
        return swept
    for entry in root.iterdir():
        hidden = entry.name.startswith(".") and (
            bundle_mod.STAGING_MARK in entry.name or entry.name.startswith(".trash-")
        )
        if not hidden or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            newest = max([entry.stat().st_mtime, *(p.stat().st_mtime for p in entry.rglob("*"))])
        except OSError:
            continue
        if now - newest > ABANDONED_AFTER_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry.name)
    return swept


def create_export(svc: Services, body: object) -> HfExportInfo:
    request = parse_export_request(body)
    config = request.sft_config()
    bundle_mod.refuse_unsupported_optimizer(config.optimizer.kind)
    target, resident = resident_facts(svc)
    check_static_gates(target, config)  # a job's rank gates: the model's ceiling, the optimizer tuple
    settings = svc.settings
    root = exports_dir(svc)
    sweep_abandoned(root)
    if (root / bundle_mod.bundle_dir_name(request.name)).exists():
        raise InteropError(bundle_mod.HF_EXPORT_ALREADY_EXISTS, f"export {request.name!r} already exists")
    input_adapter = None
    if request.input_adapter is not None:
        with svc.sessions() as session:
            adapter = get_adapter(session, request.input_adapter)
        if adapter is None:
            raise invalid_request(
                f"input_adapter {request.input_adapter!r} is not an adapter in the registry"
            )
        input_adapter = (request.input_adapter, Path(adapter.path))
    check_training_template(target)
    tokenizer = svc.tokenizers.get(target.model_path, target.identity.get("tokenizer_vocab_sha256"))
    dataset = None
    if request.dataset_path is not None:
        dataset = resolve_dataset_path(request.dataset_path, settings.datasets_dir)
    result = export_sft(
        root,
        name=request.name,
        resident=resident,
        tokenizer=tokenizer,
        config=config,
        examples=list(request.examples) if request.examples is not None else None,
        dataset=dataset,
        dataset_locator=request.dataset_path,
        input_adapter=input_adapter,
    )
    return export_info(result.path, result.manifest)


def _read_manifest(path: Path) -> dict | None:
    try:
        value = json_bounded.loads((path / bundle_mod.MANIFEST).read_bytes())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def find_export(svc: Services, name: str) -> tuple[Path, dict]:
    bundle_mod.check_export_name(name)
    path = exports_dir(svc) / bundle_mod.bundle_dir_name(name)
    manifest = _read_manifest(path) if path.is_dir() else None
    if manifest is None:
        raise InteropError(HF_EXPORT_NOT_FOUND, f"no export named {name!r}")
    return path, manifest


def list_exports(svc: Services) -> HfExportList:
    root = exports_dir(svc)
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            if (
                entry.name.startswith(".")
                or not entry.name.endswith(bundle_mod.BUNDLE_SUFFIX)
                or not entry.is_dir()
            ):
                continue
            manifest = _read_manifest(entry)
            if manifest is not None:
                found.append(export_info(entry, manifest))
    found.sort(key=lambda e: (e.created_at, e.name), reverse=True)
    return HfExportList(exports=found)


def export_by_digest(svc: Services, digest: str) -> dict | None:
    """The manifest of the published export with this bundle digest, if there is one."""
    for info in list_exports(svc).exports:
        if info.bundle_digest == digest:
            return info.manifest
    return None


# ----- imports ------------------------------------------------------------------------------------


def _check_name_free(svc: Services, name: str) -> None:
    with svc.sessions() as session:
        reason = adapter_conflict(session, svc.settings.adapters_dir, name)
    if reason is not None:
        raise KilnError(ADAPTER_ALREADY_EXISTS, reason)


def import_peft(svc: Services, name: str, archive: bytes, max_bytes: int) -> HfImportResponse:
    """Check the uploaded adapter against the live runner, then publish and register it."""
    check_adapter_name(name)
    _, resident = resident_facts(svc)
    _check_name_free(svc, name)
    upload = peft_import.read_archive(archive, max_bytes=max_bytes)
    plan = peft_import.plan_import(upload, resident, lambda digest: export_by_digest(svc, digest))
    holder: dict = {}

    def register(path: Path, receipt: dict) -> None:
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        with svc.sessions.begin() as session:
            lock_admissions(session)
            if get_adapter(session, name) is not None:
                raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {name!r} already exists")
            active = active_jobs_for_adapter(session, name)
            if active:
                raise KilnError(ADAPTER_ALREADY_EXISTS, f"job {active[0]} already targets adapter {name!r}")
            row = register_adapter(
                session,
                name=name,
                job_id=None,
                path=str(path),
                size_bytes=size,
                safetensors_sha256=receipt["published"]["adapter_model_sha256"],
                rank=plan.rank,
                alpha=plan.alpha,
                base_model_sha256=resident.base_weights_sha256 if plan.vouched else None,
            )
            holder["info"] = adapter_info(row, [])

    _, receipt = peft_import.publish_import(
        svc.settings.adapters_dir, name, plan, runner_id=resident.runner_id, register=register
    )
    return HfImportResponse(adapter=holder["info"], import_receipt=receipt)
