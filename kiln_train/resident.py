"""The resident runner: the loaded base model plus everything that identifies it.

The worker builds one `ResidentModel` at start and keeps it between jobs; the library builds one
with `load_resident(model_dir)`. Its `execution_identity_digest` is what admission pins and the
worker re-verifies at dequeue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kiln_train.backend import Backend, backend_for_device
from kiln_train.model_config import Qwen35Config
from kiln_train.provenance import (
    base_weight_shard_manifest,
    execution_provenance,
    model_identity,
)


@dataclass
class ResidentModel:
    model: object  # kiln_train.model.Qwen35Model
    model_dir: Path
    config: Qwen35Config
    backend: Backend
    tokenizer: object  # tokenizers.Tokenizer
    template: object  # kiln_train.chat_template.ChatTemplate
    identity: dict  # model/tokenizer/template digests
    shard_manifest: dict
    provenance: dict
    device_name: str = "cpu"
    compiled_features: list[str] = field(default_factory=list)

    @property
    def execution_identity_digest(self) -> str:
        return self.provenance["provenance_sha256"]

    @property
    def base_weights_sha256(self) -> str:
        return self.shard_manifest["aggregate_sha256"]


def device_description(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu:{platform.processor() or platform.machine()}"


def compiled_features(backend: Backend) -> list[str]:
    """Kernel paths this process will execute with (recorded in the execution provenance)."""
    features = ["torch-chunked-gdn", "sdpa-attention", "chunked-linear-ce"]
    if backend.name == "cuda":
        import torch

        from kiln_train.model.delta_rule import canonical_device, fla_unusable_reason

        if fla_unusable_reason(canonical_device(torch.device(backend.device))) is None:
            features.append("fla-gated-delta-rule")
    return sorted(features)


def _check_tokenizer_fits_vocabulary(tokenizer, vocab_size: int, model_dir: Path) -> None:
    """Every id the tokenizer can emit must have an embedding row, or a row fails mid-training."""
    from kiln_train.model.loader import CheckpointError

    highest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if highest >= vocab_size:
        raise CheckpointError(
            f"the tokenizer emits ids up to {highest} but the model's vocab_size is {vocab_size}: "
            "tokenizer.json does not belong to this checkpoint",
            file=str(model_dir / "tokenizer.json"),
        )


def _check_template_sources(model_dir: Path) -> None:
    """The files the chat template comes from must be readable, or the load stops naming them.

    `chat_template.jinja` wins; without it, `tokenizer_config.json`'s `chat_template` string is the
    template. Undecodable text, a tokenizer_config.json that is not a JSON object, or a
    `chat_template` that is not one string (a list of named templates, a number) is refused here,
    naming the file and field, instead of surfacing as a UnicodeDecodeError / AttributeError, or as
    "no chat template".
    """
    from kiln_train.model.loader import CheckpointError

    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(
                f"chat_template.jinja in {model_dir} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                file=jinja.name,
            ) from None
        return
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"tokenizer_config.json in {model_dir} is not readable JSON: {exc}", file=config.name
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"tokenizer_config.json in {model_dir} must be a JSON object, got {type(data).__name__}",
            file=config.name,
        )
    template = data.get("chat_template")
    if template is not None and not isinstance(template, str):
        kinds = {list: "a list of named templates", dict: "an object", bool: "a boolean", int: "a number"}
        kind = kinds.get(type(template), "a number")
        raise CheckpointError(
            f"tokenizer_config.json in {model_dir}: field 'chat_template' is {kind}, not a template "
            "string; Kiln trains under one official Qwen3.5 template (ship it as chat_template.jinja)",
            file=config.name,
        )


def load_resident(
    model_dir: str | Path,
    *,
    device: str = "cpu",
    server_config: dict | None = None,
    environ: dict[str, str] | None = None,
) -> ResidentModel:
    """Load the model, tokenizer and training template, and compute the execution identity."""
    from kiln_train.chat_template import load_model_chat_template, select_training_template
    from kiln_train.model import load_model
    from kiln_train.tokenizer import load_tokenizer

    model_dir = Path(model_dir).resolve()
    backend = backend_for_device(device)
    model = load_model(model_dir, device=backend.device)
    tokenizer = load_tokenizer(model_dir)
    _check_tokenizer_fits_vocabulary(tokenizer, model.config.vocab_size, model_dir)
    _check_template_sources(model_dir)
    template = select_training_template(load_model_chat_template(model_dir))
    identity = model_identity(model_dir, "sha256:" + template.sha256)
    shards = base_weight_shard_manifest(model_dir)
    features = compiled_features(backend)
    device_name = device_description(backend.device)
    prov = execution_provenance(
        backend=backend.to_dict(),
        device_name=device_name,
        model=identity,
        training_policy={
            "parameter_dtype": backend.lora_dtype,
            "optimizer_state_dtype": backend.optimizer_state_dtype,
            "rounding": "round_to_nearest",
        },
        compiled_features=features,
        server_config={"model_dir": str(model_dir), "device": backend.device, **(server_config or {})},
        environ=environ,
    )
    return ResidentModel(
        model=model,
        model_dir=model_dir,
        config=model.config,
        backend=backend,
        tokenizer=tokenizer,
        template=template,
        identity=identity,
        shard_manifest=shards,
        provenance=prov,
        device_name=device_name,
        compiled_features=features,
    )
