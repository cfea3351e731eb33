"""`train_sft` on the tiny model: the native_online_lora_v1 update contract and the success artifacts.

docs/training-profile.md#update-rule, docs/artifacts.md#train-receipt, docs/artifacts.md#peft-adapter
and docs/checkpoints.md#resume.
"""

from __future__ import annotations

import json
import math
from datetime import datetime

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kiln_train.artifacts.adapter import adapter_config, parse_key
from kiln_train.artifacts.provenance import verify_provenance_digest
from kiln_train.checkpoint import epoch_order, load_checkpoint
from kiln_train.ground.digest import file_digest
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.optim import request_optimizer as optimizer_mod
from tests.kiln_train.artifacts.receipt_checks import ADAPTER_CONFIG_KEYS, validate_receipt
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

N_ROWS, EPOCHS, SEED = 5, 2, 11


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(N_ROWS))


@pytest.fixture(scope="module")
def sgd_run(resident, ingestion, tmp_path_factory):
    """One SGD run observed step by step: progress reports and every optimizer step's tensors."""
    root = tmp_path_factory.mktemp("sgd-run")
    config = make_config(
        seed=SEED, epochs=EPOCHS, optimizer={"kind": "sgd"}, learning_rate=0.05, checkpoint_interval=4
    )
    reports, steps = [], []
    real_build = optimizer_mod.build_optimizer

    def build(*args, **settings):
        opt = real_build(*args, **settings)
        real_step = opt.step

        def step(grads):
            before = {n: p.detach().clone() for n, p in opt.params.items()}
            real_step(grads)
            after = {n: p.detach().clone() for n, p in opt.params.items()}
            steps.append((before, {n: g.clone() for n, g in grads.items()}, after, opt.lr))

        opt.step = step
        return opt

    mp = pytest.MonkeyPatch()
    mp.setattr(optimizer_mod, "build_optimizer", build)
    try:
        result = train(
            resident, config, ingestion, root, adapter_name="sgd-contract", progress=reports.append
        )
    finally:
        mp.undo()
    return {"config": config, "result": result, "reports": reports, "steps": steps, "root": root}


def test_one_conversation_per_step_in_the_seeded_epoch_order(sgd_run, ingestion):
    result, reports = sgd_run["result"], sgd_run["reports"]
    assert result.status == "success", result.failure_message
    total = EPOCHS * N_ROWS
    assert result.total_steps == result.global_step == total
    assert [r.global_step for r in reports] == list(range(1, total + 1))
    assert all(r.total_steps == total for r in reports)
    for epoch in range(EPOCHS):
        in_epoch = reports[epoch * N_ROWS : (epoch + 1) * N_ROWS]
        assert {r.epoch for r in in_epoch} == {epoch}
        assert [r.cursor for r in in_epoch] == list(range(1, N_ROWS + 1))
        assert [r.item for r in in_epoch] == epoch_order(SEED, epoch, N_ROWS)
        assert sorted(r.item for r in in_epoch) == list(range(N_ROWS))  # every row exactly once
    assert epoch_order(SEED, 0, N_ROWS) != epoch_order(SEED, 1, N_ROWS)  # a real reshuffle
    for r in reports:
        row = ingestion.rows[r.item]
        assert r.row_index == row.row_index
        assert (r.tokens, r.supervised_tokens) == (row.seq_len, row.supervised_tokens)
    assert result.loss_history == [r.loss for r in reports]
    assert len(result.loss_history) == total and result.final_loss == result.loss_history[-1]
    assert all(math.isfinite(x) for x in result.loss_history)


def test_every_update_is_plain_sgd_at_the_constant_learning_rate(sgd_run):
    """p' = p - lr·g exactly at every step: no schedule, warmup, clipping, scaling or accumulation."""
    steps, lr = sgd_run["steps"], sgd_run["config"].learning_rate
    assert len(steps) == EPOCHS * N_ROWS
    assert all(r.learning_rate == lr for r in sgd_run["reports"])
    for before, grads, after, step_lr in steps:
        assert step_lr == lr
        assert set(grads) == set(before)
        for name, p in before.items():
            assert torch.equal(after[name], p.add(grads[name], alpha=-lr)), name
    # Step 1: B = 0, so every A receives an exact zero gradient, which is a valid gradient.
    first = steps[0][1]
    a_grads = [g for n, g in first.items() if n.endswith("lora_A.weight")]
    b_grads = [g for n, g in first.items() if n.endswith("lora_B.weight")]
    assert a_grads and all(int(torch.count_nonzero(g)) == 0 for g in a_grads)
    assert any(int(torch.count_nonzero(g)) > 0 for g in b_grads)


