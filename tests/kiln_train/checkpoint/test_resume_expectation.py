"""Resume admission (docs/checkpoints.md#resume): every bound field is compared, the first drift is named."""

from __future__ import annotations

import dataclasses

import pytest

from kiln_train.checkpoint import (
    CheckpointError,
    ResumeExpectation,
    compare_for_resume,
    load_checkpoint,
    seed_for_resume,
    sft_optimizer_record,
    sft_resume_expectation,
    sft_rng_states,
    sft_scheduler_record,
    verify_queued_checkpoint,
)
from kiln_train.ground.backend import backend_for_device
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import parse_sft_config
from tests.kiln_train.checkpoint.checkpoint_support import (
    ADAPTER,
    CONTENT_SHA256,
    ITEM_COUNT,
    SEED,
    auxiliary_state,
    precision_policy,
    publish,
    resolved_config,
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(publish(tmp_path_factory.mktemp("adapters"), 7).path)


def expectation(config=None, **changes) -> ResumeExpectation:
    base = sft_resume_expectation(
        config=config or resolved_config(),
        adapter_name=ADAPTER,
        precision_policy=precision_policy(),
        content_sha256=CONTENT_SHA256,
        item_count=ITEM_COUNT,
        auxiliary_state=auxiliary_state(),
        requested_seed=None,
    )
    return dataclasses.replace(base, **changes)


def _drift(loaded, expected: ResumeExpectation, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        compare_for_resume(loaded.manifest, expected)
    assert message in info.value.message, info.value.message


def test_the_same_run_resumes(loaded):
    compare_for_resume(loaded.manifest, expectation())
    compare_for_resume(loaded.manifest, expectation(requested_seed=SEED))


def test_a_request_without_seed_adopts_the_checkpoint_seed(loaded):
    request = parse_sft_config(
        {
            "epochs": 2,
            "lora_rank": 4,
            "lora_alpha": 8.0,
            "optimizer": {"kind": "adam_w"},
            "resume_checkpoint": "x",
        }
    )
    seed = seed_for_resume(loaded.manifest, request.seed)
    assert seed == SEED
    compare_for_resume(loaded.manifest, expectation(config=request.resolve(seed=seed)))


def test_an_explicit_seed_must_equal_the_checkpoint_seed(loaded):
    with pytest.raises(CheckpointError, match="seed: checkpoint 1234, request 99"):
        seed_for_resume(loaded.manifest, 99)
    _drift(loaded, expectation(requested_seed=99), "seed: checkpoint 1234, request 99")


def test_resume_checkpoint_and_base_adapter_are_not_compared(loaded):
    config = resolved_config(resume_checkpoint="support-bot-checkpoint-step-00000007.kiln-checkpoint")
    config = config.model_copy(update={"base_adapter": "warm-start"})
    expected = expectation(config=config)
    expected = dataclasses.replace(
        expected, effective_config={**expected.effective_config, "resume_checkpoint": "anything"}
    )
    compare_for_resume(loaded.manifest, expected)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lora_rank": 8}, "effective_config.lora_rank: checkpoint 4, request 8"),
        ({"learning_rate": 2e-4}, "effective_config.learning_rate: checkpoint 0.0001, request 0.0002"),
        ({"epochs": 3}, "effective_config.epochs: checkpoint 2, request 3"),
        ({"checkpoint_interval": 5}, "effective_config.checkpoint_interval: checkpoint null, request 5"),
        ({"detect_anomaly": True}, "effective_config.detect_anomaly: checkpoint false, request true"),
        (
            {"optimizer": {"kind": "adam_w", "beta2": 0.99}},
            "effective_config.optimizer.beta2: checkpoint 0.999, request 0.99",
        ),
        # SGD resolves to the same learning rate, so the first drift is the optimizer kind.
        (
            {"optimizer": {"kind": "sgd"}},
            'effective_config.optimizer.kind: checkpoint "adam_w", request "sgd"',
        ),
        ({"seed": 77}, 'effective_config.seed: checkpoint "1234", request "77"'),
        (
            {"invalid_row_policy": "skip"},
            'effective_config.invalid_row_policy: checkpoint "fail", request "skip"',
        ),
        ({"max_length": 512}, "effective_config.max_length: checkpoint null, request 512"),
        (
            {"max_length": 512, "truncation": "right"},
            "effective_config.max_length: checkpoint null, request 512",
        ),
    ],
)
def test_effective_config_drift_names_the_field(loaded, overrides, message):
    _drift(loaded, expectation(config=resolved_config(**overrides)), message)


