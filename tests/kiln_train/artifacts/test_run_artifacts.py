"""Schema-style checks of real artifacts against docs/ingestion.md#ingestion-receipt,
docs/artifacts.md#train-receipt and docs/artifacts.md#peft-adapter.

One tiny run per outcome (success with the adapter smoke test, a warm start from that adapter, a
cancelled run, a missing base adapter) and every written file is compared with the contract's
field names, order, types, nullability and enum values.
"""

from __future__ import annotations

import json
import re

import pytest
from safetensors import safe_open

from kiln_train.artifacts.adapter import adapter_config
from kiln_train.ground.digest import file_digest
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.train.canary import canary_status
from tests.kiln_train.artifacts.receipt_checks import ADAPTER_CONFIG_KEYS, validate_receipt
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json, train

resident, tiny_dir = fx.resident, fx.tiny_dir  # shared fixtures

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
NULL_IDENTITY = {"path": None, "adapter_model_sha256": None, "adapter_model_bytes": None}
FAILURE_CATEGORIES = {
    "data_schema_error", "adapter_load_failed", "zero_groups", "zero_action_tokens",
    "zero_env_tokens", "cancelled", "unsupported_loss_config", "nan_loss", "oom",
    "shape_mismatch", "unsafe_lora_scale", "base_adapter_missing", "training_error",
}  # fmt: skip
TOP_LEVEL = [
    "schema_version", "receipt_type", "adapter_name", "produced_at", "status", "failure_reason",
    "failure_message", "kiln", "model", "tokenizer", "adapters", "training_data",
    "hyperparameters", "grpo", "echo", "no_policy_loss", "data", "rewards", "token_counts",
    "phase_timings", "runtime", "config_hashes", "lora_delta_norms", "lora_grad_norms",
    "adapter_smoke_test", "requested_config", "config",
]  # fmt: skip
OPTIONAL_TOP = {"failure_message", "adapter_smoke_test", "requested_config"}
# field -> (required keys in order, optional keys); `|null` keys are required, `?` keys optional
SUB = {
    "kiln": (["git_commit", "git_dirty", "git_source", "package_version"], ["env_config_hash"]),
    "model": (["path", "config_hash"], ["base_weight_shard_manifest", "random_init"]),
    "tokenizer": (["config_hash"], ["tokenizer_config_hash", "chat_template_hash", "training_chat_template_hash"]),
    "adapters": (["base", "output"], []),
    "training_data": (["source", "path", "sha256"], ["openenv"]),
    "hyperparameters": (
        ["mode", "rank", "alpha", "alpha_over_rank", "learning_rate", "epochs", "seed", "shuffle"], []
    ),
    "echo": (["enabled", "lambda", "env_mask_mode", "warning_filter", "initial_env_ce", "final_env_ce"], []),
    "data": (
        ["examples_read", "examples_filtered", "examples_trained", "groups_read", "groups_filtered",
         "groups_trained", "completions_read", "completions_trained", "reward_groups_filtered",
         "reward_groups_kept"],
        ["reward_filter_sidecar", "sft_ingestion"],
    ),
    "rewards": (
        ["count", "mean", "stdev", "min", "max", "group_count", "all_pass_group_count",
         "all_fail_group_count", "degenerate_group_count", "group_variance_histogram"], []
    ),
    "token_counts": (
        ["action_tokens", "env_tokens", "env_tokens_before_warning_filter",
         "env_tokens_after_warning_filter", "warning_tokens_filtered", "context_tokens"], []
    ),
    "phase_timings": (
        ["tokenize_ms", "mask_build_ms", "reference_forward_ms", "policy_forward_ms", "backward_ms",
         "optimizer_ms", "gpu_writer_wait_ms", "gpu_writer_held_ms", "gpu_writer_acquisitions"], []
    ),
    "runtime": (
        ["wall_clock_ms", "peak_vram_mib"], ["sft_loss_route", "execution_provenance", "training_precision"]
    ),
    "config_hashes": (
        [], ["tokenizer_config_hash", "chat_template_hash", "training_chat_template_hash",
             "model_config_hash", "kiln_env_config_hash"]
    ),
}  # fmt: skip
# allowed within version 1, after the contract's fields
ADDITIVE = {"runtime": ["peak_memory_bytes", "cpu_threads"]}
INGESTION = [
    "schema", "source", "source_locator", "invalid_row_policy", "rows_read", "rows_kept",
    "rows_rejected", "kept_row_hashes", "rejected_rows", "kept_corpus_sha256",
]  # fmt: skip
DELTA_NORM = [
    "module", "pair_count", "a_l2_mean", "a_l2_max", "b_l2_mean", "b_l2_max",
    "delta_l2_upper_bound_mean", "delta_l2_upper_bound_max",
]  # fmt: skip
GRAD_NORM = ["module", "sample_count", "min", "mean", "max"]
SMOKE_PROMPT = [
    "prompt", "finite_logits", "logit_delta_l2", "generated_text_different", "base_output",
    "adapter_output", "adapter_output_tokens", "adapter_output_chars", "base_generation_ms",
    "adapter_generation_ms",
]  # fmt: skip
OUTCOMES = {
    "non_finite_logits", "empty_adapter_output", "logits_changed_text_changed",
    "logits_changed_text_identical", "text_changed_without_measurable_logit_delta", "no_logit_change",
}  # fmt: skip
CANARY_CHECKS = [
    "simple_short_completion", "simple_tool_call_shaped_prompt", "output_length_sanity",
    "finite_logits", "latency_sanity", "nonzero_logit_delta_from_base",
]  # fmt: skip
MANIFEST_REQUIRED = ["adapter_name", "safetensors_hash", "config_hash"]
MANIFEST_ORDER = [
    "schema_version", "manifest_type", "adapter_name", "safetensors_hash", "config_hash",
    "receipt_hash", "parent_adapter", "model_config_hash", "training_chat_template_hash",
    "base_weight_shard_manifest", "execution_provenance", "training_precision", "kiln_commit",
    "training_data_hash", "training_data_source", "training_data_path", "openenv_training_data",
]  # fmt: skip


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _in_contract_order(keys: list[str], order: list[str]) -> bool:
    known = [k for k in keys if k in order]
    return known == [k for k in order if k in keys]


