"""The SFT request contract: `SftRequest`, `SftConfig` and the tagged optimizer object.

See docs/training-profile.md#request-fields, docs/training-profile.md#the-profile and
docs/optimizers.md#hyperparameters. Unknown fields are rejected everywhere (general-trainer
knobs such as `gradient_accumulation_steps` therefore fail as unknown fields); every numeric
range is checked with a message that names the field. Torch-free.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import struct
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kiln_train.errors import invalid_request
from kiln_train.ground.limits import MAX_DIMENSION, MAX_LAYERS
from kiln_train.ground.near_miss import refusal_text
from kiln_train.optim.configs import MAX_NS_ITERS as MAX_NS_ITERS
from kiln_train.optim.configs import STRICT as _STRICT
from kiln_train.optim.configs import AdamWConfig as AdamWConfig
from kiln_train.optim.configs import MuonConfig, finite_value
from kiln_train.optim.configs import SgdConfig as SgdConfig
from kiln_train.optim.kinds import OptimizerConfig, optimizer_kind

log = logging.getLogger(__name__)

TRAINING_PROFILE = "native_online_lora_v1"
MAX_LORA_ALPHA_OVER_RANK = 2.0
U64_MAX = 2**64 - 1
# A LoRA rank is at most the smallest dimension it factors, and no Qwen3.5 dimension exceeds
# MAX_DIMENSION; segments partition the layers. Every integer field has an upper bound, so no
# value reaches arithmetic (alpha / rank as a float) or a 32-bit job-store column out of range.
MAX_LORA_RANK = MAX_DIMENSION
MAX_GRAD_CHECKPOINT_SEGMENTS = MAX_LAYERS
# `max_length` bound: a 32-bit store column holds it; no Qwen3.5 context is longer.
MAX_ROW_TOKENS = 2**31 - 1
# Held-out validation (docs/validation.md): a holdout takes 1..=50 percent of the submitted rows.
MIN_HOLDOUT_PERCENT, MAX_HOLDOUT_PERCENT = 1, 50
LR_WARNING_BAND = 50.0
BUILTIN_SMOKE_PROMPTS = (
    "In one short sentence, name a primary color:",
    "Complete this sentence with a brief answer: The capital of France is",
    "Return a compact JSON tool call for a weather lookup in Paris:",
)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # matched in full


def f32_round(value: float) -> float:
    """The value after conversion to IEEE f32 (inf when it overflows)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _positive_in_f32(name: str, v: float) -> float:
    """`v` when it is finite and positive and stays so after conversion to f32."""
    if finite_value(name, v) <= 0.0:
        raise ValueError(f"{name} must be positive")
    r = f32_round(v)
    if not math.isfinite(r) or r <= 0.0:
        raise ValueError(f"{name} must stay finite and positive after conversion to f32")
    return v


