"""Shared fixtures: the real Qwen3.5 tokenizer, built once per test session."""

from __future__ import annotations

import pytest

from kiln_train.data.tokenizer import build_tokenizer, write_tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The converted Qwen3.5 tokenizer (tokenizers.Tokenizer)."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, qwen_tokenizer):
    """A directory holding tokenizer.json + tokenizer_config.json."""
    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(out, qwen_tokenizer)
    return out
