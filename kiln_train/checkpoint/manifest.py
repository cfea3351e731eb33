"""The checkpoint manifest `kiln.training-checkpoint.v1`: typed parts and parsing.

docs/checkpoints.md#manifest.

Every typed part rejects unknown fields (`extra="forbid"`) and wrong JSON types (`strict`);
`effective_config`, `auxiliary_state` and `precision_policy.stochastic_rounding` are open
objects whose content is checked by `kiln_train.checkpoint.rules`. Optional members
(`optimizer.state_file`, the optional `state_files` entries) are omitted from the JSON when
absent, as in the contract's example. Torch-free.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln_train.checkpoint.epoch_order import EPOCH_ORDER_ALGORITHM
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.json_io import dump_pretty_json, load_strict_json
from kiln_train.model.config import LORA_INIT_ALGORITHM
from kiln_train.optim.kinds import OptimizerConfig, known_kind
from kiln_train.sft_config import U64_MAX

# ----- layout (docs/checkpoints.md#layout) --------------------------------------------------------
SCHEMA_VERSION = 1
MANIFEST_TYPE = "kiln.training-checkpoint.v1"
CHECKPOINT_KIND = "resumable"
CHECKPOINT_SUFFIX = ".kiln-checkpoint"
MANIFEST_FILENAME = "checkpoint_manifest.json"
SENTINEL_FILENAME = ".incomplete"
RESERVED_NAMES = (MANIFEST_FILENAME, SENTINEL_FILENAME)
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_FILES = 64
MAX_RELPATH_BYTES = 1024
MAX_IDENTIFIER_BYTES = 255

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
LOOP_STATE_FILE = "sft_loop_state.json"

# ----- enums (docs/checkpoints.md#manifest) -------------------------------------------------------
TrainingKind = Literal["sft", "grpo", "opd", "capability-distillation"]
FileRole = Literal[
    "adapter-parameters",
    "optimizer-state",
    "reference-state",
    "ema-state",
    "reward-normalization-state",
    "rng-state",
    "data-order",
    "loss-history",
]
# state_files member -> the role its file must carry in `files`
STATE_FILE_ROLES: dict[str, str] = {
    "adapter_parameters": "adapter-parameters",
    "optimizer_state": "optimizer-state",
    "reference_state": "reference-state",
    "ema_state": "ema-state",
    "reward_normalization_state": "reward-normalization-state",
    "loss_history": "loss-history",
}
DATA_SOURCE_KIND = "sft-valid-example-order-v1"
EPOCH_ORDER_STREAM = "epoch-order"
LORA_INIT_STREAM = "lora-init"
SCHEDULER_KIND = "constant"
ROUND_TO_NEAREST = "round_to_nearest"

# ----- SFT auxiliary state (docs/checkpoints.md#bound-identities) ---------------------------------
SFT_LOOP_STATE_TYPE = "kiln.sft-loop-state.v1"
SFT_PLANNING_SCHEMA = "kiln.training-checkpoint-planning.v4"
# The planning identity's record of the kernel paths the run executed with (operation -> path,
# docs/kernels.md#kernel-paths); a resume under other paths is planning drift.
PLANNING_KERNEL_PATHS_KEY = "kernel_paths"
SFT_AUXILIARY_KEYS = (
    "loop_state_type",
    "model_config_sha256",
    "tokenizer_config_sha256",
    "chat_template_sha256",
    "training_chat_template_sha256",
    "base_model_weights_sha256",
    "base_weight_shard_manifest",
    "execution_provenance",
    "backend_runtime",
    "kiln_train_version",
    "gradient_checkpoint_plan_sha256",
    "ingestion_receipt_sha256",
    "training_precision_policy",
    "training_runtime_planning_identity",
    "valid_indices_sha256",
)
# Optional `auxiliary_state` member of a warm-started run: the receipt identity
# `{path, adapter_model_sha256, adapter_model_bytes}` of `effective_config.base_adapter` as it was
# loaded. A resume does not load the base adapter again (it continues the checkpoint's tensors), so
# it takes the run's lineage from here; absent when the run started from the seeded LoRA init.
BASE_ADAPTER_AUX_KEY = "base_adapter"
# Optional (always written by this version) `auxiliary_state` member: the pinned gradient
# checkpoint plan `{max_segments, auto, budget_bytes}` the per-row plan list (whose digest is
# `gradient_checkpoint_plan_sha256`) was derived from. An auto plan depends on the memory budget
# admission saw, so a resume must re-derive the rows from this record, not from a fresh budget.
CHECKPOINT_PLAN_AUX_KEY = "gradient_checkpoint_plan"
CHECKPOINT_PLAN_KEYS = ("max_segments", "auto", "budget_bytes")
# Optional `auxiliary_state` members of a run with held-out validation (docs/validation.md), both
# absent without it. `validation` is the corpus and schedule the run evaluates
# (`kiln.sft-validation.v1` identity: schema, source, rows, supervised_tokens, corpus_sha256,
# interval_steps): bound like the rest of the auxiliary state, so a resume must bring the same.
# `validation_history` is the evaluations made up to this checkpoint's step: progress, not
# identity, so a resume adopts it (like the step) and continues it.
VALIDATION_AUX_KEY = "validation"
VALIDATION_HISTORY_AUX_KEY = "validation_history"
VALIDATION_IDENTITY_KEYS = (
    "schema",
    "source",
    "rows",
    "supervised_tokens",
    "corpus_sha256",
    "interval_steps",
)
VALIDATION_EVALUATION_KEYS = ("global_step", "epoch", "loss", "token_accuracy")
BASE_ADAPTER_IDENTITY_KEYS = ("path", "adapter_model_sha256", "adapter_model_bytes")

_IDENTIFIER_RE = re.compile(r"[A-Za-z0-9._-]+")  # matched in full (`$` admits a trailing newline)
_HEX64_RE = r"^[0-9a-f]{64}$"
_RFC3339_RE = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")

_PART = ConfigDict(extra="forbid", strict=True, frozen=True)


def _omit_none(value: Any) -> bool:
    return value is None


def check_identifier(field: str, value: str) -> None:
    """Identifiers are 1..=255 bytes of `[A-Za-z0-9._-]` and never `.` or `..` (docs/checkpoints.md#manifest)."""
    if (
        not value
        or len(value.encode("utf-8")) > MAX_IDENTIFIER_BYTES
        or not _IDENTIFIER_RE.fullmatch(value)
        or value in (".", "..")
    ):
        raise CheckpointError(
            f"{field}: {value!r} is not an identifier of 1..={MAX_IDENTIFIER_BYTES} bytes of [A-Za-z0-9._-]"
        )


def checkpoint_id_for(global_step: int) -> str:
    """`sft-step-<global_step:08>` (docs/checkpoints.md#layout)."""
    return f"sft-step-{global_step:08d}"


def checkpoint_dir_name(adapter_name: str, global_step: int) -> str:
    """`<adapter>-checkpoint-step-<global_step:08>.kiln-checkpoint` (docs/checkpoints.md#layout)."""
    check_identifier("adapter_name", adapter_name)
    return f"{adapter_name}-checkpoint-step-{global_step:08d}{CHECKPOINT_SUFFIX}"


def strip_sha256_prefix(digest: str) -> str:
    """`sha256:<hex>` (ingestion's rendering) -> the bare 64-hex form the manifest stores."""
    return digest.removeprefix("sha256:")


# ----- typed parts ----------------------------------------------------------------------------
class PrecisionPolicy(BaseModel):
    """`precision_policy` (docs/checkpoints.md#manifest); the rounding record stays an open object
    so a legacy stochastic record parses and is then refused with a precise message."""

    model_config = _PART
    parameter_dtype: str
    optimizer_state_dtype: str
    activation_dtype: str
    gradient_dtype: str
    stochastic_rounding: dict[str, Any]

    @field_validator("parameter_dtype", "optimizer_state_dtype", "activation_dtype", "gradient_dtype")
    @classmethod
    def _non_empty(cls, v: str, info) -> str:
        if not v.strip():
            raise ValueError(f"{info.field_name} must be a non-empty dtype name")
        return v


class Progress(BaseModel):
    """`progress`: where the run stands and this epoch's data order."""

    model_config = _PART
    global_step: int = Field(ge=0)
    total_steps: int = Field(ge=0)
    epoch_index: int = Field(ge=0)
    cursor_in_epoch: int = Field(ge=0)
    data_order: list[int]


class DataIdentity(BaseModel):
    """`data`: the admitted corpus the order indexes into."""

    model_config = _PART
    source_kind: Literal["sft-valid-example-order-v1"]
    content_sha256: str = Field(pattern=_HEX64_RE)
    item_count: int = Field(gt=0)


class RngState(BaseModel):
    """One named random stream: algorithm, u64 seed, position."""

    model_config = _PART
    algorithm: str
    seed: int = Field(ge=0, le=U64_MAX)
    position: int = Field(ge=0)


class RngStates(BaseModel):
    """`rng_states` with exactly the `epoch-order` and `lora-init` streams."""

    model_config = _PART
    epoch_order: RngState = Field(alias=EPOCH_ORDER_STREAM)
    lora_init: RngState = Field(alias=LORA_INIT_STREAM)

    @field_validator("epoch_order", "lora_init")
    @classmethod
    def _algorithm(cls, v: RngState, info) -> RngState:
        expected = EPOCH_ORDER_ALGORITHM if info.field_name == "epoch_order" else LORA_INIT_ALGORITHM
        if v.algorithm != expected:
            raise ValueError(f"algorithm {v.algorithm!r} is not {expected!r}")
        return v


class OptimizerHyperparameters(BaseModel):
    """`optimizer.hyperparameters`: the resolved learning rate and the full optimizer object."""

    model_config = _PART
    learning_rate: float = Field(gt=0.0, allow_inf_nan=False)
    optimizer: OptimizerConfig


class OptimizerRecord(BaseModel):
    """`optimizer`; `state_file` only when the optimizer keeps state (not SGD)."""

    model_config = _PART
    kind: Annotated[str, AfterValidator(known_kind)]
    step: int = Field(ge=0)
    hyperparameters: OptimizerHyperparameters
    state_file: str | None = Field(default=None, exclude_if=_omit_none)


class SchedulerState(BaseModel):
    """The fixed `native_online_lora_v1` scheduler state (docs/training-profile.md#the-profile)."""

    model_config = _PART
    training_profile: Literal["native_online_lora_v1"]
    learning_rate: float = Field(gt=0.0, allow_inf_nan=False)
    microbatch_conversations: Literal[1]
    gradient_accumulation_steps: Literal[1]
    warmup_steps: Literal[0]
    gradient_clipping: Literal["none"]


class SchedulerRecord(BaseModel):
    """`scheduler`: a constant schedule; its step is the global step."""

    model_config = _PART
    kind: Literal["constant"]
    step: int = Field(ge=0)
    state: SchedulerState


class StateFiles(BaseModel):
    """`state_files`: which relative path holds each kind of state."""

    model_config = _PART
    adapter_parameters: str
    optimizer_state: str | None = Field(default=None, exclude_if=_omit_none)
    reference_state: str | None = Field(default=None, exclude_if=_omit_none)
    ema_state: str | None = Field(default=None, exclude_if=_omit_none)
    reward_normalization_state: str | None = Field(default=None, exclude_if=_omit_none)
    loss_history: str | None = Field(default=None, exclude_if=_omit_none)

    def present(self) -> dict[str, str]:
        """The declared members, member name -> relative path."""
        return {name: getattr(self, name) for name in STATE_FILE_ROLES if getattr(self, name) is not None}


class FileRecord(BaseModel):
    """One entry of `files`: role, byte size and bare lowercase SHA-256 (computed by the writer)."""

    model_config = _PART
    role: FileRole
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=_HEX64_RE)


