"""The request-body constraints of the OpenAPI document that the validators enforce.

`api.openapi` builds the document from the pydantic models' JSON Schemas; `constrain` writes into
them what those schemas cannot say by themselves (kiln_train.sft_config, api.admission): the
ranges, patterns and lengths the validators check (`REQUEST_CONSTRAINTS`), the one-of rules of the
data transports and validation sources, and the config's cross-field rules.
"""

from __future__ import annotations

import math

from kiln.store import Admission
from kiln_train.optim.kinds import registered
from kiln_train.sft_config import U64_MAX, SftConfig

NON_BLANK = "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"  # not blank, no NUL (api.http.unstorable_value)
ADAPTER_NAME = {  # output_name / base_adapter (kiln_train/plan/names.py: adapter_name_problem)
    "type": "string",
    "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$",
    "not": {"anyOf": [{"pattern": "\\.kiln-checkpoint$"}, {"pattern": "-checkpoint-step-"}]},
}
# Finite and still finite and positive after rounding to f32 (sft_config._lr, _alpha): half the smallest
# subnormal rounds to 0, half an ulp above the largest f32 rounds to infinity.
F32_POSITIVE = {
    "type": "number",
    "exclusiveMinimum": math.ldexp(1.0, -150),
    "exclusiveMaximum": math.ldexp(1.0, 128) - math.ldexp(1.0, 103),
}
UNSUPPORTED = "Not supported by this server: any value but null is refused (400)."


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


REQUEST_CONSTRAINTS: dict[str, dict[str, dict]] = {
    "SftRequest": {
        "examples": _nullable({"type": "array", "minItems": 1, "items": {"type": "object"}}),
        "dataset_path": _nullable(
            {
                "type": "string",
                "pattern": NON_BLANK,
                "maxLength": Admission.__table__.c.dataset_path.type.length,
            }
        ),
        "dataset": {"type": "null", "description": UNSUPPORTED},
        "dataset_split": {"type": "null", "description": UNSUPPORTED},
        "post_eval": {"type": "null", "description": UNSUPPORTED},
    },
    # Held-out validation rows (kiln_train.sft_config.ValidationSpec, docs/validation.md).
    "ValidationSpec": {
        "examples": _nullable({"type": "array", "minItems": 1, "items": {"type": "object"}}),
        "dataset_path": _nullable(
            {
                "type": "string",
                "pattern": NON_BLANK,
                "maxLength": Admission.__table__.c.dataset_path.type.length,
            }
        ),
    },
    "SftConfig": {
        "learning_rate": _nullable(F32_POSITIVE),
        "lora_alpha": F32_POSITIVE,
        "train_mtp": _nullable({"const": False, "description": "true is refused by the server (400)."}),
        "base_adapter": _nullable(ADAPTER_NAME),
        "output_name": _nullable(ADAPTER_NAME),
        "resume_checkpoint": _nullable({"type": "string", "pattern": NON_BLANK}),
        "seed": {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": U64_MAX},
                {"type": "string", "pattern": "^[0-9]{1,20}$", "description": "u64 as a decimal string"},
                {"type": "null"},
            ]
        },
        "adapter_smoke_prompts": _nullable(
            {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": NON_BLANK}}
        ),
    },
    # HF/TRL interop (api.hf): the export request and the run it describes.
    "HfSftExportRequest": {
        "examples": _nullable({"type": "array", "minItems": 1, "items": {"type": "object"}}),
        "dataset_path": _nullable(
            {
                "type": "string",
                "pattern": NON_BLANK,
                "maxLength": Admission.__table__.c.dataset_path.type.length,
            }
        ),
        "input_adapter": _nullable(ADAPTER_NAME),
    },
    "HfExportConfig": {
        "learning_rate": _nullable(F32_POSITIVE),
        "lora_alpha": F32_POSITIVE,
        "seed": {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": U64_MAX},
                {"type": "string", "pattern": "^[0-9]{1,20}$", "description": "u64 as a decimal string"},
                {"type": "null"},
            ]
        },
    },
}
# Exactly one data transport (SftRequest._one_transport); `dataset` is refused above.
SFT_TRANSPORTS = {
    "oneOf": [
        {"required": ["examples"], "properties": {"examples": {"type": "array"}}},
        {"required": ["dataset_path"], "properties": {"dataset_path": {"type": "string"}}},
    ]
}


# Exactly one validation source (ValidationSpec._one_source); interval_steps goes with any.
VALIDATION_SOURCES = {
    "oneOf": [
        {"required": ["examples"], "properties": {"examples": {"type": "array"}}},
        {"required": ["dataset_path"], "properties": {"dataset_path": {"type": "string"}}},
        {"required": ["holdout_percent"], "properties": {"holdout_percent": {"type": "integer"}}},
    ]
}


# adapter_smoke_prompts requires adapter_smoke_test=true (SftConfig._cross_field).
SMOKE_PROMPTS_RULE = {
    "if": {
        "required": ["adapter_smoke_prompts"],
        "properties": {"adapter_smoke_prompts": {"type": "array"}},
    },
    "then": {
        "required": ["adapter_smoke_test"],
        "properties": {"adapter_smoke_test": {"const": True}},
    },
}


def optimizer_rank_rules() -> list[dict]:
    """Each registered optimizer's minimum lora_rank above 1 (muon: 2), also when it is the default
    that an omitted `optimizer` means."""
    default_kind = SftConfig().optimizer.kind
    rules = []
    for entry in registered():
        if entry.minimum_rank <= 1:
            continue
        chosen = {"properties": {"optimizer": {"properties": {"kind": {"const": entry.kind}}}}}
        when = [{"not": {"required": ["optimizer"]}}, chosen] if entry.kind == default_kind else [chosen]
        rules.append(
            {"if": {"anyOf": when}, "then": {"properties": {"lora_rank": {"minimum": entry.minimum_rank}}}}
        )
    return rules


def sft_config_rules() -> dict:
    """The cross-field rules a schema can say (SftConfig._cross_field); alpha/rank <= 2 it cannot."""
    return {"allOf": [SMOKE_PROMPTS_RULE, *optimizer_rank_rules()]}


def request_constraints() -> dict[str, dict[str, dict]]:
    """`REQUEST_CONSTRAINTS` and each registered optimizer's request object's field ranges."""
    optimizers = {e.config.__name__: dict(e.schema_constraints) for e in registered() if e.schema_constraints}
    return {**REQUEST_CONSTRAINTS, **optimizers}


# The export's run must be one the pinned TRL runner reproduces: muon is refused (400
# hf_export_unsupported, kiln_train.interop.bundle.refuse_unsupported_optimizer).
HF_EXPORT_CONFIG_RULES = {
    "not": {
        "required": ["optimizer"],
        "properties": {"optimizer": {"required": ["kind"], "properties": {"kind": {"const": "muon"}}}},
    }
}


def constrain(components: dict) -> dict:
    """The pydantic JSON Schemas `components` with the constraints above written in (in place)."""
    for model, fields in request_constraints().items():
        properties = components[model]["properties"]
        for name, schema in fields.items():
            kept = {
                k: v
                for k, v in properties[name].items()
                if k in ("title", "default", "description", "examples")
            }
            properties[name] = {**kept, **schema}
    components["SftRequest"].update(SFT_TRANSPORTS)
    components["ValidationSpec"].update(VALIDATION_SOURCES)
    components["SftConfig"].update(sft_config_rules())
    components["HfSftExportRequest"].update(SFT_TRANSPORTS)
    components["HfExportConfig"].update(HF_EXPORT_CONFIG_RULES)
    return components
