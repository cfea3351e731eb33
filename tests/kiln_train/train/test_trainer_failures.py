"""Every SFT failure category the trainer can meet, provoked for real, with its failed receipt.

docs/training-profile.md#update-rule (divergence guard), docs/training-profile.md#gradient-set,
docs/training-profile.md#anomaly-detection, docs/errors.md#failure-reasons (failure categories).
The base-adapter categories (`base_adapter_missing`, `shape_mismatch`, `adapter_load_failed`) are
provoked in test_adapter.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln_train.checkpoint import load_checkpoint
from kiln_train.model import attach_lora
from kiln_train.optim import request_optimizer as optimizer_mod
from kiln_train.train import run as run_mod
from kiln_train.train.resident import load_resident
from kiln_train.train.run import SftRun
from tests.kiln_train.artifacts.receipt_checks import validate_receipt
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, failed_receipt, ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 5


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(3))


def _check_failed(result, root, reason: str, match: str | None = None) -> dict:
    assert result.status == "failed", "the run should have failed"
    assert result.failure_reason == reason, result.failure_message
    if match is not None:
        assert match in result.failure_message, result.failure_message
    receipt = failed_receipt(result, root)
    validate_receipt(receipt)
    return receipt


class StepSpy:
    """Wraps the run's optimizer: snapshots leaves, state and counters around every step."""

    def __init__(self, monkeypatch):
        self.opt = None
        self.at_failure: dict | None = None
        real_build = optimizer_mod.build_optimizer

        def build(*args, **settings):
            opt = real_build(*args, **settings)
            real_step = opt.step

            def step(grads):
                before = self.snapshot(opt)
                try:
                    real_step(grads)
                except Exception:
                    self.at_failure = {"before": before, "after": self.snapshot(opt)}
                    raise

            opt.step = step
            self.opt = opt
            return opt

        monkeypatch.setattr(optimizer_mod, "build_optimizer", build)

    @staticmethod
    def snapshot(opt) -> dict:
        return {
            "params": {n: p.detach().clone() for n, p in opt.params.items()},
            "state": {n: {f: t.clone() for f, t in s.items()} for n, s in opt.state.items()},
            "step_count": opt.step_count,
            "param_steps": dict(opt.param_steps),
        }

    def assert_nothing_changed(self, steps_done: int) -> None:
        assert self.at_failure is not None, "the optimizer step did not fail"
        before, after = self.at_failure["before"], self.at_failure["after"]
        assert after["step_count"] == before["step_count"] == steps_done
        assert after["param_steps"] == before["param_steps"] == dict.fromkeys(before["params"], steps_done)
        for name, p in before["params"].items():
            assert torch.equal(after["params"][name], p), name
            for f, t in before["state"][name].items():
                assert torch.equal(after["state"][name][f], t), (name, f)


class StepCounter:
    """A progress callback counting completed steps; `after_step_2` runs once step 2 is done (the
    graph breaks below start there)."""

    def __init__(self, after_step_2=None):
        self.done = 0
        self.after_step_2 = after_step_2

    def __call__(self, report):
        self.done = report.global_step
        if report.global_step == 2 and self.after_step_2 is not None:
            self.after_step_2()


MODULE = "layers.1.mlp.down_proj"
LEAF = f"base_model.model.model.{MODULE}"


@pytest.mark.parametrize("how", ["drop_lora_path", "detach_lora_b"])
def test_a_severed_graph_fails_at_the_gradient_set_boundary(resident, ingestion, tmp_path, monkeypatch, how):
    """From step 3 on one projection loses (part of) its LoRA path: the step is refused intact.

    The layers compute their projections with their own backward (`model/recompute.py`), which
    reads the projection's `lora_A`/`lora_B`: the break swaps them out of the graph the optimizer's
    leaves are in (the leaves themselves stay what the optimizer holds)."""
    spy = StepSpy(monkeypatch)
    module = resident.model.get_submodule(MODULE)

    def sever():
        if how == "drop_lora_path":
            monkeypatch.setattr(module, "lora_A", None)
            monkeypatch.setattr(module, "lora_B", None)
        else:
            frozen = torch.nn.Parameter(module.lora_B.detach().clone(), requires_grad=False)
            monkeypatch.setattr(module, "lora_B", frozen)

    counter = StepCounter(after_step_2=sever)
    result = train(resident, make_config(seed=SEED), ingestion, tmp_path, progress=counter)
    missing = f"{LEAF}.lora_A.weight" if how == "drop_lora_path" else f"{LEAF}.lora_B.weight"
    count = 2 if how == "drop_lora_path" else 1
    receipt = _check_failed(
        result,
        tmp_path,
        "training_error",
        f"gradient set is missing {count} trainable leaf(s), first {missing!r}",
    )
    spy.assert_nothing_changed(steps_done=2)
    assert result.global_step == 2 and len(result.loss_history) == 2
    assert receipt["data"]["examples_trained"] == 2


