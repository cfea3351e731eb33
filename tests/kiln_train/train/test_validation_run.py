"""Held-out validation in `train_sft` (docs/validation.md): when evaluations happen, what they
measure, that they never change a bit of training, and how checkpoints, resumes, cancels and
receipts carry them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln_train import checkpoint as ckpt
from kiln_train.checkpoint.manifest import manifest_from_json
from kiln_train.data.validation import ValidationSet, prepare_validation
from kiln_train.model.lora import release_lora
from kiln_train.sft_config import ValidationSpec
from kiln_train.train import evaluation as evaluation_mod
from kiln_train.train.evaluation import chunked_validation_stats, evaluate, row_validation_stats
from kiln_train.train.loss import sft_loss
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, failed_receipt, ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

N_ROWS, EPOCHS, SEED = 3, 2, 23
RESUMABLE = {"epochs": EPOCHS, "checkpoint_interval": 2}  # a run that leaves checkpoints to resume from


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(N_ROWS))


def with_validation(resident, ingestion, interval=None, rows=None):
    spec = ValidationSpec(examples=rows or conversations(2, offset=40), interval_steps=interval)
    return prepare_validation(spec, ingestion, tokenizer=resident.tokenizer, template=resident.template)


def evaluation_steps(history):
    return [(e["global_step"], e["epoch"]) for e in history]


def checkpoint_files(root, name, file):
    return {p.name: (p / file).read_bytes() for p in sorted(root.glob(f"{name}-checkpoint-step-*"))}


def train_validated(resident, ingested, validation, root, name, resume_checkpoint=None, **config):
    """One run with this module's seed over `ingested`, evaluated on `validation`."""
    return train(
        resident,
        make_config(seed=SEED, **config),
        ingested,
        root,
        adapter_name=name,
        validation=validation,
        resume_checkpoint=resume_checkpoint,
    )


@pytest.mark.parametrize("optimizer", ["adam_w", "muon", "sgd"])
def test_validation_never_changes_a_bit_of_training(resident, ingestion, tmp_path, optimizer):
    config = make_config(seed=SEED, epochs=EPOCHS, optimizer={"kind": optimizer}, checkpoint_interval=2)
    torch.manual_seed(5)
    plain = train(resident, config, ingestion, tmp_path / "plain", adapter_name="bits")
    plain_rng = torch.get_rng_state()
    validated_ingestion, validation = with_validation(resident, ingestion, interval=1)
    evaluated = []
    torch.manual_seed(5)
    validated = train(
        resident,
        config,
        validated_ingestion,
        tmp_path / "validated",
        adapter_name="bits",
        validation=validation,
        on_evaluation=evaluated.append,
    )
    assert plain.status == validated.status == "success", validated.failure_message
    assert torch.equal(torch.get_rng_state(), plain_rng)  # evaluations drew from no global stream
    assert len(evaluated) == EPOCHS * N_ROWS + 1  # interval 1: the baseline and every step
    assert validated.loss_history == plain.loss_history  # exact floats, step by step
    for file in ("adapter_model.safetensors",):
        assert (validated.adapter_path / file).read_bytes() == (plain.adapter_path / file).read_bytes()
    for file in (ckpt.ADAPTER_FILE, ckpt.LOOP_STATE_FILE) + (
        () if optimizer == "sgd" else (ckpt.OPTIMIZER_FILE,)
    ):
        ours = checkpoint_files(tmp_path / "validated", "bits", file)
        theirs = checkpoint_files(tmp_path / "plain", "bits", file)
        assert (
            list(ours)
            == list(theirs)
            == [
                "bits-checkpoint-step-00000002.kiln-checkpoint",
                "bits-checkpoint-step-00000004.kiln-checkpoint",
            ]
        )
        assert ours == theirs, file
    plain_receipt, validated_receipt = plain.receipt, validated.receipt
    assert "validation" not in plain_receipt and "validation" in validated_receipt
    assert validated_receipt["lora_grad_norms"] == plain_receipt["lora_grad_norms"]
    assert validated_receipt["lora_delta_norms"] == plain_receipt["lora_delta_norms"]


