"""What a resident runner publishes about itself in the `runners` table.

The api admits only against this row: the backend and loss route it owns, its optimizer support
report, its execution identity digest, the model config (for memory admission) and free memory.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kiln_train.model.random_init import random_init_of
from kiln_train.plan.budget import device_memory
from kiln_train.plan.optimizer_support import optimizer_support_report
from kiln_train.train.resident import ResidentModel


def heartbeat_file(settings) -> Path:
    """Touched by the worker's heartbeat thread; `kiln health worker` reads its age."""
    return settings.storage_root / "run" / f"worker-{socket.gethostname()}.heartbeat"


def runner_registration(resident: ResidentModel) -> dict:
    """Keyword arguments of `kiln.store.register_runner` for this resident model."""
    backend = resident.backend
    free, total = device_memory(backend.device)
    return {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "backend": backend.name,
        "device": backend.device,
        "base_weight_dtype": backend.base_weight_dtype,
        "lora_dtype": backend.lora_dtype,
        "loss_route": backend.sft_loss_route,
        "optimizer_support": optimizer_support_report(backend, resident.config),
        "execution_identity_digest": resident.execution_identity_digest,
        "model_path": str(resident.model_dir),
        "model_config": {
            **resident.config.to_dict(),
            "identity": resident.identity,
            "base_weights_sha256": resident.base_weights_sha256,
            # a random checkpoint Kiln drew (its preset and seed), else None: the job answers say so
            "random_init": random_init_of(resident.model_dir),
        },
        "free_memory_bytes": free,
        "total_memory_bytes": total,
    }