def check_receipt_shape(r: dict) -> None:
    """Every rule a reader can check on one receipt (docs/artifacts.md#train-receipt); AssertionError names the first broken one."""
    _check_envelope(r)
    _check_sections(r)
    _check_identities(r)
    _check_hyperparameters(r)
    _check_data(r)
    _check_runtime(r)
    _check_norms_smoke_and_config(r)
    validate_receipt(r)


def _check_envelope(r: dict) -> None:
    """Top-level keys and their order, the envelope fields and the outcome."""
    keys = list(r)
    assert _in_contract_order(keys, TOP_LEVEL) and set(keys) <= set(TOP_LEVEL), keys
    assert set(TOP_LEVEL) - OPTIONAL_TOP <= set(keys), set(TOP_LEVEL) - set(keys)
    assert r["schema_version"] == 1 and r["receipt_type"] == "kiln_train_receipt"
    assert isinstance(r["adapter_name"], str) and r["adapter_name"]
    assert RFC3339.match(r["produced_at"]), r["produced_at"]
    assert r["status"] in ("success", "failed")
    if r["status"] == "success":
        assert r["failure_reason"] is None and r.get("failure_message") is None
    else:
        assert r["failure_reason"] in FAILURE_CATEGORIES
        assert isinstance(r["failure_message"], str) and r["failure_message"]


def _check_sections(r: dict) -> None:
    """Each section's required keys first, then optional and additive ones, in order; none null."""
    for name, (required, optional) in SUB.items():
        obj, extra = r[name], ADDITIVE.get(name, [])
        assert list(obj)[: len(required)] == required, (name, list(obj))
        assert set(obj) <= set(required) | set(optional) | set(extra), (name, set(obj))
        assert _in_contract_order(list(obj), required + optional + extra), (name, list(obj))
        for key in optional:  # `?` fields are omitted when unknown, never null
            assert obj.get(key, "absent") is not None, f"{name}.{key} is null; omit it instead"


def _check_identities(r: dict) -> None:
    """The Kiln build, every digest, and the base and output adapter identities."""
    k = r["kiln"]
    assert k["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", k["git_commit"])
    assert k["git_dirty"] in (None, True, False) and k["git_source"] in (None, "git")
    assert isinstance(k["package_version"], str) and k["package_version"]
    for digest in (
        r["model"]["config_hash"],
        r["tokenizer"]["config_hash"],
        *[r["tokenizer"].get(f) for f in SUB["tokenizer"][1]],
        *r["config_hashes"].values(),
        k.get("env_config_hash"),
    ):
        assert digest is None or DIGEST.match(digest), digest
    for side in ("base", "output"):
        ident = r["adapters"][side]
        assert list(ident) == ["path", "adapter_model_sha256", "adapter_model_bytes"]
        if ident["path"] is None:
            assert ident == NULL_IDENTITY
        else:
            assert DIGEST.match(ident["adapter_model_sha256"]) and _is_int(ident["adapter_model_bytes"])


