"""The demo's run (`kiln demo`, `scripts/demo`): the settings it trains its sample with.

They differ from the server's defaults on purpose (AdamW at a higher learning rate converges
visibly within the demo's few steps on a random model), so the browser UI shows the difference
beside the form's defaults and offers to use them (`api/routes/ui.py: defaults`).
"""

from __future__ import annotations

from typing import Any

DEMO_RUN: dict[str, Any] = {
    "epochs": 3,
    "lora_rank": 16,
    "lora_alpha": 32.0,
    "optimizer": "adam_w",
    "learning_rate": 0.002,
    "seed": 42,
    "checkpoint_interval": 30,
}