class CheckpointManifest(BaseModel):
    """`checkpoint_manifest.json` (docs/checkpoints.md#manifest). Shape only;
    `rules.validate_manifest` checks the meaning."""

    model_config = _PART
    schema_version: Literal[1]
    manifest_type: Literal["kiln.training-checkpoint.v1"]
    checkpoint_kind: Literal["resumable"]
    checkpoint_id: str
    training_kind: TrainingKind
    adapter_name: str
    created_at: str
    effective_config: dict[str, Any]
    precision_policy: PrecisionPolicy
    progress: Progress
    data: DataIdentity
    rng_states: RngStates
    optimizer: OptimizerRecord
    scheduler: SchedulerRecord
    state_files: StateFiles
    auxiliary_state: dict[str, Any]
    files: dict[str, FileRecord]

    @field_validator("created_at")
    @classmethod
    def _rfc3339(cls, v: str) -> str:
        if not _RFC3339_RE.match(v):
            raise ValueError(f"{v!r} is not an RFC 3339 timestamp")
        try:
            datetime.fromisoformat(v.upper().replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{v!r} is not an RFC 3339 timestamp") from None
        return v

    @property
    def seed(self) -> int:
        """The run's effective seed (the epoch-order stream's seed)."""
        return self.rng_states.epoch_order.seed

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_bytes(self) -> bytes:
        """The exact bytes written as `checkpoint_manifest.json`."""
        return dump_pretty_json(self.to_json())


def describe_model_error(what: str, exc: ValidationError) -> str:
    """One `what: field.path: problem` clause per pydantic error, unknown fields called out."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "required field is missing"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"{what}: " + "; ".join(parts)


def manifest_from_json(value: dict[str, Any]) -> CheckpointManifest:
    """The typed manifest from parsed JSON; shape errors become `CheckpointError`."""
    try:
        return CheckpointManifest.model_validate(value)
    except ValidationError as exc:
        raise CheckpointError(describe_model_error(MANIFEST_FILENAME, exc)) from None


def parse_manifest_bytes(data: bytes) -> CheckpointManifest:
    """Strict JSON + typed shape of `checkpoint_manifest.json` (no semantic rules yet)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{MANIFEST_FILENAME}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES} byte limit"
        )
    return manifest_from_json(load_strict_json(data, MANIFEST_FILENAME))
