"""The worker's start-up warm-up step leaves the resident model exactly as loaded."""

from __future__ import annotations

import torch

from kiln_train.train.warmup import warm_up
from tests.kiln_train.train.trainer_fixtures import resident, tiny_dir  # noqa: F401


def test_warm_up_runs_a_checkpointed_step_and_leaves_the_base_model_untouched(resident):  # noqa: F811
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        before = resident.model.logits(ids)
    buffers = {name: b.clone() for name, b in resident.model.named_buffers()}
    warm_up(resident)
    assert getattr(resident.model, "lora", None) is None
    assert list(resident.model.parameters()) == []  # no LoRA leaves left behind
    assert all(torch.equal(buffers[name], b) for name, b in resident.model.named_buffers())
    with torch.inference_mode():
        assert torch.equal(resident.model.logits(ids), before)
