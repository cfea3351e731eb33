"""`train_receipt.json` (docs/artifacts.md#train-receipt): one SFT attempt, success or failure.

The receipt is evidence about a run, not a checkpoint: the loss curve lives in the job store and in
checkpoints' `sft_loop_state.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln_train.artifacts.adapter_layout import ADAPTER_CONFIG, ADAPTER_MODEL, TRAIN_RECEIPT
from kiln_train.errors import FAILURE_REASONS
from kiln_train.ground.digest import utc_now_rfc3339
from kiln_train.model.config import ATTENTION_TARGETS, GDN_TARGETS, MLP_TARGETS
from kiln_train.model.random_init import random_init_of

RECEIPT_TYPE = "kiln_train_receipt"
ADAPTER_MANIFEST_TYPE = "kiln_adapter_manifest"
# `adapters.base` / `adapters.output` when there is no such adapter.
NULL_ADAPTER_IDENTITY = {"path": None, "adapter_model_sha256": None, "adapter_model_bytes": None}


def _present(obj: dict) -> dict:
    """Drop the keys whose value is None: the contract's optional (`?`) fields are omitted, not null."""
    return {k: v for k, v in obj.items() if v is not None}


def _device_peak_mib(facts: RunFacts) -> float | None:
    """`runtime.peak_vram_mib`: device memory only. On the CPU backend `peak_memory_bytes` is the
    process's host RSS, which is not VRAM, so the field is null there."""
    device = ((facts.execution_provenance or {}).get("backend") or {}).get("device") or ""
    if facts.peak_memory_bytes is None or not device.startswith("cuda"):
        return None
    return round(facts.peak_memory_bytes / 2**20, 1)


@dataclass
class RunFacts:
    """Everything a receipt records, gathered by the trainer as the run proceeds."""

    adapter_name: str
    config: dict  # effective SftConfig JSON (learning rate and seed resolved)
    learning_rate: float
    seed: int
    rank: int
    alpha: float
    epochs: int
    ingestion: dict  # kiln.sft-ingestion.v1
    loss_route: str
    training_precision: dict
    execution_provenance: dict | None
    model_path: str | None
    model_identity: dict  # model/tokenizer/template digests (provenance.model_identity)
    base_weight_shard_manifest: dict | None
    package_version: str
    git_commit: str | None = None
    git_dirty: bool | None = None
    env_config_hash: str | None = None
    base_adapter: dict = field(default_factory=lambda: dict(NULL_ADAPTER_IDENTITY))
    tokens_per_epoch: int = 0
    supervised_per_epoch: int = 0
    epochs_completed: int = 0
    steps_completed: int = 0
    wall_clock_ms: int = 0
    peak_memory_bytes: int | None = None
    cpu_threads: int | None = None
    lora_grad_norms: list[dict] = field(default_factory=list)
    adapter_smoke_test: dict | None = None
    phase_timings: dict = field(default_factory=dict)
    validation: dict | None = None  # kiln.sft-validation.v1 (docs/validation.md); None without validation
    requested_config: dict | None = None  # the request's `config` as sent; None when not known
    attempts: dict | None = None  # the service's deliveries of this job (docs/recovery.md)


def build_receipt(
    facts: RunFacts,
    *,
    status: str,
    failure_reason: str | None = None,
    failure_message: str | None = None,
    output: dict | None = None,
    lora_delta_norms: list[dict] | None = None,
) -> dict:
    """Assemble the receipt in the contract's field order."""
    if status not in ("success", "failed"):
        raise ValueError(f"receipt status must be success or failed, not {status!r}")
    if status == "failed" and failure_reason not in FAILURE_REASONS:
        raise ValueError(f"unknown failure_reason {failure_reason!r}")
    receipt = {
        "schema_version": 1,
        "receipt_type": RECEIPT_TYPE,
        "adapter_name": facts.adapter_name,
        "produced_at": utc_now_rfc3339(),
        "status": status,
        "failure_reason": failure_reason if status == "failed" else None,
    }
    if status == "failed":
        receipt["failure_message"] = failure_message
    # `|null` fields are always present; `?` fields (docs/artifacts.md#receipt-fields) are omitted
    # when unknown rather than written as null.
    receipt.update(_provenance_sections(facts, output))
    receipt.update(_training_sections(facts, succeeded=status == "success"))
    receipt.update(
        {
            "runtime": _runtime_section(facts),
            "config_hashes": _config_hashes(facts),
            "lora_delta_norms": lora_delta_norms or [],
            "lora_grad_norms": facts.lora_grad_norms,
        }
    )
    if facts.adapter_smoke_test is not None:
        receipt["adapter_smoke_test"] = facts.adapter_smoke_test
    # additive, present only for a run with held-out validation (so a run without it writes the
    # receipt it always did): the corpus, every evaluation and the best one
    if facts.validation is not None:
        receipt["validation"] = facts.validation
    # additive: the request as sent beside the effective config ("asked vs ran"), when known
    if facts.requested_config is not None:
        receipt["requested_config"] = facts.requested_config
    # additive, present only for a service run: this attempt's number and the progress record of
    # each earlier attempt a worker lost (docs/recovery.md#attempts-that-make-progress)
    if facts.attempts is not None:
        receipt["attempts"] = facts.attempts
    receipt["config"] = facts.config
    return receipt