def test_drift_in_each_bound_part(loaded):
    cuda = backend_for_device("cuda").precision_policy(keeps_state("adam_w"))
    cases = [
        (
            expectation(adapter_name="other-bot"),
            'adapter_name: checkpoint "support-bot", request "other-bot"',
        ),
        (expectation(training_kind="grpo"), 'training_kind: checkpoint "sft", request "grpo"'),
        (
            dataclasses.replace(expectation(), precision_policy=type(expectation().precision_policy)(**cuda)),
            'precision_policy.parameter_dtype: checkpoint "f32", request "bf16"',
        ),
        (
            expectation(data=expectation().data.model_copy(update={"content_sha256": "b" * 64})),
            "data.content_sha256: checkpoint",
        ),
        (
            expectation(data=expectation().data.model_copy(update={"item_count": 6})),
            "data.item_count: checkpoint 5, request 6",
        ),
        (expectation(total_steps=12), "progress.total_steps: checkpoint 10, request 12"),
        (
            expectation(optimizer=sft_optimizer_record(resolved_config("sgd"), 0)),
            'optimizer.kind: checkpoint "adam_w", request "sgd"',
        ),
        (
            expectation(scheduler=sft_scheduler_record(resolved_config(learning_rate=3e-4), 0)),
            "scheduler.state.learning_rate: checkpoint 0.0001, request 0.0003",
        ),
        (
            expectation(rng_states=sft_rng_states(SEED + 1, 0)),
            "rng_states.epoch-order.seed: checkpoint 1234, request 1235",
        ),
        (
            expectation(auxiliary_state=auxiliary_state(base_model_weights_sha256="c" * 64)),
            'auxiliary_state.base_model_weights_sha256: checkpoint "sha256:0c75b469',
        ),
        (
            expectation(
                auxiliary_state=auxiliary_state(
                    execution_provenance={"schema_version": 1, "provenance_sha256": "x"}
                )
            ),
            'auxiliary_state.execution_provenance.provenance_sha256: checkpoint "sha256:',
        ),
        (
            expectation(
                auxiliary_state=auxiliary_state(
                    training_runtime_planning_identity={
                        **auxiliary_state()["training_runtime_planning_identity"],
                        "sft_loss_route": "full_logits",
                    }
                )
            ),
            'auxiliary_state.training_runtime_planning_identity.sft_loss_route: checkpoint "kt_tape_flce", '
            'request "full_logits"',
        ),
        (
            expectation(auxiliary_state=auxiliary_state(kiln_train_version="0.2.0")),
            'auxiliary_state.kiln_train_version: checkpoint "0.1.0", request "0.2.0"',
        ),
        (
            expectation(auxiliary_state={**auxiliary_state(), "extra_identity": 1}),
            "auxiliary_state.extra_identity: checkpoint <absent>, request 1",
        ),
        (
            expectation(
                auxiliary_state=auxiliary_state(
                    base_weight_shard_manifest={
                        **auxiliary_state()["base_weight_shard_manifest"],
                        "shards": [],
                    }
                )
            ),
            "auxiliary_state.base_weight_shard_manifest.shards length: checkpoint 2, request 0",
        ),
    ]
    for expected, message in cases:
        _drift(loaded, expected, message)


def test_the_first_drift_is_reported(loaded):
    expected = expectation(config=resolved_config(lora_rank=8), total_steps=99, adapter_name="x")
    _drift(loaded, expected, 'adapter_name: checkpoint "support-bot", request "x"')
    expected = expectation(config=resolved_config(lora_rank=8), total_steps=99)
    _drift(loaded, expected, "effective_config.lora_rank: checkpoint 4, request 8")


def test_a_finished_checkpoint_has_nothing_to_resume(tmp_path):
    finished = load_checkpoint(publish(tmp_path, 10).path)
    _drift(finished, expectation(), "progress.epoch_index: 2 of 2 epochs")


def test_the_queued_pin_must_match(loaded):
    m = loaded.manifest
    verify_queued_checkpoint(
        loaded, checkpoint_id=m.checkpoint_id, manifest_sha256=loaded.manifest_sha256, seed=SEED
    )
    verify_queued_checkpoint(
        loaded, checkpoint_id=m.checkpoint_id, manifest_sha256="sha256:" + loaded.manifest_sha256, seed=SEED
    )
    with pytest.raises(CheckpointError, match="manifest_sha256: checkpoint"):
        verify_queued_checkpoint(loaded, checkpoint_id=m.checkpoint_id, manifest_sha256="0" * 64, seed=SEED)
    with pytest.raises(
        CheckpointError, match='checkpoint_id: checkpoint "sft-step-00000007", request "sft-step-00000005"'
    ):
        verify_queued_checkpoint(
            loaded, checkpoint_id="sft-step-00000005", manifest_sha256=loaded.manifest_sha256, seed=SEED
        )
    with pytest.raises(CheckpointError, match="seed: checkpoint 1234, request 1"):
        verify_queued_checkpoint(
            loaded, checkpoint_id=m.checkpoint_id, manifest_sha256=loaded.manifest_sha256, seed=1
        )