def _check_hyperparameters(r: dict) -> None:
    """SFT hyperparameters, and the RL sections an SFT run leaves empty."""
    hp = r["hyperparameters"]
    assert hp["mode"] == "sft" and hp["shuffle"] is True
    assert _is_int(hp["rank"]) and _is_num(hp["alpha"]) and _is_num(hp["learning_rate"])
    assert hp["alpha_over_rank"] == pytest.approx(hp["alpha"] / hp["rank"])
    assert _is_int(hp["epochs"]) and re.fullmatch(r"\d+", hp["seed"])  # seeds: decimal strings
    assert hp["learning_rate"] == r["config"]["learning_rate"] and hp["seed"] == r["config"]["seed"]
    assert r["grpo"] is None and "opd" not in r and r["no_policy_loss"] is False
    assert r["echo"] == {
        "enabled": False, "lambda": None, "env_mask_mode": None, "warning_filter": None,
        "initial_env_ce": None, "final_env_ce": None,
    }  # fmt: skip


def _check_data(r: dict) -> None:
    """Data counts against the ingestion receipt, rewards and token counts."""
    hp = r["hyperparameters"]
    data, ing = r["data"], r["data"]["sft_ingestion"]
    assert [data[f] for f in SUB["data"][0][3:]] == [0] * 7
    assert _in_contract_order(list(ing), INGESTION) and set(ing) <= set(INGESTION)
    assert ing["schema"] == "kiln.sft-ingestion.v1"
    assert data["examples_read"] == ing["rows_read"] and data["examples_filtered"] == ing["rows_rejected"]
    if r["status"] == "success":
        assert data["examples_trained"] == ing["rows_kept"] * hp["epochs"]
    assert r["training_data"] == {
        "source": ing["source"], "path": ing.get("source_locator"), "sha256": ing["kept_corpus_sha256"],
    }  # fmt: skip
    rw = r["rewards"]
    assert rw["count"] == rw["group_count"] == 0 and rw["group_variance_histogram"] == []
    assert rw["mean"] is rw["stdev"] is rw["min"] is rw["max"] is None
    tc = r["token_counts"]
    assert all(_is_int(v) and v >= 0 for v in tc.values()) and tc["env_tokens"] == 0


def _check_runtime(r: dict) -> None:
    """Phase timings, runtime, training precision and the template digest."""
    assert all(_is_int(v) for v in r["phase_timings"].values())
    rt = r["runtime"]
    assert _is_int(rt["wall_clock_ms"])
    assert rt["peak_vram_mib"] is None or _is_num(rt["peak_vram_mib"])
    assert rt["sft_loss_route"] in ("kt_tape_flce", "vulkan_active_rows", "full_logits")
    tp = rt["training_precision"]
    assert list(tp) == [
        "parameter_dtype", "optimizer_state_dtype", "activation_dtype", "gradient_dtype", "stochastic_rounding",
    ]  # fmt: skip
    assert tp["stochastic_rounding"] == {"mode": "round_to_nearest"}
    assert r["config_hashes"].get("training_chat_template_hash") == r["tokenizer"].get(
        "training_chat_template_hash"
    )


def _check_norms_smoke_and_config(r: dict) -> None:
    """LoRA norm rows, the smoke test and the effective config."""
    ing = r["data"]["sft_ingestion"]
    for row in r["lora_delta_norms"]:
        assert list(row) == DELTA_NORM and row["module"] in LORA_TARGET_MODULES
    for row in r["lora_grad_norms"]:
        assert list(row) == GRAD_NORM and row["module"] in LORA_TARGET_MODULES
    if r["status"] == "failed":
        assert r["lora_delta_norms"] == [] and r["adapters"]["output"] == NULL_IDENTITY
    if "adapter_smoke_test" in r:
        check_smoke_shape(r["adapter_smoke_test"])
    assert r["config"]["training_profile"] == "native_online_lora_v1"
    assert r["config"]["invalid_row_policy"] == ing["invalid_row_policy"]