def _provenance_sections(facts: RunFacts, output: dict | None) -> dict:
    """`kiln`, `model`, `tokenizer`, `adapters` and `training_data`: what the run was made from."""
    ing, ident = facts.ingestion, facts.model_identity
    return {
        "kiln": {
            "git_commit": facts.git_commit,
            "git_dirty": facts.git_dirty,
            "git_source": "git" if facts.git_commit else None,
            "package_version": facts.package_version,
            **_present({"env_config_hash": facts.env_config_hash}),
        },
        "model": {
            "path": facts.model_path,
            "config_hash": ident.get("model_config_sha256"),
            **_present({"base_weight_shard_manifest": facts.base_weight_shard_manifest}),
            # additive: present only for a random checkpoint Kiln drew (its preset and seed)
            **_present({"random_init": random_init_of(facts.model_path)}),
        },
        "tokenizer": {
            "config_hash": ident.get("tokenizer_vocab_sha256"),
            **_present(
                {
                    "tokenizer_config_hash": ident.get("tokenizer_config_sha256"),
                    "chat_template_hash": ident.get("chat_template_sha256"),
                    "training_chat_template_hash": ident.get("training_chat_template_sha256"),
                }
            ),
        },
        "adapters": {"base": facts.base_adapter, "output": output or dict(NULL_ADAPTER_IDENTITY)},
        "training_data": {
            "source": ing["source"],
            "path": ing.get("source_locator"),
            "sha256": ing["kept_corpus_sha256"],
        },
    }


def _training_sections(facts: RunFacts, *, succeeded: bool) -> dict:
    """From `hyperparameters` to `phase_timings`: how the run trained and on how much. The RL
    sections (GRPO, echo, rewards) record that SFT used none of them."""
    ing = facts.ingestion
    trained = ing["rows_kept"] * facts.epochs if succeeded else facts.steps_completed
    epochs_for_tokens = facts.epochs if succeeded else facts.epochs_completed
    context = facts.tokens_per_epoch - facts.supervised_per_epoch
    return {
        "hyperparameters": {
            "mode": "sft",
            "rank": facts.rank,
            "alpha": facts.alpha,
            "alpha_over_rank": facts.alpha / facts.rank,
            "learning_rate": facts.learning_rate,
            "epochs": facts.epochs,
            "seed": str(facts.seed),
            "shuffle": True,
        },
        "grpo": None,
        "echo": {
            "enabled": False,
            "lambda": None,
            "env_mask_mode": None,
            "warning_filter": None,
            "initial_env_ce": None,
            "final_env_ce": None,
        },
        "no_policy_loss": False,
        "data": {
            "examples_read": ing["rows_read"],
            "examples_filtered": ing["rows_rejected"],
            "examples_trained": trained,
            **dict.fromkeys(_RL_DATA_COUNTS, 0),
            "sft_ingestion": ing,
        },
        "rewards": _NO_REWARDS | {"group_variance_histogram": []},
        "token_counts": {
            "action_tokens": facts.supervised_per_epoch * epochs_for_tokens,
            **dict.fromkeys(_ENV_TOKEN_COUNTS, 0),
            "context_tokens": context * epochs_for_tokens,
        },
        "phase_timings": {**dict.fromkeys(_PHASE_TIMINGS, 0), **facts.phase_timings},
    }