class NaNGrad(torch.autograd.Function):
    """Identity forward; its backward returns NaN (a corrupt backward operation)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _inject_nan(monkeypatch, model, layer: int) -> None:
    """Layer `layer`'s MLP output (what its down_proj produced) gets a NaN gradient."""
    module = model.get_submodule(f"layers.{layer}.mlp")
    real_forward = module.forward
    monkeypatch.setattr(module, "forward", lambda *args, **kw: NaNGrad.apply(real_forward(*args, **kw)))


def test_a_nan_gradient_is_refused_before_the_optimizer_changes_anything(
    resident, ingestion, tmp_path, monkeypatch
):
    spy = StepSpy(monkeypatch)
    _inject_nan(monkeypatch, resident.model, 2)
    result = train(resident, make_config(seed=SEED), ingestion, tmp_path)
    receipt = _check_failed(result, tmp_path, "training_error", "is not finite")
    assert "tape position" not in result.failure_message  # the per-operation scan is off by default
    assert receipt["config"]["detect_anomaly"] is False
    spy.assert_nothing_changed(steps_done=0)


@pytest.mark.parametrize("segments", [1, 2])
def test_detect_anomaly_names_the_first_bad_operation_and_its_tape_position(
    resident, ingestion, tmp_path, monkeypatch, segments
):
    positions = {}
    for layer in (3, 0):
        with monkeypatch.context() as mp:
            _inject_nan(mp, resident.model, layer)
            config = make_config(seed=SEED, detect_anomaly=True, grad_checkpoint_segments=segments)
            root = tmp_path / f"layer{layer}"
            result = train(resident, config, ingestion, root)
        receipt = _check_failed(
            result, root, "nan_loss", "detect_anomaly: backward operation NaNGradBackward"
        )
        assert "produced NaN" in result.failure_message
        assert receipt["config"]["detect_anomaly"] is True
        positions[layer] = int(result.failure_message.split("tape position ")[1].split()[0])
    # Backward runs from the loss towards the embedding: the last layer's op comes first.
    assert 0 < positions[3] < positions[0]


def test_a_non_finite_loss_fails_the_run_and_is_never_skipped(tiny_dir, ingestion, tmp_path):
    """A copy of the model whose final norm turns infinite after step 2: step 3's loss is NaN."""
    copy = load_resident(tiny_dir)
    counter = StepCounter()

    def poison(report):
        counter(report)
        if report.global_step == 2:
            with torch.no_grad():
                copy.model.norm.weight.fill_(float("inf"))

    result = train(copy, make_config(seed=SEED, epochs=3), ingestion, tmp_path, progress=poison)
    receipt = _check_failed(result, tmp_path, "nan_loss", "non-finite loss nan at global step 3")
    assert counter.done == 2 and result.global_step == 2 and len(result.loss_history) == 2
    assert receipt["data"]["examples_trained"] == 2


def _scaled_loss(monkeypatch, rows: int, factor: float) -> None:
    """Multiply every loss after the first epoch by `factor` (gradients included)."""
    real = run_mod.sft_loss
    calls = {"n": 0}

    def loss(*args):
        calls["n"] += 1
        value = real(*args)
        return value * factor if calls["n"] > rows else value

    monkeypatch.setattr(run_mod, "sft_loss", loss)


def test_the_divergence_guard_stops_a_run_whose_loss_explodes(resident, ingestion, tmp_path, monkeypatch):
    _scaled_loss(monkeypatch, rows=3, factor=10.0)
    result = train(resident, make_config(seed=SEED, epochs=3), ingestion, tmp_path)
    _check_failed(result, tmp_path, "training_error", "divergence guard: epoch 2 mean loss")
    assert result.global_step == 6  # checked at the end of epoch 2, the first epoch it applies to
    first = sum(result.loss_history[:3]) / 3
    second = sum(result.loss_history[3:]) / 3
    assert second > 8 * first and second - first > 5


