"""Sanity ceilings on model dimensions, far above any real Qwen3.5 (vocab 248320, hidden 5120,
64 layers). A model `config.json` beyond them is corrupt, and refusing it keeps a vocab of 10**12
or 10**7 layers from reaching the model constructor (a MemoryError, an overflow TypeError or
minutes of building meta modules); the request's LoRA rank and segment count are bounded by them
too (`kiln_train/sft_config.py`)."""

from __future__ import annotations

MAX_VOCAB_SIZE = 1 << 24
MAX_DIMENSION = 1 << 20
MAX_LAYERS = 1024
MAX_POSITIONS = 2**31 - 1