# Fields of the RL sections that an SFT run records as zero or null, in the contract's order.
_RL_DATA_COUNTS = (
    "groups_read",
    "groups_filtered",
    "groups_trained",
    "completions_read",
    "completions_trained",
    "reward_groups_filtered",
    "reward_groups_kept",
)
_NO_REWARDS = {
    "count": 0,
    "mean": None,
    "stdev": None,
    "min": None,
    "max": None,
    "group_count": 0,
    "all_pass_group_count": 0,
    "all_fail_group_count": 0,
    "degenerate_group_count": 0,
}
_ENV_TOKEN_COUNTS = (
    "env_tokens",
    "env_tokens_before_warning_filter",
    "env_tokens_after_warning_filter",
    "warning_tokens_filtered",
)
_PHASE_TIMINGS = (
    "tokenize_ms",
    "mask_build_ms",
    "reference_forward_ms",
    "policy_forward_ms",
    "backward_ms",
    "optimizer_ms",
    "gpu_writer_wait_ms",
    "gpu_writer_held_ms",
    "gpu_writer_acquisitions",
)


def _runtime_section(facts: RunFacts) -> dict:
    return {
        "wall_clock_ms": facts.wall_clock_ms,
        "peak_vram_mib": _device_peak_mib(facts),
        **_present(
            {
                "sft_loss_route": facts.loss_route,
                "execution_provenance": facts.execution_provenance,
                "training_precision": facts.training_precision,
            }
        ),
        # additive (allowed within version 1): the backend's peak, host RSS on CPU
        "peak_memory_bytes": facts.peak_memory_bytes,
        # additive: torch's intra-op thread count the run's CPU kernels used (it changes
        # how CPU reductions split, hence bits; a resume runs with the recorded count)
        **_present({"cpu_threads": facts.cpu_threads}),
    }


def _config_hashes(facts: RunFacts) -> dict:
    ident = facts.model_identity
    return _present(
        {
            "tokenizer_config_hash": ident.get("tokenizer_config_sha256"),
            "chat_template_hash": ident.get("chat_template_sha256"),
            "training_chat_template_hash": ident.get("training_chat_template_sha256"),
            "model_config_hash": ident.get("model_config_sha256"),
            "kiln_env_config_hash": facts.env_config_hash,
        }
    )


def adapter_manifest(receipt: dict, hashes: dict, *, parent_adapter: str | None) -> dict:
    """`adapter_manifest.json` (docs/artifacts.md#adapter-manifest), written only for a successful run."""
    ident = receipt["tokenizer"]
    return {
        "schema_version": 1,
        "manifest_type": ADAPTER_MANIFEST_TYPE,
        "adapter_name": receipt["adapter_name"],
        "safetensors_hash": hashes["safetensors_hash"],
        "config_hash": hashes["config_hash"],
        "receipt_hash": hashes["receipt_hash"],
        "parent_adapter": parent_adapter,
        "model_config_hash": receipt["model"]["config_hash"],
        "training_chat_template_hash": ident.get("training_chat_template_hash"),
        "base_weight_shard_manifest": receipt["model"].get("base_weight_shard_manifest"),
        "execution_provenance": receipt["runtime"].get("execution_provenance"),
        "training_precision": receipt["runtime"].get("training_precision"),
        "kiln_commit": receipt["kiln"]["git_commit"],
        "training_data_hash": receipt["training_data"]["sha256"],
        "training_data_source": receipt["training_data"]["source"],
        "training_data_path": receipt["training_data"]["path"],
        "openenv_training_data": None,
        **manifest_layout("train_receipt", TRAIN_RECEIPT),
    }


def manifest_layout(receipt_key: str, receipt_file: str) -> dict:
    """The `target_modules` and `files` members of an adapter manifest; `files[receipt_key]` names
    the adapter's receipt (`train_receipt` for a training run, `import_receipt` for a PEFT import)."""
    return {
        "target_modules": {
            "full_attention": list(ATTENTION_TARGETS),
            "gated_deltanet": list(GDN_TARGETS),
            "mlp": list(MLP_TARGETS),
        },
        "files": {
            "adapter_model": ADAPTER_MODEL,
            "adapter_config": ADAPTER_CONFIG,
            receipt_key: receipt_file,
        },
    }