def test_the_divergence_guard_tolerates_a_moderate_rise(resident, ingestion, tmp_path, monkeypatch):
    _scaled_loss(monkeypatch, rows=3, factor=1.5)
    result = train(resident, make_config(seed=SEED, epochs=2), ingestion, tmp_path)
    assert result.status == "success", result.failure_message


@pytest.mark.parametrize(
    ("first", "best", "avg", "fails"),
    [
        (0.5, 0.5, 5.0, False),  # 10x the first epoch, but only 4.5 above the best
        (2.0, 2.0, 17.0, True),  # 8.5x the first and 15 above the best
        (2.0, 1.0, 15.9, False),  # 7.95x the first: under the ratio
        (2.0, 1.0, 16.5, True),  # 8.25x the first and 15.5 above the best
    ],
)
def test_the_divergence_rule_needs_both_the_ratio_and_the_margin(
    resident, ingestion, tmp_path, first, best, avg, fails
):
    run = SftRun(
        resident,
        make_config(seed=SEED, epochs=3),
        ingestion,
        loss_route="kt_tape_flce",
        registry=tmp_path,
        adapter_name="guard",
        plan={"max_segments": 1, "auto": False, "budget_bytes": None},
        run_id="unit",
    )
    lp = run.loop
    lp.epoch_index, lp.first_epoch_loss, lp.best_epoch_loss = 1, first, best
    lp.epoch_loss_sum, lp.epoch_items, lp.cursor = avg * run.n, run.n, run.n
    if fails:
        with pytest.raises(Exception, match="divergence guard"):
            run._end_epoch()
    else:
        run._end_epoch()
        assert lp.epoch_index == 2 and lp.best_epoch_loss == min(best, avg) and lp.cursor == 0


def test_cooperative_cancel_checkpoints_and_fails_as_cancelled(resident, ingestion, tmp_path):
    counter = StepCounter()
    result = train(
        resident,
        make_config(seed=SEED, epochs=2),
        ingestion,
        tmp_path,
        adapter_name="stopper",
        progress=counter,
        should_stop=lambda: counter.done >= 2,
    )
    _check_failed(result, tmp_path, "cancelled", "training cancelled by user at global step 2 of 6")
    assert [c["global_step"] for c in result.checkpoints] == [2]
    ckpt = tmp_path / "stopper-checkpoint-step-00000002.kiln-checkpoint"
    loaded = load_checkpoint(ckpt, verify_hashes=True)
    assert (loaded.manifest.progress.epoch_index, loaded.manifest.progress.cursor_in_epoch) == (0, 2)


def test_a_stop_request_on_the_last_step_does_not_fail_the_run(resident, ingestion, tmp_path):
    counter = StepCounter()
    result = train(
        resident,
        make_config(seed=SEED, epochs=1),
        ingestion,
        tmp_path,
        progress=counter,
        should_stop=lambda: counter.done >= 3,
    )
    assert result.status == "success" and result.checkpoints == []


def test_a_pinned_route_other_than_the_backends_is_unsupported(resident, ingestion, tmp_path):
    result = train(resident, make_config(seed=SEED), ingestion, tmp_path, loss_route="full_logits")
    _check_failed(result, tmp_path, "unsupported_loss_config", "pinned SFT loss route 'full_logits' differs")
    assert result.global_step == 0 and not list(tmp_path.glob("*.kiln-checkpoint"))


def test_full_logits_cannot_run_with_several_checkpoint_segments(resident, ingestion, tmp_path):
    full = dataclasses.replace(
        resident, backend=dataclasses.replace(resident.backend, sft_loss_route="full_logits")
    )
    config = make_config(seed=SEED, epochs=1, grad_checkpoint_segments=2)
    result = train(full, config, ingestion, tmp_path / "two", loss_route="full_logits")
    _check_failed(result, tmp_path / "two", "unsupported_loss_config", "full_logits cannot run with 2")
    one = train(full, make_config(seed=SEED, epochs=1), ingestion, tmp_path / "one", loss_route="full_logits")
    assert one.status == "success", one.failure_message
    assert one.receipt["runtime"]["sft_loss_route"] == "full_logits"


def test_train_mtp_is_refused_by_the_trainer(resident, ingestion, tmp_path):
    config = make_config(seed=SEED).model_copy(update={"train_mtp": True})
    result = train(resident, config, ingestion, tmp_path)
    _check_failed(result, tmp_path, "unsupported_loss_config", "train_mtp")


