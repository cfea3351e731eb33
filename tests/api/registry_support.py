"""A published adapter in the registry and the store, without training one."""

from __future__ import annotations

import os

from kiln.store import register_adapter

ADAPTER_FILES = {
    "adapter_config.json": b'{"r": 4}\n',
    "train_receipt.json": b'{"schema": "kiln.train-receipt", "final_loss": 0.5}\n',
    "adapter_manifest.json": b'{"schema_version": 1, "adapter_name": "NAME"}\n',
}


def publish_adapter(
    sessions, settings, name: str, *, checkpoints=(2, 4), manifest=True, big=3 << 20
) -> dict[str, bytes]:
    """Put an adapter directory (and checkpoint directories) in the registry and register it."""
    root = settings.adapters_dir / name
    root.mkdir(parents=True)
    files = {
        k: v.replace(b"NAME", name.encode())
        for k, v in ADAPTER_FILES.items()
        if manifest or k != "adapter_manifest.json"
    }
    files["adapter_model.safetensors"] = os.urandom(big)  # several archive chunks
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    for step in checkpoints:
        ck = settings.adapters_dir / f"{name}-checkpoint-step-{step:08d}.kiln-checkpoint"
        ck.mkdir()
        (ck / "manifest.json").write_text("{}")
    with sessions.begin() as session:
        register_adapter(
            session,
            name=name,
            job_id=None,
            path=str(root),
            size_bytes=sum(len(v) for v in files.values()),
            safetensors_sha256="sha256:" + "ab" * 32,
            rank=4,
            alpha=8.0,
        )
    return files