def test_evaluations_are_the_baseline_every_epoch_end_and_every_interval(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion, interval=4)
    config = make_config(seed=SEED, epochs=3)
    seen = []
    result = train(
        resident,
        config,
        validated_ingestion,
        tmp_path,
        adapter_name="schedule",
        validation=validation,
        on_evaluation=seen.append,
    )
    assert result.status == "success", result.failure_message
    # 9 steps of 3 rows: epoch ends 3, 6, 9; interval 4: 4, 8; step 0 is the baseline.
    assert evaluation_steps(result.validation_history) == [(0, 0), (3, 1), (4, 1), (6, 2), (8, 2), (9, 3)]
    assert [e.to_json() for e in seen] == result.validation_history
    assert all(e.rows == 2 and e.supervised_tokens == validation.stats.total_supervised_tokens for e in seen)
    for entry in result.validation_history:
        assert math.isfinite(entry["loss"]) and entry["loss"] > 0 and 0 <= entry["token_accuracy"] <= 1
    section = result.receipt["validation"]
    assert section == {
        **validation.identity(),
        "evaluations": result.validation_history,
        "best": min(result.validation_history, key=lambda e: e["loss"]),
    }
    assert list(result.receipt)[-2:] == ["validation", "config"]
    assert result.receipt["data"]["sft_ingestion"]["validation"] == validation.part


def test_the_baseline_is_the_base_model(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion)
    result = train_validated(resident, validated_ingestion, validation, tmp_path, "baseline", epochs=1)
    assert result.status == "success", result.failure_message
    release_lora(resident.model)
    base = evaluate(
        resident.model,
        validation.rows,
        route=resident.backend.sft_loss_route,
        device=torch.device(resident.backend.device),
        global_step=0,
        epoch=0,
    )
    assert result.validation_history[0] == base.to_json()  # B = 0: the adapter is the identity
    assert result.validation_history[-1]["loss"] != base.loss