def _seed(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError("seed must be an unsigned 64-bit integer or its decimal string")
    if isinstance(v, str):
        if not re.fullmatch(r"[0-9]{1,20}", v):
            raise ValueError("seed must be an unsigned 64-bit integer or its decimal string")
        v = int(v)
    if not isinstance(v, int) or not 0 <= v <= U64_MAX:
        raise ValueError("seed must be in 0..=18446744073709551615")
    return v


class SftConfig(BaseModel):
    """`config` of an SFT request (docs/training-profile.md#request-fields). Defaults are the server's."""

    model_config = _STRICT

    training_profile: Literal["native_online_lora_v1"] = TRAINING_PROFILE
    invalid_row_policy: Literal["fail", "skip"] = "fail"
    # Row length limit (docs/ingestion.md#length-limits): none by default; "error" rejects a longer
    # row `too_long`, "right" cuts it (opt-in). At least 2: a row needs a token after position 0.
    max_length: int | None = Field(
        default=None,
        ge=2,
        le=MAX_ROW_TOKENS,
        description="The longest row in tokens (default: no limit). What a longer row does: truncation.",
    )
    truncation: Literal["error", "right"] = Field(
        default="error",
        description='"error": a row longer than max_length is rejected too_long (nothing is cut); '
        '"right": it is cut to max_length and must keep a supervised token (else answer_truncated).',
    )
    epochs: int = Field(default=3, ge=1, le=100_000)
    learning_rate: float | None = None
    lora_rank: int = Field(default=16, ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = 32.0
    train_mtp: bool | None = None
    base_adapter: str | None = None
    allow_adapter_shape_conversion: bool = False
    allow_high_lora_scale: bool = False
    output_name: str | None = None
    auto_load: bool = True
    checkpoint_interval: int | None = Field(default=None, ge=1, le=U64_MAX)
    resume_checkpoint: str | None = None
    grad_checkpoint_segments: int | None = Field(default=None, ge=1, le=MAX_GRAD_CHECKPOINT_SEGMENTS)
    detect_anomaly: bool = False
    seed: Annotated[int | None, Field(default=None)] = None
    optimizer: OptimizerConfig = Field(default_factory=lambda: MuonConfig(kind="muon"))
    adapter_smoke_test: bool = False
    adapter_smoke_prompts: list[str] | None = None

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, v: Any) -> int | None:
        return _seed(v)

    @field_validator("learning_rate")
    @classmethod
    def _lr(cls, v: float | None) -> float | None:
        return None if v is None else _positive_in_f32("learning_rate", v)

    @field_validator("lora_alpha")
    @classmethod
    def _alpha(cls, v: float) -> float:
        # The LoRA scale alpha/rank multiplies f32 (or bf16) activations: an alpha that is 0
        # or infinite in f32 would train an adapter that never moves or only overflows.
        return _positive_in_f32("lora_alpha", v)

    @field_validator("base_adapter", "output_name", "resume_checkpoint")
    @classmethod
    def _not_blank(cls, v: str | None, info) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(f"{info.field_name} must not be blank")
        return v

    @field_validator("output_name")
    @classmethod
    def _segment(cls, v: str | None) -> str | None:
        if v is not None and (
            not _NAME_RE.fullmatch(v) or v.endswith(".kiln-checkpoint") or "-checkpoint-step-" in v
        ):
            raise ValueError(
                f"{v!r} must be one path segment of [A-Za-z0-9._-] starting with a letter or digit "
                "(at most 255 bytes) and must not look like an exact checkpoint name"
            )
        return v

    @field_validator("adapter_smoke_prompts")
    @classmethod
    def _prompts(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("adapter_smoke_prompts must be a non-empty array")
        for i, p in enumerate(v):
            if not p.strip():
                raise ValueError(f"adapter_smoke_prompts[{i}] must not be blank")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> SftConfig:
        ratio = self.lora_alpha / self.lora_rank
        if ratio > MAX_LORA_ALPHA_OVER_RANK and not self.allow_high_lora_scale:
            raise ValueError(
                f"unsafe LoRA scaling: lora_alpha/lora_rank = {self.lora_alpha:g}/{self.lora_rank} = "
                f"{ratio:g} exceeds {MAX_LORA_ALPHA_OVER_RANK:g}; lower lora_alpha or set "
                "allow_high_lora_scale=true"
            )
        if f32_round(ratio) <= 0.0:
            raise ValueError(
                f"LoRA scale lora_alpha/lora_rank = {self.lora_alpha:g}/{self.lora_rank} is 0 in f32: the "
                "adapter's update would always be zero; raise lora_alpha"
            )
        if self.truncation == "right" and self.max_length is None:
            raise ValueError('truncation "right" requires max_length (the length rows are cut to)')
        if self.adapter_smoke_prompts is not None and not self.adapter_smoke_test:
            raise ValueError("adapter_smoke_prompts requires adapter_smoke_test=true")
        minimum_rank = optimizer_kind(self.optimizer.kind).minimum_rank
        if self.lora_rank < minimum_rank:
            raise ValueError(
                f"lora_rank must be at least {minimum_rank} for the {self.optimizer.kind} optimizer"
            )
        return self

    # ----- resolution ----------------------------------------------------------------
    @property
    def alpha_over_rank(self) -> float:
        return self.lora_alpha / self.lora_rank

    def resolved_learning_rate(self) -> float:
        return self.learning_rate if self.learning_rate is not None else self.default_learning_rate()

    def default_learning_rate(self) -> float:
        """The optimizer's default (docs/optimizers.md#learning-rate), from its registry entry."""
        return optimizer_kind(self.optimizer.kind).default_learning_rate

    def smoke_prompts(self) -> list[str]:
        return list(self.adapter_smoke_prompts or BUILTIN_SMOKE_PROMPTS)

    def resolve(self, *, seed: int | None = None, server: bool = True) -> SftConfig:
        """The effective config: learning rate and seed resolved, `train_mtp` normalised.

        `seed` is used only when the request carried none; otherwise one is drawn once here.
        """
        if self.train_mtp and server:
            raise invalid_request(
                "train_mtp=true is not permitted by the server: MTP alignment is library-only",
                hint="Omit train_mtp or send false.",
            )
        if self.train_mtp:
            raise invalid_request("train_mtp=true is not implemented by this trainer")
        lr = self.resolved_learning_rate()
        if self.learning_rate is not None:
            default = self.default_learning_rate()
            if lr > default * LR_WARNING_BAND or lr < default / LR_WARNING_BAND:
                log.warning(
                    "learning_rate %g is more than %gx away from the %s default %g",
                    lr,
                    LR_WARNING_BAND,
                    self.optimizer.kind,
                    default,
                )
        eff_seed = self.seed if self.seed is not None else (seed if seed is not None else draw_seed())
        return self.model_copy(update={"learning_rate": lr, "seed": eff_seed, "train_mtp": False})

    def to_json(self) -> dict:
        """JSON form with every optimizer field expanded; the seed as a decimal string."""
        d = self.model_dump(mode="json")
        if d.get("seed") is not None:
            d["seed"] = str(d["seed"])
        return d


def draw_seed() -> int:
    return secrets.randbits(63)


def check_one_row_source(model: BaseModel, sources: tuple[str, ...]) -> None:
    """Exactly one of the `sources` fields of `model` is given (ValueError otherwise); given inline
    `examples` are not empty and a given `dataset_path` is not blank."""
    if sum(getattr(model, name) is not None for name in sources) != 1:
        raise ValueError(f"exactly one of {', '.join(sources[:-1])} or {sources[-1]} is required")
    examples, dataset_path = getattr(model, "examples", None), getattr(model, "dataset_path", None)
    if examples is not None and not examples:
        raise ValueError("examples must contain at least one example")
    if dataset_path is not None and not dataset_path.strip():
        raise ValueError("dataset_path must not be blank")


class ValidationSpec(BaseModel):
    """`validation` of an SFT request: exactly one source of held-out rows, and how often to
    evaluate them besides the baseline and every epoch's end (docs/validation.md)."""

    model_config = _STRICT

    examples: list[dict] | None = None
    dataset_path: str | None = None
    holdout_percent: int | None = Field(default=None, ge=MIN_HOLDOUT_PERCENT, le=MAX_HOLDOUT_PERCENT)
    interval_steps: int | None = Field(default=None, ge=1, le=U64_MAX)

    @model_validator(mode="after")
    def _one_source(self) -> ValidationSpec:
        check_one_row_source(self, ("examples", "dataset_path", "holdout_percent"))
        return self

    @property
    def source(self) -> str:
        """The validation part's `source`: `inline`, `dataset_path` or `holdout`."""
        if self.examples is not None:
            return "inline"
        return "dataset_path" if self.dataset_path is not None else "holdout"


# What a training row may look like (docs/ingestion.md#row-formats), for the OpenAPI document.
ROWS_DESCRIPTION = (
    "Training rows, one object each, in any of these formats (they may mix): `messages` (an "
    "OpenAI-shaped conversation, optional `tools`); `instruction` with optional `input`, `output`, "
    "optional `system` and `history` (a list of [instruction, response] pairs), converted to a "
    "conversation; `prompt`/`completion` as lists of messages (only the completion's assistant "
    "turns are trained) or as strings (raw text, no chat template, one EOS appended). Keys of two "
    "formats, unknown keys beside an instruction or prompt/completion row, empty outputs and empty "
    "assistant answers are row rejections under config.invalid_row_policy."
)
ROW_FORMAT_EXAMPLES = [
    {
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    },
    {"instruction": "Translate to French", "input": "good morning", "output": "bonjour"},
    {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "completion": [{"role": "assistant", "content": "Blue."}],
    },
    {"prompt": "The capital of France is", "completion": " Paris."},
]


class SftRequest(BaseModel):
    """Body of `POST /v1/train/sft`: exactly one data transport plus an optional config."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    examples: list[dict] | None = Field(
        default=None,
        description=ROWS_DESCRIPTION,
        json_schema_extra={"examples": [ROW_FORMAT_EXAMPLES]},
    )
    dataset_path: str | None = Field(
        default=None,
        description="A JSONL file under the server's datasets directory: one row per line, in any of "
        "the row formats `examples` takes; blank lines are skipped but counted in the line numbers "
        "errors name.",
    )
    dataset: str | None = None
    dataset_split: Literal["train", "validation", "holdout"] | None = None
    config: SftConfig = Field(default_factory=SftConfig)
    validation: ValidationSpec | None = None
    post_eval: dict | None = None

    @model_validator(mode="after")
    def _one_transport(self) -> SftRequest:
        check_one_row_source(self, ("examples", "dataset_path", "dataset"))
        if self.dataset_split is not None and self.dataset is None:
            raise ValueError("dataset_split requires a registered named dataset")
        if self.dataset is not None:
            raise ValueError("named datasets are not supported by this server; use examples or dataset_path")
        if self.post_eval is not None:
            raise ValueError("post_eval gates are not supported by this server")
        return self


def describe_validation_error(
    exc: ValidationError, prefix: tuple[str, ...] = (), model: type[BaseModel] | None = None
) -> str:
    """One line per problem, naming the field path (e.g. `config.optimizer.adam_w.beta1`);
    `prefix` is the path of the validated object itself. With the validated `model`, an unknown
    field names the nearest real one and a wrongly shaped tagged object its accepted forms."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (*prefix, *err.get("loc", ())))
        msg = err.get("msg", "invalid")
        msg = msg.removeprefix("Value error, ")
        better = refusal_text(model, err, tuple(err.get("loc", ()))) if model is not None else None
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (not part of the native_online_lora_v1 contract)"
            if better is not None:
                msg += "; " + better.removeprefix("unknown field; ")
        elif better is not None:
            msg = better
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_sft_config(obj: Any, *, field_path: tuple[str, ...] = ()) -> SftConfig:
    """`obj` (None: every default) as an `SftConfig`; a 400 naming each bad field, under
    `field_path` (the library names them `config.<field>`, as the service does)."""
    try:
        return SftConfig.model_validate(obj if obj is not None else {})
    except ValidationError as exc:
        raise invalid_request(describe_validation_error(exc, field_path, SftConfig)) from None


def parse_sft_request(obj: Any) -> SftRequest:
    if not isinstance(obj, dict):
        raise invalid_request("the request body must be a JSON object")
    try:
        return SftRequest.model_validate(obj)
    except ValidationError as exc:
        raise invalid_request(describe_validation_error(exc, model=SftRequest)) from None
