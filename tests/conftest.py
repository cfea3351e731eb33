"""Shared fixtures: the real Qwen3.5 tokenizer, built once per test session."""

from __future__ import annotations

import os

import pytest

from kiln_train.data.tokenizer import build_tokenizer, write_tokenizer
from tests import services  # noqa: F401  (reads KILN_TEST_REDIS before it leaves the environment)

# KILN_TEST_REDIS belongs to the tests, not to Kiln: once tests.services has read it, it leaves
# the environment, so neither the CLI run in-process nor the kiln processes the tests start
# warn "KILN_TEST_REDIS is not a Kiln setting" into output a test parses.
os.environ.pop("KILN_TEST_REDIS", None)


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