def test_the_chunked_pass_equals_dense_logits_without_them(resident, ingestion):
    """Loss, arg-max and tie-breaking of the chunked pass against the dense computation."""
    model, route = resident.model, resident.backend.sft_loss_route
    row = ingestion.rows[0]
    with torch.no_grad():
        hidden = model.hidden_states(torch.tensor([row.input_ids]))[0]
        labels = torch.tensor(row.labels)
        stats = row_validation_stats(route, hidden, model.lm_head_weight, labels)
        logits = (hidden @ model.lm_head_weight.t())[:-1]
        targets = labels[1:]
        mask = targets != -100
        dense_ce = torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum")
        mean = sft_loss(route, hidden, model.lm_head_weight, labels)
    assert stats.targets == row.supervised_tokens
    assert stats.ce_sum == pytest.approx(float(dense_ce), rel=1e-6)
    assert stats.ce_sum / stats.targets == pytest.approx(float(mean), rel=1e-6)
    assert stats.correct == int((logits[mask].argmax(1) == targets[mask]).sum())
    # Ties: the arg-max is the first index of the maximum, across chunks and within one.
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    active = torch.tensor([[2.0, 1.0], [0.0, 3.0], [2.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    targets = torch.tensor([2, 1, 0, 3, 4])
    dense = active @ weight.t()
    expected = (dense.argmax(1) == targets).tolist()
    assert expected == [False, True, True, False, False]
    for chunk in (1, 2, 3, 4, 5):
        for block_rows in (None, 1, 2):
            ce, hit = chunked_validation_stats(active, weight, targets, chunk, block_rows)
            assert hit.tolist() == expected, (chunk, block_rows)
            reference = torch.nn.functional.cross_entropy(dense, targets, reduction="none")
            assert torch.allclose(ce, reference)


def test_checkpoints_bind_the_validation_corpus_and_carry_the_history(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion, interval=2)
    result = train_validated(resident, validated_ingestion, validation, tmp_path, "bound", **RESUMABLE)
    assert result.status == "success", result.failure_message
    for record in result.checkpoints:
        manifest = ckpt.load_checkpoint(record["path"], verify_hashes=True).manifest
        aux = manifest.auxiliary_state
        assert aux[ckpt.VALIDATION_AUX_KEY] == validation.identity()
        step = manifest.progress.global_step
        assert aux[ckpt.VALIDATION_HISTORY_AUX_KEY] == [
            e for e in result.validation_history if e["global_step"] <= step
        ]
        assert aux[ckpt.VALIDATION_HISTORY_AUX_KEY][-1]["global_step"] == step  # evaluated before it


def _cancel_during_evaluation(resident, ingestion, validation, root, *, at_step, after_rows, **config):
    """A run whose stop flag goes up while the evaluation at `at_step` has polled `after_rows` rows."""
    state = {"step": 0, "polls": 0, "stopped_at": None}
    real = evaluation_mod.evaluate

    def evaluate(*args, should_stop=None, **kw):
        def poll():
            if kw["global_step"] == at_step:
                state["polls"] += 1
                if state["polls"] > after_rows:
                    state["stopped_at"] = kw["global_step"]
                    return True
            return False

        return real(*args, should_stop=poll if should_stop is not None else None, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr("kiln_train.train.run.evaluate", evaluate)
    try:
        return train(
            resident,
            make_config(seed=SEED, epochs=EPOCHS, **config),
            ingestion,
            root,
            adapter_name="cancel",
            validation=validation,
            should_stop=lambda: state["stopped_at"] is not None,
        ), state
    finally:
        mp.undo()


def test_a_cancel_during_an_evaluation_stops_at_once_and_leaves_the_checkpoint(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(
        resident, ingestion, interval=2, rows=conversations(3, offset=60)
    )
    full = train_validated(
        resident, validated_ingestion, validation, tmp_path / "full", "cancel", epochs=EPOCHS
    )
    result, state = _cancel_during_evaluation(
        resident, validated_ingestion, validation, tmp_path / "cut", at_step=4, after_rows=1
    )
    assert result.failure_reason == "cancelled", result.failure_message
    assert state["polls"] == 2  # the second row's poll stopped it: the third row never ran
    assert result.global_step == 4
    receipt = failed_receipt(result, tmp_path / "cut")
    assert [e["global_step"] for e in receipt["validation"]["evaluations"]] == [0, 2, 3]
    (written,) = list((tmp_path / "cut").glob("*.kiln-checkpoint"))
    manifest = ckpt.load_checkpoint(written, verify_hashes=True).manifest
    assert manifest.progress.global_step == 4
    assert [e["global_step"] for e in manifest.auxiliary_state[ckpt.VALIDATION_HISTORY_AUX_KEY]] == [0, 2, 3]

    # The resume evaluates the step the cancel interrupted first, then continues: the whole history
    # and the adapter are the uninterrupted run's, bit for bit.
    resumed = train_validated(
        resident, validated_ingestion, validation, tmp_path / "cut", "cancel", written, epochs=EPOCHS
    )
    assert resumed.status == "success", resumed.failure_message
    assert resumed.validation_history == full.validation_history
    assert evaluation_steps(resumed.validation_history) == [(0, 0), (2, 0), (3, 1), (4, 1), (6, 2)]
    assert resumed.receipt["validation"]["evaluations"] == full.receipt["validation"]["evaluations"]
    assert (resumed.adapter_path / "adapter_model.safetensors").read_bytes() == (
        full.adapter_path / "adapter_model.safetensors"
    ).read_bytes()


def test_a_cancel_during_the_baseline_trains_nothing(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion)
    result, state = _cancel_during_evaluation(
        resident, validated_ingestion, validation, tmp_path, at_step=0, after_rows=1
    )
    assert result.failure_reason == "cancelled" and "before any further step" in result.failure_message
    assert result.global_step == 0 and result.validation_history == []
    assert not list(tmp_path.glob("*.kiln-checkpoint"))
    assert failed_receipt(result, tmp_path)["validation"]["evaluations"] == []


def test_a_resume_continues_the_history_and_refuses_another_validation_corpus(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion, interval=2)
    done = {"n": 0}
    first = train(
        resident,
        make_config(seed=SEED, **RESUMABLE),
        validated_ingestion,
        tmp_path,
        adapter_name="resumed",
        validation=validation,
        progress=lambda r: done.__setitem__("n", r.global_step),
        should_stop=lambda: done["n"] >= 2,
    )
    assert first.failure_reason == "cancelled"
    point = tmp_path / "resumed-checkpoint-step-00000002.kiln-checkpoint"
    full = train_validated(
        resident, validated_ingestion, validation, tmp_path / "full", "resumed", **RESUMABLE
    )

    other_ingestion, other = with_validation(
        resident, ingestion, interval=2, rows=conversations(2, offset=80)
    )
    for ingested, vset, fragment in (
        (other_ingestion, other, "auxiliary_state.validation.corpus_sha256"),
        (ingestion, None, "auxiliary_state.validation: checkpoint"),
        (
            validated_ingestion,
            ValidationSet(validation.rows, validation.part, 3),
            "auxiliary_state.validation.interval_steps: checkpoint 2, request 3",
        ),
    ):
        refused = train_validated(
            resident, ingested, vset, tmp_path / "refused", "resumed", point, **RESUMABLE
        )
        assert refused.status == "failed" and fragment in refused.failure_message, refused.failure_message
        assert refused.global_step == 0

    resumed = train_validated(
        resident, validated_ingestion, validation, tmp_path, "resumed", point, **RESUMABLE
    )
    assert resumed.status == "success", resumed.failure_message
    assert resumed.validation_history == full.validation_history
    assert resumed.loss_history == full.loss_history


def test_a_plain_checkpoint_refuses_a_resume_with_validation(resident, ingestion, tmp_path):
    config = make_config(seed=SEED, **RESUMABLE)
    done = {"n": 0}
    train(
        resident,
        config,
        ingestion,
        tmp_path,
        adapter_name="plain",
        progress=lambda r: done.__setitem__("n", r.global_step),
        should_stop=lambda: done["n"] >= 2,
    )
    validated_ingestion, validation = with_validation(resident, ingestion)
    refused = train(
        resident,
        config,
        validated_ingestion,
        tmp_path / "refused",
        adapter_name="plain",
        validation=validation,
        resume_checkpoint=tmp_path / "plain-checkpoint-step-00000002.kiln-checkpoint",
    )
    assert refused.status == "failed"
    assert "auxiliary_state" in refused.failure_message and "validation" in refused.failure_message


def test_validation_rows_must_match_the_receipt_that_admitted_them(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion)
    for ingested, vset in (
        (validated_ingestion, None),
        (ingestion, validation),
        (validated_ingestion, ValidationSet(validation.rows[:1], validation.part, None)),
    ):
        result = train_validated(resident, ingested, vset, tmp_path, "rows", epochs=1)
        assert result.failure_reason == "data_schema_error", result.failure_message
        assert result.validation_history == []


def test_the_manifest_rules_check_the_validation_members(resident, ingestion, tmp_path):
    validated_ingestion, validation = with_validation(resident, ingestion, interval=2)
    result = train_validated(resident, validated_ingestion, validation, tmp_path, "rules", **RESUMABLE)
    path = result.checkpoints[0]["path"]
    manifest = json.loads((ckpt.load_checkpoint(path).path / ckpt.MANIFEST_FILENAME).read_text())
    history = manifest["auxiliary_state"][ckpt.VALIDATION_HISTORY_AUX_KEY]
    identity = manifest["auxiliary_state"][ckpt.VALIDATION_AUX_KEY]
    cases = [
        ({ckpt.VALIDATION_HISTORY_AUX_KEY: None}, "validation_history: must be a list"),
        ({ckpt.VALIDATION_AUX_KEY: {**identity, "rows": 0}}, "auxiliary_state.validation.rows"),
        (
            {ckpt.VALIDATION_AUX_KEY: {**identity, "extra": 1}},
            "auxiliary_state.validation: must be an object",
        ),
        ({ckpt.VALIDATION_HISTORY_AUX_KEY: [*history, {**history[-1], "global_step": 3}]}, "global_step: 3"),
        ({ckpt.VALIDATION_HISTORY_AUX_KEY: [{**history[0], "loss": float("nan")}]}, "loss"),
        ({ckpt.VALIDATION_HISTORY_AUX_KEY: [{**history[0], "token_accuracy": 1.5}]}, "token_accuracy"),
        ({ckpt.VALIDATION_HISTORY_AUX_KEY: list(reversed(history))}, "global_step"),
    ]
    for change, fragment in cases:
        broken = json.loads(json.dumps(manifest))
        broken["auxiliary_state"].update(change)
        with pytest.raises(ckpt.CheckpointError) as info:
            ckpt.validate_manifest(manifest_from_json(broken))
        assert fragment in info.value.detail, (fragment, info.value.detail)
    lone = json.loads(json.dumps(manifest))
    del lone["auxiliary_state"][ckpt.VALIDATION_HISTORY_AUX_KEY]
    with pytest.raises(ckpt.CheckpointError, match="both"):
        ckpt.validate_manifest(manifest_from_json(lone))


def test_finetune_takes_validation_like_the_service(resident, ingestion, tmp_path):
    from kiln_train import KilnError, finetune

    config = {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "adam_w"}, "seed": SEED}
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in conversations(2, offset=90)), encoding="utf-8")
    seen = []
    result = finetune(
        resident,
        conversations(4),
        config,
        tmp_path / "out",
        validation={"dataset_path": str(held), "interval_steps": 3},
        on_evaluation=seen.append,
    )
    assert result.status == "success", result.failure_message
    assert evaluation_steps(result.validation_history) == [(0, 0), (3, 0), (4, 1), (6, 1), (8, 2)]
    assert [e.to_json() for e in seen] == result.validation_history
    part = result.receipt["data"]["sft_ingestion"]["validation"]
    assert part["source"] == "dataset_path" and part["rows_kept"] == 2
    holdout = finetune(
        resident, conversations(8), config, tmp_path / "holdout", validation={"holdout_percent": 25}
    )
    assert holdout.total_steps == 12 and holdout.receipt["validation"]["rows"] == 2
    for validation, fragment in (
        ({"holdout_percent": 60}, "validation.holdout_percent"),
        ({"bogus": 1}, "validation.bogus: unknown field"),
    ):
        with pytest.raises(KilnError) as info:
            finetune(resident, conversations(4), config, tmp_path / "refused", validation=validation)
        assert fragment in info.value.detail
    assert not (tmp_path / "refused").exists()
