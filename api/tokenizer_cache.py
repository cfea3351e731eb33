"""The runner's tokenizer, loaded once per api process (docs/tokenization.md#tokenizer).

Admission tokenizes with exactly the tokenizer the resident runner holds: `tokenizer.json`
under the runner's `model_path`, whose SHA-256 must equal the runner identity's
`tokenizer_vocab_sha256`. Loading the 248k-entry vocabulary takes about a second, so the
tokenizer is cached by (path, digest); the digest itself is remembered per (path, size, mtime)
so an unchanged file is not re-hashed on every submission.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tokenizers import Tokenizer

from kiln_train.errors import backend_unsupported
from kiln_train.ground.digest import file_digest

TOKENIZER_FILE = "tokenizer.json"


class TokenizerCache:
    """Thread-safe cache of loaded tokenizers keyed by (path, digest)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[tuple[str, int, int], str] = {}
        self._tokenizers: dict[tuple[str, str], Tokenizer] = {}

    def digest(self, path: Path) -> str:
        """SHA-256 (`sha256:<hex>`) of the file, re-hashed only when its size or mtime changed."""
        st = os.stat(path)
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            known = self._digests.get(key)
        if known is not None:
            return known
        digest = file_digest(path)
        with self._lock:
            self._digests[key] = digest
        return digest

    def get(self, model_path: str, expected_digest: str | None) -> Tokenizer:
        """The tokenizer of the runner's model; 501 when it is missing or not the pinned one."""
        path = Path(model_path) / TOKENIZER_FILE
        try:
            digest = self.digest(path)
        except OSError as exc:
            raise backend_unsupported(
                f"the runner's tokenizer {path} is not readable by the api ({exc.strerror}); the api and "
                "the worker must share the model directory"
            ) from None
        if expected_digest is None or digest != expected_digest:
            raise backend_unsupported(
                f"the tokenizer at {path} has digest {digest} but the resident runner pinned "
                f"{expected_digest}; the api would tokenize differently from the worker"
            )
        key = (str(path), digest)
        with self._lock:
            cached = self._tokenizers.get(key)
        if cached is not None:
            return cached
        tokenizer = Tokenizer.from_file(str(path))
        with self._lock:
            return self._tokenizers.setdefault(key, tokenizer)


# One cache per process: every app built in it (tests build many) shares the loaded vocabularies.
PROCESS_TOKENIZERS = TokenizerCache()