def test_the_loss_is_the_mean_next_token_ce_of_one_conversation(sgd_run, resident, ingestion):
    """Step 1 runs with B = 0, i.e. the base model: its loss is the dense reference CE of that row."""
    first = sgd_run["reports"][0]
    row = ingestion.rows[first.item]
    ids = torch.tensor([row.input_ids])
    with torch.no_grad():
        logits = resident.model.logits(ids)[0]
    labels = torch.tensor(row.labels)
    want = F.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=-100).item()
    assert first.loss == pytest.approx(want, rel=1e-5)
    assert int((labels[1:] != -100).sum()) == row.supervised_tokens


def test_checkpoints_every_interval_but_not_at_the_end(sgd_run):
    result, root = sgd_run["result"], sgd_run["root"]
    names = sorted(p.name for p in root.iterdir() if p.name.endswith(".kiln-checkpoint"))
    assert names == [
        "sgd-contract-checkpoint-step-00000004.kiln-checkpoint",
        "sgd-contract-checkpoint-step-00000008.kiln-checkpoint",
    ]  # 10 steps, interval 4: no checkpoint at step 10
    assert [c["global_step"] for c in result.checkpoints] == [4, 8]
    loaded = load_checkpoint(root / names[1], verify_hashes=True)
    progress = loaded.manifest.progress
    assert (progress.global_step, progress.epoch_index, progress.cursor_in_epoch) == (8, 1, 3)
    assert progress.data_order == epoch_order(SEED, 1, N_ROWS)
    assert loaded.manifest.state_files.optimizer_state is None  # SGD has no optimizer file
    assert sorted(p.name for p in (root / names[1]).iterdir()) == [
        "adapter.safetensors",
        "checkpoint_manifest.json",
        "sft_loop_state.json",
    ]
    loop = json.loads((root / names[1] / "sft_loop_state.json").read_text())
    assert loop["loss_history"] == result.loss_history[:8]
    assert loop["first_epoch_loss"] == pytest.approx(sum(result.loss_history[:N_ROWS]) / N_ROWS, rel=1e-12)


@pytest.fixture(scope="module")
def adamw_run(resident, ingestion, tmp_path_factory):
    root = tmp_path_factory.mktemp("adamw-run")
    config = make_config(seed=SEED, epochs=EPOCHS, optimizer={"kind": "adam_w"}, learning_rate=2e-3)
    result = train(resident, config, ingestion, root, adapter_name="receipt-run")
    assert result.status == "success", result.failure_message
    return {"config": config, "result": result, "root": root}


def test_the_adapter_directory_and_manifest_hashes(adamw_run):
    result = adamw_run["result"]
    path = result.adapter_path
    assert path == adamw_run["root"] / "receipt-run"
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "train_receipt.json",
    ]
    assert not [p for p in adamw_run["root"].iterdir() if p.name.startswith(".")]  # no staging left
    assert read_json(path / "adapter_config.json") == adapter_config(4, 8.0)
    assert list(read_json(path / "adapter_config.json")) == ADAPTER_CONFIG_KEYS
    manifest = read_json(path / "adapter_manifest.json")
    assert manifest["schema_version"] == 1 and manifest["manifest_type"] == "kiln_adapter_manifest"
    assert manifest["adapter_name"] == "receipt-run"
    assert manifest["safetensors_hash"] == file_digest(path / "adapter_model.safetensors")
    assert manifest["config_hash"] == file_digest(path / "adapter_config.json")
    assert manifest["receipt_hash"] == file_digest(path / "train_receipt.json")
    assert manifest["parent_adapter"] is None
    receipt = read_json(path / "train_receipt.json")
    assert manifest["execution_provenance"] == receipt["runtime"]["execution_provenance"]
    assert manifest["training_precision"] == receipt["runtime"]["training_precision"]
    assert manifest["base_weight_shard_manifest"] == receipt["model"]["base_weight_shard_manifest"]
    assert manifest["training_data_hash"] == receipt["training_data"]["sha256"]
    assert manifest["files"] == {
        "adapter_model": "adapter_model.safetensors",
        "adapter_config": "adapter_config.json",
        "train_receipt": "train_receipt.json",
    }
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert {parse_key(k)[2] for k in tensors} == set(LORA_TARGET_MODULES)
    assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in tensors.values())


