"""The resident runner: the loaded base model plus everything that identifies it.

The worker builds one `ResidentModel` at start and keeps it between jobs; the library builds one
with `load_resident(model_dir)`. Its `execution_identity_digest` is what admission pins and the
worker re-verifies at dequeue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln_train.artifacts.provenance import (
    base_weight_shard_manifest,
    execution_provenance,
    model_identity,
)
from kiln_train.data.tokenizer import TOKENIZER_FILE
from kiln_train.ground.backend import Backend, backend_for_device
from kiln_train.kernels.paths import KernelPaths
from kiln_train.model.config import Qwen35Config


@dataclass
class ResidentModel:
    model: object  # kiln_train.model.Qwen35Model
    model_dir: Path
    config: Qwen35Config
    backend: Backend
    tokenizer: object  # tokenizers.Tokenizer
    template: object  # kiln_train.data.chat_template.ChatTemplate
    identity: dict  # model/tokenizer/template digests
    shard_manifest: dict
    provenance: dict
    kernel_paths: KernelPaths  # what each fused operation runs on (docs/kernels.md#kernel-paths)
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


def missing_device(device: str, fix: str = "train on device 'cpu' or where a GPU is visible") -> str | None:
    """Why `device` cannot be used by this process's torch, or None when it can; `fix` ends the
    answer when no CUDA device is visible at all."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
        return f"torch {torch.__version__} (built {build}) sees no CUDA device; {fix}"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"only {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0..)"
    return None


def compiled_features(paths: KernelPaths) -> list[str]:
    """Kernel paths this process will execute with (recorded in the execution provenance)."""
    return sorted(["sdpa-attention", "chunked-linear-ce", *paths.features()])


def _check_tokenizer_fits_vocabulary(tokenizer, vocab_size: int, model_dir: Path) -> None:
    """Every id the tokenizer can emit must have an embedding row, or a row fails mid-training."""
    from kiln_train.model.loader import ModelCheckpointError

    highest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if highest >= vocab_size:
        raise ModelCheckpointError(
            f"the tokenizer emits ids up to {highest} but the model's vocab_size is {vocab_size}: "
            "tokenizer.json does not belong to this checkpoint",
            file=str(model_dir / TOKENIZER_FILE),
        )


def load_resident(
    model_dir: str | Path,
    *,
    device: str = "cpu",
    server_config: dict | None = None,
    environ: dict[str, str] | None = None,
) -> ResidentModel:
    """Load the model, tokenizer and training template, and compute the execution identity."""
    from kiln_train.data.chat_template import load_model_chat_template, select_training_template
    from kiln_train.data.tokenizer import load_tokenizer
    from kiln_train.model import load_model
    from kiln_train.model.kernel_choice import choose_kernel_paths, use_kernel_paths

    model_dir = Path(model_dir).resolve()
    backend = backend_for_device(device)
    model = load_model(model_dir, device=backend.device)
    paths = choose_kernel_paths(backend.device, model.dtype, model.config)
    use_kernel_paths(model, paths)
    tokenizer = load_tokenizer(model_dir)
    _check_tokenizer_fits_vocabulary(tokenizer, model.config.vocab_size, model_dir)
    template = select_training_template(load_model_chat_template(model_dir))
    identity = model_identity(model_dir, "sha256:" + template.sha256)
    shards = base_weight_shard_manifest(model_dir)
    features = compiled_features(paths)
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
        kernel_paths=paths.to_dict(),
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
        kernel_paths=paths,
    )
