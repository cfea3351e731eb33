"""One tiny training step at worker start, so one-time process costs are not the first job's."""

from __future__ import annotations

import torch

from kiln_train.model.lora import release_lora
from kiln_train.train.resident import ResidentModel
from kiln_train.train.scope import training_scope


def warm_up(resident: ResidentModel, tokens: int = 16) -> None:
    """One tiny checkpointed forward/backward at worker start, then the model is left as loaded.

    One-time process costs (thread pools, BLAS buffers, the modules the first checkpointed step
    imports) then belong to the worker's resident baseline, not to the first job's memory; the
    estimate charges per-job costs only.
    """
    from kiln_train.model import attach_lora
    from kiln_train.train.loss import sft_loss

    model = resident.model
    release_lora(model)
    lora = attach_lora(model, 2, 2.0, 0)
    try:
        ids = torch.arange(tokens, device=model.device).remainder(resident.config.vocab_size)[None]
        labels = ids[0].clone()
        segments = min(2, resident.config.num_hidden_layers)
        with training_scope():
            hidden = model.hidden_states(ids, num_segments=segments)
            sft_loss(resident.backend.sft_loss_route, hidden, model.lm_head_weight, labels).backward()
    finally:
        lora.remove(model)
