"""Assistant-only labels from supervised character spans (mask contract `kiln.qwen35-assistant-only.v1`).

docs/tokenization.md#assistant-only-labels. The marker-free rendered text is tokenized
once (`add_special_tokens=False`); a token is supervised iff its character offsets overlap a
supervised span. Because every span covers whole tokens, that is the token containing the span's
first character through the token containing its last character -- the rule Transformers applies
to `{% generation %}` blocks (`char_to_token(start)` .. `char_to_token(end - 1)`).

`labels[i] = input_ids[i]` for supervised tokens, `-100` otherwise; the causal loss predicts
token i from position i-1, so only supervised tokens at positions >= 1 are training targets.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK_CONTRACT = "kiln.qwen35-assistant-only.v1"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Labels:
    """`labels` aligned with `input_ids`; `supervised_tokens` counts targets at positions >= 1."""

    labels: list[int]
    token_ranges: tuple[tuple[int, int], ...]  # supervised token index ranges [start, end)
    supervised_tokens: int


def _ranges_from_offsets(offsets: list[tuple[int, int]], spans) -> list[tuple[int, int]]:
    """The overlap rule over explicit offsets (used when a span boundary has no owning token)."""
    ranges = []
    for a, b in spans:
        hits = [t for t, (s, e) in enumerate(offsets) if s < b and e > a]
        if hits:
            ranges.append((hits[0], hits[-1] + 1))
    return ranges


def token_ranges(encoding, spans) -> list[tuple[int, int]]:
    """Supervised token index ranges `[start, end)` for char spans, merged and sorted."""
    ranges = []
    for a, b in spans:
        if b <= a:
            continue
        first = encoding.char_to_token(a)
        last = encoding.char_to_token(b - 1)
        if first is None or last is None:
            return _merge(_ranges_from_offsets(encoding.offsets, spans))
        ranges.append((first, last + 1))
    return _merge(ranges)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def build_labels(input_ids: list[int], ranges: list[tuple[int, int]]) -> Labels:
    """Labels for `input_ids` supervised over `ranges`."""
    labels = [IGNORE_INDEX] * len(input_ids)
    targets = 0
    for a, b in ranges:
        labels[a:b] = input_ids[a:b]
        targets += max(0, b - max(a, 1))
    return Labels(labels, tuple(ranges), targets)


def label_encoding(encoding, spans) -> Labels:
    """Labels for one tokenizers `Encoding` of the marker-free text and its supervised char spans."""
    return build_labels(encoding.ids, token_ranges(encoding, spans))
