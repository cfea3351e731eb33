"""The packaged Qwen3.5 tokenizer's per-user cache: built once, loaded after, never a failed
start-up when the cache cannot be written or was damaged."""

from __future__ import annotations

import kiln_train.data.packaged_tokenizer as packaged_tokenizer


def test_an_unwritable_tokenizer_cache_builds_without_caching(tmp_path, qwen_tokenizer, monkeypatch, caplog):
    """A container user without a home directory: the cache root cannot be created."""
    monkeypatch.setattr(packaged_tokenizer, "build_tokenizer", lambda: qwen_tokenizer)
    (tmp_path / "afile").write_text("x")
    tok = packaged_tokenizer.cached_tokenizer(root=tmp_path / "afile" / "cache")
    assert tok is qwen_tokenizer
    assert "cannot write the tokenizer cache" in caplog.text


def test_a_damaged_tokenizer_cache_entry_is_rebuilt(tmp_path, qwen_tokenizer, monkeypatch, caplog):
    """A truncated or corrupt cached tokenizer.json is a cache miss, not a failed start-up."""
    monkeypatch.setattr(packaged_tokenizer, "build_tokenizer", lambda: qwen_tokenizer)
    root = tmp_path / "cache"
    packaged_tokenizer.cached_tokenizer(root=root)
    (cached,) = root.glob("*/tokenizer.json")
    cached.write_text('{"model": {"type": "BPE", "vocab": {', encoding="utf-8")  # truncated
    tok = packaged_tokenizer.cached_tokenizer(root=root)
    assert tok.encode("hello world").ids == qwen_tokenizer.encode("hello world").ids
    assert "is damaged" in caplog.text
    # Rebuilt in place: the next process loads it from the cache again.
    assert packaged_tokenizer.cached_tokenizer(root=root).encode("hi").ids == qwen_tokenizer.encode("hi").ids
    assert cached.stat().st_size > 1_000_000