def check_smoke_shape(s: dict) -> None:
    assert list(s)[:3] == ["enabled", "passed", "warnings"]
    assert set(s) <= {"enabled", "passed", "warnings", "notes", "prompt_diagnostics", "prompts"}
    assert s["enabled"] is True and s["passed"] is (not s["warnings"])
    for p in s["prompts"]:
        assert list(p) == SMOKE_PROMPT
        assert p["logit_delta_l2"] is None or _is_num(p["logit_delta_l2"])
        assert isinstance(p["generated_text_different"], bool) and _is_int(p["adapter_output_tokens"])
    for d in s.get("prompt_diagnostics", []):
        assert list(d) == ["prompt", "outcome", "explanation"] and d["outcome"] in OUTCOMES


def check_adapter_dir(path, receipt: dict, *, parent: str | None, rank: int, alpha: float) -> None:
    """docs/artifacts.md#peft-adapter: the files, adapter_config.json, tensor names/dtypes and adapter_manifest.json."""
    cfg_text = (path / "adapter_config.json").read_text()
    assert json.loads(cfg_text) == adapter_config(rank, alpha)
    assert list(json.loads(cfg_text)) == ADAPTER_CONFIG_KEYS
    assert cfg_text.startswith("{\n  ")  # pretty-printed
    cfg = json.loads(cfg_text)
    assert _is_int(cfg["r"]) and isinstance(cfg["lora_alpha"], float)
    assert cfg["target_modules"] == list(LORA_TARGET_MODULES)
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
        key_re = re.compile(
            r"^base_model\.model\.model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.(\w+)\.lora_[AB]\.weight$"
        )
        blocks = {"self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
                  "linear_attn": {"in_proj_qkv", "in_proj_z", "out_proj"},  # docs/artifacts.md#tensor-names
                  "mlp": {"gate_proj", "up_proj", "down_proj"}}  # fmt: skip
        for key in keys:
            m = key_re.match(key)
            assert m and m.group(2) in blocks[m.group(1)], key
            t = fh.get_tensor(key)
            assert str(t.dtype) in ("torch.float32", "torch.bfloat16")
            assert t.shape[0 if ".lora_A." in key else 1] == rank
        assert {k.replace("lora_A", "lora_B") for k in keys if "lora_A" in k} == {
            k for k in keys if "lora_B" in k
        }
    m = read_json(path / "adapter_manifest.json")
    assert all(m.get(f) for f in MANIFEST_REQUIRED)
    assert _in_contract_order(list(m), MANIFEST_ORDER + ["files"])
    assert m["schema_version"] == 1 and m["manifest_type"] == "kiln_adapter_manifest"
    assert m["adapter_name"] == receipt["adapter_name"] == path.name
    assert m["safetensors_hash"] == file_digest(path / "adapter_model.safetensors")
    assert m["safetensors_hash"] == receipt["adapters"]["output"]["adapter_model_sha256"]
    assert m["config_hash"] == file_digest(path / "adapter_config.json")
    assert m["receipt_hash"] == file_digest(path / "train_receipt.json")
    assert m["parent_adapter"] == parent
    assert m["model_config_hash"] == receipt["model"]["config_hash"]
    assert m["training_chat_template_hash"] == receipt["tokenizer"]["training_chat_template_hash"]
    assert m["base_weight_shard_manifest"] == receipt["model"]["base_weight_shard_manifest"]
    assert m["execution_provenance"] == receipt["runtime"]["execution_provenance"]
    assert m["training_precision"] == receipt["runtime"]["training_precision"]
    assert m["kiln_commit"] == receipt["kiln"]["git_commit"]
    assert m["training_data_hash"] == receipt["training_data"]["sha256"]
    assert m["training_data_source"] == receipt["training_data"]["source"]
    assert m["training_data_path"] == receipt["training_data"]["path"]
    assert m["openenv_training_data"] is None
    assert m["files"] == {
        "adapter_model": "adapter_model.safetensors",
        "adapter_config": "adapter_config.json",
        "train_receipt": "train_receipt.json",
    }


