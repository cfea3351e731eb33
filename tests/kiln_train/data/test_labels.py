"""Assistant-only labels from character spans (mask contract kiln.qwen35-assistant-only.v1)."""

from __future__ import annotations

import json
from pathlib import Path

from kiln_train.data.chat_template import SPAN_CLOSE, SPAN_OPEN
from kiln_train.data.ingestion import iter_example_outcomes
from kiln_train.data.labels import (
    IGNORE_INDEX,
    _ranges_from_offsets,
    build_labels,
    label_encoding,
    token_ranges,
)

FIXTURE = Path(__file__).resolve().parents[3] / "qualification" / "fixtures" / "qwen35_sft_oracle_v1.json"


def test_build_labels_copies_supervised_ids_and_counts_targets_after_position_zero():
    labels = build_labels([10, 11, 12, 13, 14], [(0, 2), (3, 5)])
    assert labels.labels == [10, 11, IGNORE_INDEX, 13, 14]
    assert labels.supervised_tokens == 3  # position 0 has no preceding position to predict it
    assert build_labels([1, 2], []).labels == [IGNORE_INDEX, IGNORE_INDEX]
    assert build_labels([1, 2], []).supervised_tokens == 0


class _NoCharMap:
    """An encoding whose char_to_token cannot answer, forcing the explicit offset rule."""

    def __init__(self, ids, offsets):
        self.ids = ids
        self.offsets = offsets

    def char_to_token(self, _pos):
        return None


def test_overlap_rule_on_explicit_offsets():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10)]
    enc = _NoCharMap([1, 2, 3, 4], offsets)
    # span [4, 6) touches tokens 1 and 2; span [9, 10) is token 3; adjacent ranges merge
    assert token_ranges(enc, [(4, 6), (9, 10)]) == [(1, 4)]
    assert token_ranges(enc, [(0, 1), (9, 10)]) == [(0, 1), (3, 4)]
    assert label_encoding(enc, [(4, 6)]).labels == [IGNORE_INDEX, 2, 3, IGNORE_INDEX]
    assert _ranges_from_offsets(offsets, [(3, 5)]) == [(1, 2)]
    assert _ranges_from_offsets(offsets, [(10, 12)]) == []


def test_char_to_token_and_overlap_rule_agree_on_oracle_rows(qwen_tokenizer):
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
    for case in cases:
        if "error" in case:
            continue
        (outcome,) = list(iter_example_outcomes([case["example"]], tokenizer=qwen_tokenizer))
        text = outcome.rendered.text
        assert SPAN_OPEN not in text and SPAN_CLOSE not in text
        enc = qwen_tokenizer.encode(text, add_special_tokens=False)
        # the ids used for labels are exactly the tokenization of the marker-free text
        assert enc.ids == outcome.tokenized.input_ids
        spans = outcome.rendered.spans
        assert token_ranges(enc, spans) == _ranges_from_offsets(enc.offsets, spans)
        # every supervised span starts and ends on a token boundary
        starts = {s for s, _ in enc.offsets}
        ends = {e for _, e in enc.offsets}
        assert all(a in starts and b in ends for a, b in spans), case["name"]
