"""A warm-started run keeps its lineage across resume (docs/artifacts.md#provenance,
docs/checkpoints.md#resume, docs/artifacts.md#adapter-manifest).

Resume ignores the request's `base_adapter`: it continues the checkpoint's tensors and does not
load the base adapter again. The run it continues did start from one, so the checkpoint records
that adapter's receipt identity (`auxiliary_state.base_adapter`) and the resumed run adopts it
together with `effective_config.base_adapter`. Its receipt (`adapters.base`, `config`), adapter
manifest (`parent_adapter`) and later checkpoints are then those of the uninterrupted run, even
when the request names another base adapter or none, or the base adapter was deleted meanwhile.
A manifest whose lineage fields disagree is refused, naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kiln_train.artifacts.adapter import adapter_identity
from kiln_train.checkpoint import BASE_ADAPTER_AUX_KEY, CheckpointError, load_checkpoint
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.resume.resume_support import NAME, assert_same_run, ckpt_path, leg
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = "warm-base"
STOP = 3


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(4, offset=70))


@pytest.fixture(scope="module")
def base_adapter(resident, ingestion, tmp_path_factory):
    """A finished adapter to warm-start from (copied into each registry that needs it)."""
    root = tmp_path_factory.mktemp("base")
    done = train(resident, make_config(seed=5, epochs=1), ingestion, root, adapter_name=BASE)
    assert done.status == "success", done.failure_message
    return done.adapter_path


def _registry(base_adapter, path):
    path.mkdir(parents=True)
    shutil.copytree(base_adapter, path / BASE)
    return path


def _config(**fields):
    return make_config(seed=11, epochs=2, checkpoint_interval=2, **{"base_adapter": BASE, **fields})


@pytest.fixture(scope="module")
def straight(resident, ingestion, base_adapter, tmp_path_factory):
    root = _registry(base_adapter, tmp_path_factory.mktemp("lineage") / "straight")
    result = train(resident, _config(), ingestion, root, adapter_name=NAME)
    assert result.status == "success", result.failure_message
    return result, root


def _stopped(resident, ingestion, base_adapter, root):
    root = _registry(base_adapter, root)
    stopped = leg(resident, _config(), ingestion, root, resume=None, stop_at=STOP)
    assert stopped.failure_reason == "cancelled", stopped.failure_message
    return root


def test_the_checkpoint_records_the_warm_start(straight):
    result, root = straight
    manifest = load_checkpoint(ckpt_path(root, 2)).manifest
    assert manifest.effective_config["base_adapter"] == BASE
    assert manifest.auxiliary_state[BASE_ADAPTER_AUX_KEY] == adapter_identity(root / BASE)
    assert result.receipt["adapters"]["base"] == adapter_identity(root / BASE)


@pytest.mark.parametrize("request_base", [BASE, None, "some-other-adapter"])
def test_a_resumed_warm_start_keeps_its_lineage(
    resident, ingestion, base_adapter, straight, tmp_path, request_base
):
    ref, straight_root = straight
    root = _stopped(resident, ingestion, base_adapter, tmp_path / "chain")
    config = _config(base_adapter=request_base)
    final = leg(resident, config, ingestion, root, resume=ckpt_path(root, STOP), stop_at=None)
    assert_same_run(ref, final, straight_root, root, [STOP])
    receipt = read_json(final.receipt_path)
    assert receipt["adapters"]["base"] == adapter_identity(root / BASE)
    assert receipt["config"]["base_adapter"] == BASE
    assert read_json(final.adapter_path / "adapter_manifest.json")["parent_adapter"] == BASE


def test_the_lineage_survives_the_base_adapter_being_deleted(resident, ingestion, base_adapter, tmp_path):
    root = _stopped(resident, ingestion, base_adapter, tmp_path / "chain")
    identity = adapter_identity(root / BASE)
    shutil.rmtree(root / BASE)
    final = leg(resident, _config(), ingestion, root, resume=ckpt_path(root, STOP), stop_at=None)
    assert final.status == "success", final.failure_message
    assert read_json(final.receipt_path)["adapters"]["base"] == identity


def test_a_run_without_a_warm_start_has_no_lineage(resident, ingestion, tmp_path):
    """...and a request naming a base adapter at resume cannot give it one."""
    config = make_config(seed=11, epochs=2, checkpoint_interval=2)
    stopped = leg(resident, config, ingestion, tmp_path, resume=None, stop_at=STOP)
    assert stopped.failure_reason == "cancelled"
    assert BASE_ADAPTER_AUX_KEY not in load_checkpoint(ckpt_path(tmp_path, STOP)).manifest.auxiliary_state
    resumed = config.model_copy(update={"base_adapter": "does-not-exist"})
    final = leg(resident, resumed, ingestion, tmp_path, resume=ckpt_path(tmp_path, STOP), stop_at=None)
    assert final.status == "success", final.failure_message
    assert final.receipt["adapters"]["base"]["path"] is None
    assert final.receipt["config"]["base_adapter"] is None
    assert read_json(final.adapter_path / "adapter_manifest.json")["parent_adapter"] is None


def _edit(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "checkpoint_manifest.json"
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value, indent=2))
    return dst


@pytest.mark.parametrize(
    ("warm", "edit", "fragment"),
    [
        (False, lambda m: m["effective_config"].update(base_adapter=BASE), "effective_config.base_adapter"),
        (True, lambda m: m["auxiliary_state"].pop(BASE_ADAPTER_AUX_KEY), "effective_config.base_adapter"),
        (True, lambda m: m["effective_config"].update(base_adapter=None), "auxiliary_state.base_adapter"),
        (
            True,
            lambda m: m["effective_config"].update(base_adapter="other"),
            "auxiliary_state.base_adapter.path",
        ),
        (True, lambda m: m["auxiliary_state"].update(base_adapter=None), "auxiliary_state.base_adapter"),
        (True, lambda m: m["auxiliary_state"].update(base_adapter="x"), "auxiliary_state.base_adapter"),
        (
            True,
            lambda m: m["auxiliary_state"]["base_adapter"].update(adapter_model_sha256="sha256:00"),
            "auxiliary_state.base_adapter.adapter_model_sha256",
        ),
        (
            True,
            lambda m: m["auxiliary_state"]["base_adapter"].update(adapter_model_bytes=0),
            "auxiliary_state.base_adapter.adapter_model_bytes",
        ),
        (
            True,
            lambda m: m["auxiliary_state"]["base_adapter"].update(extra=1),
            "auxiliary_state.base_adapter",
        ),
    ],
)
def test_inconsistent_lineage_is_refused(
    resident, ingestion, base_adapter, straight, tmp_path, warm, edit, fragment
):
    if warm:
        src = ckpt_path(straight[1], 2)
    else:
        config = make_config(seed=11, epochs=2, checkpoint_interval=2)
        stopped = leg(resident, config, ingestion, tmp_path / "plain", resume=None, stop_at=2)
        assert stopped.failure_reason == "cancelled"
        src = ckpt_path(tmp_path / "plain", 2)
    copy = _edit(src, tmp_path / "edited" / src.name, edit)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(copy)
    assert f"checkpoint_manifest.json: {fragment}" in info.value.message, info.value.message
    # ...and train_sft refuses it before any work, leaving only its failed receipt.
    root = _registry(base_adapter, tmp_path / "resume")
    result = train(resident, _config(), ingestion, root, adapter_name=NAME, resume_checkpoint=copy)
    assert result.status == "failed" and result.global_step == 0
    assert fragment in result.failure_message
    assert sorted(p.name for p in root.iterdir()) == [".failed", BASE]
