"""load_resident: the model, tokenizer and template that a worker keeps between jobs."""

from __future__ import annotations

import pytest

from kiln_train.model.loader import ModelCheckpointError
from kiln_train.model.resident import load_resident
from kiln_train.model.tiny import write_tiny_checkpoint


def test_a_tokenizer_with_ids_beyond_the_embedding_is_refused_at_load(tmp_path):
    path = write_tiny_checkpoint(
        tmp_path / "m",
        "tiny",
        seed=3,
        overrides={"vocab_size": 512, "bos_token_id": None, "eos_token_id": None},
    )
    with pytest.raises(ModelCheckpointError) as err:
        load_resident(path)
    assert "vocab_size is 512" in str(err.value)
    assert "248076" in str(err.value)
    assert err.value.file.endswith("tokenizer.json")


def test_a_full_vocabulary_checkpoint_loads_with_its_identity(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "tiny", seed=3)
    resident = load_resident(path)
    assert resident.config.vocab_size == 248320
    assert resident.tokenizer.get_vocab_size(with_added_tokens=True) == 248077
    assert resident.execution_identity_digest == resident.provenance["provenance_sha256"]
    assert resident.backend.name == "cpu"