@pytest.fixture(scope="module")
def runs(resident, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract-artifacts")
    ing = ingest(resident, conversations(3))
    out = {"root": root}
    out["ok"] = train(
        resident, make_config(epochs=1, adapter_smoke_test=True), ing, root, adapter_name="c-ok"
    )
    out["warm"] = train(
        resident, make_config(epochs=1, base_adapter="c-ok"), ing, root, adapter_name="c-warm"
    )
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 1

    out["cancel"] = train(
        resident, make_config(epochs=2), ing, root, adapter_name="c-cancel", should_stop=stop
    )
    out["missing"] = train(
        resident, make_config(epochs=1, base_adapter="absent"), ing, root, adapter_name="c-miss"
    )
    return out


def test_success_with_smoke_test_matches_the_contract(runs):
    result = runs["ok"]
    assert result.status == "success"
    path = result.adapter_path
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_canary_status.json",
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "train_receipt.json",
    ]
    receipt = read_json(path / "train_receipt.json")
    check_receipt_shape(receipt)
    assert "failure_message" not in receipt and list(receipt)[-2:] == ["adapter_smoke_test", "config"]
    assert receipt["runtime"]["peak_vram_mib"] is None  # CPU backend: host RSS is not VRAM
    assert receipt["adapters"]["base"] == NULL_IDENTITY
    check_adapter_dir(path, receipt, parent=None, rank=4, alpha=8.0)
    status = read_json(path / "adapter_canary_status.json")
    assert list(status["checks"]) == CANARY_CHECKS
    assert all(isinstance(v, bool) for v in status["checks"].values())
    assert status == canary_status(receipt["adapter_smoke_test"])
    assert status["passed"] is receipt["adapter_smoke_test"]["passed"]


def test_warm_start_records_the_base_adapter(runs):
    result = runs["warm"]
    assert result.status == "success"
    receipt = read_json(result.adapter_path / "train_receipt.json")
    check_receipt_shape(receipt)
    assert "adapter_smoke_test" not in receipt
    base = runs["ok"].adapter_path
    assert receipt["adapters"]["base"] == {
        "path": str(base),
        "adapter_model_sha256": file_digest(base / "adapter_model.safetensors"),
        "adapter_model_bytes": (base / "adapter_model.safetensors").stat().st_size,
    }
    assert not (result.adapter_path / "adapter_canary_status.json").exists()
    check_adapter_dir(result.adapter_path, receipt, parent="c-ok", rank=4, alpha=8.0)


@pytest.mark.parametrize(("run", "reason"), [("cancel", "cancelled"), ("missing", "base_adapter_missing")])
def test_failed_receipts_match_the_contract(runs, run, reason):
    result = runs[run]
    receipt = fx.failed_receipt(result, runs["root"])
    check_receipt_shape(receipt)
    assert receipt["failure_reason"] == reason
    assert "adapter_smoke_test" not in receipt
    assert receipt["data"]["examples_trained"] == result.global_step


def test_the_shape_check_rejects_a_null_optional_field(runs):
    receipt = read_json(runs["ok"].adapter_path / "train_receipt.json")
    receipt["kiln"]["env_config_hash"] = None
    with pytest.raises(AssertionError, match="kiln.env_config_hash is null"):
        check_receipt_shape(receipt)


def test_canary_status_without_prompts_claims_nothing():
    failed = {"enabled": True, "passed": False, "warnings": ["smoke test failed to run: boom"], "prompts": []}
    status = canary_status(failed)
    assert status["passed"] is False
    assert status["checks"] == dict.fromkeys(CANARY_CHECKS, False)


def test_canary_tool_call_check_needs_the_tool_call_output():
    def prompt(text: str, tokens: int) -> dict:
        return {
            "prompt": text, "finite_logits": True, "logit_delta_l2": 1.0, "generated_text_different": True,
            "base_output": "a", "adapter_output": "b" * tokens, "adapter_output_tokens": tokens,
            "adapter_output_chars": tokens, "base_generation_ms": 1.0, "adapter_generation_ms": 1.0,
        }  # fmt: skip

    tool = "Return a compact JSON tool call for a weather lookup in Paris:"
    smoke = {"enabled": True, "passed": True, "warnings": [], "prompts": [prompt("x", 2), prompt(tool, 0)]}
    assert canary_status(smoke)["checks"]["simple_tool_call_shaped_prompt"] is False
    smoke["prompts"][1] = prompt(tool, 3)
    assert canary_status(smoke)["checks"]["simple_tool_call_shaped_prompt"] is True
    smoke["prompts"] = [prompt("x", 2)]
    assert canary_status(smoke)["checks"]["simple_tool_call_shaped_prompt"] is False