def test_an_unsafe_lora_scale_that_bypassed_validation_is_refused(resident, ingestion, tmp_path):
    config = make_config(seed=SEED).model_copy(update={"lora_alpha": 64.0})  # 64/4 = 16 > 2
    result = train(resident, config, ingestion, tmp_path)
    receipt = _check_failed(result, tmp_path, "unsafe_lora_scale", "alpha/rank = 16 exceeds 2")
    assert receipt["hyperparameters"]["alpha_over_rank"] == 16.0
    allowed = config.model_copy(update={"allow_high_lora_scale": True, "epochs": 1})
    assert train(resident, allowed, ingestion, tmp_path / "allowed").status == "success"


def _replace_row(ingestion, index: int, **changes):
    rows = list(ingestion.rows)
    rows[index] = dataclasses.replace(rows[index], **changes)
    return dataclasses.replace(ingestion, rows=rows)


def test_a_row_without_supervised_targets_is_zero_action_tokens(resident, ingestion, tmp_path):
    row = ingestion.rows[1]
    no_targets = _replace_row(ingestion, 1, labels=[-100] * row.seq_len, supervised_tokens=0)
    result = train(resident, make_config(seed=SEED), no_targets, tmp_path / "a")
    _check_failed(result, tmp_path / "a", "zero_action_tokens", f"row {row.row_index}")
    # A row that claims targets but whose labels carry none is caught by the loss itself.
    lying = _replace_row(ingestion, 1, labels=[-100] * row.seq_len)
    result = train(resident, make_config(seed=SEED), lying, tmp_path / "b")
    _check_failed(result, tmp_path / "b", "zero_action_tokens", "no supervised next-token target")


def test_rows_that_do_not_match_their_receipt_are_a_data_schema_error(resident, ingestion, tmp_path):
    dropped = dataclasses.replace(ingestion, rows=ingestion.rows[:-1])
    result = train(resident, make_config(seed=SEED), dropped, tmp_path / "a")
    _check_failed(result, tmp_path / "a", "data_schema_error", "do not match their ingestion receipt")
    receipt = dict(ingestion.receipt, kept_corpus_sha256="sha256:" + "0" * 64)
    result = train(
        resident, make_config(seed=SEED), dataclasses.replace(ingestion, receipt=receipt), tmp_path / "b"
    )
    assert result.failure_reason == "data_schema_error" and "does not recompute" in result.failure_message
    row = ingestion.rows[0]
    labels = list(row.labels)
    labels[-1] = 10**7  # outside the vocabulary
    result = train(
        resident, make_config(seed=SEED), _replace_row(ingestion, 0, labels=labels), tmp_path / "c"
    )
    _check_failed(result, tmp_path / "c", "data_schema_error", "outside the vocabulary")


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
    ],
)
def test_running_out_of_memory_is_oom(resident, ingestion, tmp_path, monkeypatch, error):
    real_step = SftRun.step

    def step(self, row_pos):
        if self.loop.global_step == 1:
            raise error
        return real_step(self, row_pos)

    monkeypatch.setattr(SftRun, "step", step)
    result = train(resident, make_config(seed=SEED), ingestion, tmp_path)
    _check_failed(result, tmp_path, "oom", type(error).__name__)
    assert result.global_step == 1


def test_an_unexpected_exception_is_a_training_error_and_releases_the_model(
    resident, ingestion, tmp_path, monkeypatch
):
    monkeypatch.setattr(SftRun, "step", lambda self, row_pos: (_ for _ in ()).throw(RuntimeError("kaboom")))
    result = train(resident, make_config(seed=SEED), ingestion, tmp_path)
    _check_failed(result, tmp_path, "training_error", "RuntimeError: kaboom")
    assert resident.model.lora is None  # the LoRA set was detached: the next job starts clean
    assert all(getattr(m, "lora_A", None) is None for m in resident.model.modules())
    attach_lora(resident.model, 2, 2.0, 0).remove(resident.model)


def test_an_existing_output_name_fails_before_training(resident, ingestion, tmp_path):
    (tmp_path / "taken").mkdir()
    result = train(resident, make_config(seed=SEED), ingestion, tmp_path, adapter_name="taken")
    assert result.failure_reason == "training_error" and "adapter_already_exists" in result.failure_message
    assert result.global_step == 0 and list((tmp_path / "taken").iterdir()) == []
