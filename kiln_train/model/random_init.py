"""The mark of a random checkpoint: `kiln-random-init.json` beside the weights of a checkpoint
Kiln drew itself (`kiln model init-tiny`, `kiln demo`, `kiln up` without a model), holding the
preset and seed it was drawn from.

A model trained from random weights learns the data's surface and nothing else: its canary
generations are gibberish by construction and its loss says nothing about a real model. The
receipt (`model.random_init`), the job's answer and the browser UI say so wherever such a model
is named. Torch-free: the api reads the mark too.
"""

from __future__ import annotations

import json
from pathlib import Path

RANDOM_INIT_FILE = "kiln-random-init.json"


def write_random_init_mark(model_dir: Path, preset: str, seed: int) -> None:
    """Mark `model_dir` as a random checkpoint drawn from `preset` with `seed`."""
    mark = {"preset": preset, "seed": int(seed)}
    (Path(model_dir) / RANDOM_INIT_FILE).write_text(json.dumps(mark) + "\n", encoding="utf-8")


def random_init_of(model_dir: str | Path | None) -> dict | None:
    """`{"preset", "seed"}` when `model_dir` holds a random checkpoint Kiln drew, else None (no
    mark, or one that cannot be read: a real model never carries it)."""
    if model_dir is None:
        return None
    try:
        mark = json.loads((Path(model_dir) / RANDOM_INIT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or not isinstance(mark.get("preset"), str):
        return None
    return {"preset": mark["preset"], "seed": mark.get("seed")}
