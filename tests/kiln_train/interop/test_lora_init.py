"""`kiln-py.seeded-lora-init.v1` without torch equals `attach_lora`'s tensors, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from kiln_train.interop import lora_init, safetensors_io
from kiln_train.model import attach_lora, load_model
from kiln_train.model.config import parse_config
from kiln_train.model.tiny import PRESETS, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(
        write_tiny_checkpoint(tmp_path_factory.mktemp("init"), "tiny", seed=3, with_tokenizer=False)
    )


def _attach(model, rank: int, seed: int) -> dict[str, torch.Tensor]:
    lora = attach_lora(model, rank, 2.0 * rank, seed)
    try:
        return {k: v.detach().clone() for k, v in lora.state_dict().items()}
    finally:
        lora.remove(model)


@pytest.mark.parametrize("rank", [1, 4, 7])
@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1, 2**32 + 5, 2**64 - 1])
def test_torch_free_init_is_attach_loras(model, rank, seed):
    ours = load(safetensors_io.dump(lora_init.seeded_lora_tensors(model.config, rank, seed)))
    theirs = _attach(model, rank, seed)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], value), key


def test_wide_projections_draw_the_same_stream():
    """A shape with wide inputs (thousands of draws per A) on a model that is never loaded."""
    config = parse_config(
        {**PRESETS["small"], "hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 3072}
    )
    rank, seed = 8, 123456789
    gen = torch.Generator().manual_seed(seed)
    ours = lora_init.seeded_lora_tensors(config, rank, seed)
    for proj in config.projections():
        bound = (1.0 / proj.in_features) ** 0.5
        want = torch.empty(rank, proj.in_features).uniform_(-bound, bound, generator=gen)
        dtype, shape, raw = ours[f"base_model.model.model.{proj.module}.lora_A.weight"]
        assert (dtype, shape) == ("F32", (rank, proj.in_features))
        assert raw == want.numpy().tobytes(), proj.module


def test_rank_must_be_positive(model):
    with pytest.raises(ValueError, match="positive integer"):
        lora_init.seeded_lora_tensors(model.config, 0, 1)
