"""An SFT export, end to end and torch-free: rows in, a published `<name>.kiln-hf/` bundle out.

`export_sft` is what `POST /v1/train/hf/sft/exports` runs (and what a library caller can run
against a resident model of its own): the same ingestion as an SFT submission (the resident
tokenizer and training template, `invalid_row_policy`, the ingestion receipt), the effective
config resolved as a job's would be (learning rate default, the seed drawn once), the initial
adapter Kiln would start from (`kiln-py.seeded-lora-init.v1` from the seed, or the tensors of
`input_adapter`, checked as a warm start is), then `bundle.build_bundle` in a staging directory
renamed into place. Every check runs before anything is written; a refused export leaves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln_train.artifacts.adapter import (
    ADAPTER_MODEL,
    PEFT_PREFIX,
    VL_PEFT_PREFIX,
    check_adapter_provenance,
    check_base_adapter_files,
)
from kiln_train.data.chat_template import training_template
from kiln_train.data.ingestion import IngestionResult, LengthRule
from kiln_train.data.row_source import RowSource
from kiln_train.errors import TrainingFailure, invalid_request
from kiln_train.ground.digest import file_digest
from kiln_train.interop import bundle as bundle_mod
from kiln_train.interop import safetensors_io
from kiln_train.interop.bundle import InitialAdapter, ResidentFacts
from kiln_train.interop.bundle_rows import jsonl_objects
from kiln_train.interop.errors import HF_EXPORT_ALREADY_EXISTS, InteropError
from kiln_train.interop.lora_init import seeded_lora_tensors
from kiln_train.sft_config import SftConfig


@dataclass(frozen=True)
class ExportResult:
    path: Path
    manifest: dict
    ingestion: IngestionResult


def input_adapter_tensors(
    name: str, path: Path, resident: ResidentFacts, rank: int, alpha: float
) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """The tensors of a registry adapter used as the starting point, after the checks a warm start
    makes (files, LoRA parametrisation, rank, alpha, the exact tensor set and shapes, finite
    values, and the provenance its adapter_manifest.json records); 400 naming `input_adapter`."""
    where = f"input_adapter {name!r}"
    try:
        check_base_adapter_files(path, resident.model, rank, alpha)
        check_adapter_provenance(
            path,
            model_config_sha256=resident.identity["model_config_sha256"],
            base_weights_sha256=resident.base_weights_sha256,
        )
    except TrainingFailure as exc:
        raise invalid_request(f"{where}: {exc.message}") from None
    try:
        parsed = safetensors_io.parse((path / ADAPTER_MODEL).read_bytes())
    except (OSError, safetensors_io.SafetensorsError) as exc:
        raise invalid_request(f"{where}: {ADAPTER_MODEL} is not readable: {exc}") from None
    tensors = {}
    for key, info in parsed.tensors.items():
        raw = parsed.raw(key)
        bad = safetensors_io.first_non_finite(info.dtype, raw)
        if bad is not None:
            raise invalid_request(f"{where}: tensor {key!r} holds a non-finite value at element {bad}")
        text_key = PEFT_PREFIX + key[len(VL_PEFT_PREFIX) :] if key.startswith(VL_PEFT_PREFIX) else key
        tensors[text_key] = (info.dtype, info.shape, raw)
    return tensors


def export_sft(
    exports_dir: Path,
    *,
    name: str,
    resident: ResidentFacts,
    tokenizer,
    config: SftConfig,
    examples: list | None = None,
    dataset: Path | None = None,
    dataset_locator: str | None = None,
    input_adapter: tuple[str, Path] | None = None,
) -> ExportResult:
    """Ingest the rows and publish the bundle `<exports_dir>/<name>.kiln-hf`.

    `config` is the effective config (`SftConfig.resolve()`); exactly one of `examples` (inline
    rows) and `dataset` (a resolved JSONL path, named `dataset_locator` in the receipt) is given;
    `input_adapter` is (registry name, directory) of the adapter to start from.
    """
    bundle_mod.check_export_name(name)
    bundle_mod.refuse_unsupported_optimizer(config.optimizer.kind)
    if (exports_dir / bundle_mod.bundle_dir_name(name)).exists():
        raise InteropError(HF_EXPORT_ALREADY_EXISTS, f"export {name!r} already exists")
    initial_tensors = None
    if input_adapter is not None:
        adapter_name, adapter_path = input_adapter
        initial_tensors = input_adapter_tensors(
            adapter_name, adapter_path, resident, config.lora_rank, config.lora_alpha
        )
    template = training_template()
    policy = config.invalid_row_policy
    source = RowSource(examples=examples, path=dataset, locator=dataset_locator)
    ingestion = source.ingest(
        tokenizer=tokenizer, template=template, policy=policy, limit=LengthRule.of_config(config)
    )
    sources = dict(enumerate(examples, start=1)) if examples is not None else jsonl_objects(dataset)
    if initial_tensors is None:
        initial = InitialAdapter(
            seeded_lora_tensors(resident.model, config.lora_rank, config.seed), "seeded", config.seed
        )
    else:
        adapter_name, adapter_path = input_adapter
        identity = {"name": adapter_name, "adapter_model_sha256": file_digest(adapter_path / ADAPTER_MODEL)}
        initial = InitialAdapter(initial_tensors, "input_adapter", config.seed, identity)
    holder: dict = {}

    def build(directory: Path) -> None:
        holder["manifest"] = bundle_mod.build_bundle(
            directory,
            name=name,
            resident=resident,
            config=config,
            ingestion=ingestion,
            sources=sources,
            initial=initial,
        )

    path = bundle_mod.publish_bundle(exports_dir, name, build)
    return ExportResult(path, holder["manifest"], ingestion)