def test_the_receipt_fields(adamw_run, resident, ingestion):
    result, config = adamw_run["result"], adamw_run["config"]
    receipt = read_json(result.adapter_path / "train_receipt.json")
    assert receipt == result.receipt
    validate_receipt(receipt)
    # envelope (docs/artifacts.md#receipt-envelope)
    assert receipt["schema_version"] == 1 and receipt["receipt_type"] == "kiln_train_receipt"
    assert receipt["adapter_name"] == "receipt-run"
    assert receipt["status"] == "success" and receipt["failure_reason"] is None
    assert "failure_message" not in receipt
    assert datetime.fromisoformat(receipt["produced_at"].replace("Z", "+00:00")).tzinfo is not None
    hp = receipt["hyperparameters"]
    assert hp == {
        "mode": "sft",
        "rank": 4,
        "alpha": 8.0,
        "alpha_over_rank": 2.0,
        "learning_rate": 2e-3,
        "epochs": EPOCHS,
        "seed": str(SEED),
        "shuffle": True,
    }
    assert receipt["config"] == config.to_json()
    assert receipt["config"]["seed"] == str(SEED) and receipt["config"]["learning_rate"] == 2e-3
    assert receipt["config"]["training_profile"] == "native_online_lora_v1"
    assert receipt["config"]["detect_anomaly"] is False
    assert receipt["config"]["optimizer"] == {
        "kind": "adam_w",
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    # data and token counts: per-epoch totals × epochs
    ing = ingestion.receipt
    assert receipt["data"]["sft_ingestion"] == ing
    assert receipt["data"]["examples_read"] == ing["rows_read"] == N_ROWS
    assert receipt["data"]["examples_filtered"] == 0
    assert receipt["data"]["examples_trained"] == N_ROWS * EPOCHS
    assert receipt["training_data"] == {"source": "inline", "path": None, "sha256": ing["kept_corpus_sha256"]}
    tc = receipt["token_counts"]
    assert tc["action_tokens"] == EPOCHS * sum(r.supervised_tokens for r in ingestion.rows)
    assert tc["context_tokens"] == EPOCHS * sum(r.seq_len - r.supervised_tokens for r in ingestion.rows)
    assert tc["env_tokens"] == 0
    # runtime
    rt = receipt["runtime"]
    assert rt["sft_loss_route"] == "kt_tape_flce"
    assert rt["training_precision"] == {
        "parameter_dtype": "f32",
        "optimizer_state_dtype": "f32",
        "activation_dtype": "f32",
        "gradient_dtype": "f32",
        "stochastic_rounding": {"mode": "round_to_nearest"},
    }
    prov = rt["execution_provenance"]
    assert prov == resident.provenance and verify_provenance_digest(prov)
    assert prov["provenance_type"] == "kiln.execution-provenance.v1"
    assert prov["backend"]["name"] == "cpu" and "torch" in json.dumps(prov["kernels"]["versions"])
    assert prov["model"]["model_config_sha256"] == receipt["model"]["config_hash"]
    assert rt["wall_clock_ms"] > 0 and rt["peak_memory_bytes"] > 2**20
    assert rt["peak_vram_mib"] is None  # CPU: peak_memory_bytes is host RSS, not VRAM
    assert receipt["model"]["base_weight_shard_manifest"] == resident.shard_manifest
    assert receipt["model"]["path"] == str(resident.model_dir)
    out = receipt["adapters"]["output"]
    model_file = result.adapter_path / "adapter_model.safetensors"
    assert out == {
        "path": str(result.adapter_path),
        "adapter_model_sha256": file_digest(model_file),
        "adapter_model_bytes": model_file.stat().st_size,
    }
    assert receipt["adapters"]["base"]["path"] is None
    assert receipt["grpo"] is None and receipt["no_policy_loss"] is False
    assert "adapter_smoke_test" not in receipt  # off unless requested


def test_lora_delta_norms_recompute_from_the_saved_adapter(adamw_run):
    path = adamw_run["result"].adapter_path
    receipt = read_json(path / "train_receipt.json")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    pairs: dict[tuple[int, str], dict[str, float]] = {}
    for key, t in tensors.items():
        layer, _, target, ab = parse_key(key)
        pairs.setdefault((layer, target), {})[ab] = torch.linalg.vector_norm(t.double()).item()
    rows = {r["module"]: r for r in receipt["lora_delta_norms"]}
    assert list(rows) == [m for m in LORA_TARGET_MODULES if m in rows] and set(rows) == set(
        LORA_TARGET_MODULES
    )
    for module, row in rows.items():
        mine = [v for (_, tgt), v in pairs.items() if tgt == module]
        a, b = [v["A"] for v in mine], [v["B"] for v in mine]
        bound = [2.0 * v["A"] * v["B"] for v in mine]  # scale alpha/rank = 2
        assert row["pair_count"] == len(mine)
        assert row["a_l2_mean"] == pytest.approx(sum(a) / len(a), rel=1e-9)
        assert row["a_l2_max"] == pytest.approx(max(a), rel=1e-9)
        assert row["b_l2_mean"] == pytest.approx(sum(b) / len(b), rel=1e-9)
        assert row["b_l2_max"] == pytest.approx(max(b), rel=1e-9)
        assert row["delta_l2_upper_bound_mean"] == pytest.approx(sum(bound) / len(bound), rel=1e-9)
        assert row["delta_l2_upper_bound_max"] == pytest.approx(max(bound), rel=1e-9)
        assert row["b_l2_max"] > 0  # trained: B moved away from zero


def test_lora_grad_norms_cover_every_step_and_projection(adamw_run, resident):
    receipt = adamw_run["result"].receipt
    per_target: dict[str, int] = {}
    for p in resident.config.projections():
        per_target[p.target] = per_target.get(p.target, 0) + 1
    rows = {r["module"]: r for r in receipt["lora_grad_norms"]}
    assert set(rows) == set(LORA_TARGET_MODULES)
    steps = EPOCHS * N_ROWS
    for module, row in rows.items():
        assert row["sample_count"] == steps * per_target[module]
        assert 0.0 < row["min"] <= row["mean"] <= row["max"]
        assert all(math.isfinite(row[k]) for k in ("min", "mean", "max"))


def test_an_unresolved_config_or_bad_name_fails_before_anything_is_written(resident, ingestion, tmp_path):
    from kiln_train.errors import KilnError
    from kiln_train.sft_config import parse_sft_config

    with pytest.raises(KilnError, match="effective config"):
        train(resident, parse_sft_config({"lora_rank": 4, "lora_alpha": 8.0}), ingestion, tmp_path)
    with pytest.raises(KilnError, match="invalid adapter name"):
        train(resident, make_config(), ingestion, tmp_path, adapter_name="../escape")
    assert list(tmp_path.iterdir()) == []


def test_forward_and_backward_run_inside_the_training_scope(resident, ingestion, tmp_path, monkeypatch):
    """The step opens the training scope; nothing outside a step sees it.

    See docs/training-profile.md#training-scope.
    """
    from kiln_train.train.scope import TRAINING_SCOPE

    module = resident.model.get_submodule("layers.0.mlp")
    real_forward = module.forward
    seen = []

    def forward(*args, **kwargs):
        seen.append((TRAINING_SCOPE.get(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(module, "forward", forward)
    config = make_config(seed=SEED, epochs=1, adapter_smoke_test=True, adapter_smoke_prompts=["Hi"])
    with torch.no_grad():  # the caller's grad mode does not matter: the scope enables recording
        result = train(resident, config, ingestion, tmp_path)
    assert result.status == "success", result.failure_message
    training = seen[:N_ROWS]
    assert training == [(True, True, False)] * N_ROWS
    canary = seen[N_ROWS:]
    assert canary and all(s == (False, False, True) for s in canary)  # canaries: inference mode
    assert TRAINING_SCOPE.get() is False


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"lora_rank": 4, "lora_alpha": 16.0}, "unsafe LoRA scaling"),
        ({"adapter_smoke_prompts": ["Hi"]}, "adapter_smoke_prompts requires adapter_smoke_test=true"),
        ({"adapter_smoke_test": True, "adapter_smoke_prompts": []}, "non-empty array"),
        ({"adapter_smoke_test": True, "adapter_smoke_prompts": ["  "]}, "must not be blank"),
        ({"training_profile": "hf_trainer"}, "training_profile"),
        ({"per_device_train_batch_size": 2}, "unknown field"),
        ({"gradient_accumulation_steps": 4}, "unknown field"),
        ({"lr_scheduler_type": "cosine"}, "unknown field"),
        ({"warmup_steps": 10}, "unknown field"),
        ({"max_grad_norm": 1.0}, "unknown field"),
    ],
)
def test_config_level_rejections_are_invalid_requests(body, fragment):
    from kiln_train.errors import TRAINING_INVALID_REQUEST, KilnError
    from kiln_train.sft_config import parse_sft_config

    with pytest.raises(KilnError) as exc:
        parse_sft_config(body)
    assert exc.value.code == TRAINING_INVALID_REQUEST and fragment in exc.value.message


def test_train_mtp_true_is_rejected_by_the_server_path():
    from kiln_train.errors import TRAINING_INVALID_REQUEST, KilnError
    from kiln_train.sft_config import parse_sft_config

    with pytest.raises(KilnError) as exc:
        parse_sft_config({"train_mtp": True}).resolve(seed=1)
    assert exc.value.code == TRAINING_INVALID_REQUEST and "train_mtp" in exc.value.message
    assert parse_sft_config({"train_mtp": None}).resolve(seed=1).train_mtp is False
    high = parse_sft_config({"lora_rank": 4, "lora_alpha": 16.0, "allow_high_lora_scale": True})
    assert high.alpha_over_rank == 4.0
