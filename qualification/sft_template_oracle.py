"""Oracle for Kiln's Qwen3.5 SFT rendering, token ids and assistant-only labels.

docs/tokenization.md#oracle-fixtures.

The reference is the real stack: Transformers `apply_chat_template(..., tokenize=True,
return_dict=True, return_assistant_tokens_mask=True)` running TRL's bundled
`qwen3_5_think_training.jinja` over Kiln's own tokenizer.json (built by
`kiln_train.data.tokenizer.write_tokenizer`, loaded as `PreTrainedTokenizerFast(tokenizer_file=...)`
so `ignore_merges` stays True, docs/tokenization.md#tokenizer). Labels are `input_ids` where the mask is 1,
else -100.

The oracle receives each row the way Kiln's contract describes the conversion: OpenAI-shaped
messages with `function.arguments` JSON strings parsed into objects
(docs/tokenization.md#tool-calls); everything else
(null content, content-part arrays, the `function` wrapper, tool names/ids) is passed unchanged, so
Transformers/TRL do their own joining and unwrapping.

The fixture holds named cases (plain, explicit and inline thinking, tools, tool responses,
parallel calls, multi-turn, adversarial delimiter literals, structured content, template errors)
with full text/ids/masks/labels, plus a seeded random differential set (text, ids and supervised
token ranges). tests/kiln_train/data/test_chat_template.py compares Kiln with it without importing
TRL.

A second fixture, qualification/fixtures/qwen35_sft_conversations_v1.json, holds 300 conversations
from a broader seeded generator (`conversation_rows`: reasoning under every field name and inline
<think> in every shape, parallel calls with string/object/empty/missing arguments, tool results with
name/tool_call_id, content-part arrays, Unicode whitespace, NFD text, CRLF, delimiter literals in
every role, empty and whitespace-only turns) with full text, ids and supervised token ranges, and
named edge rows recording the oracle's result next to the rejection Kiln must give and why.
tests/kiln_train/data/test_conversations_oracle.py compares Kiln with it exactly, without TRL.

A third fixture, qualification/fixtures/qwen35_sft_probe2_v1.json, holds named corner rows and 200
conversations from `probe2_rows` (tool-call arguments of every JSON type and spelling, turns after the
last assistant, consecutive assistant/user turns, reasoning aliases given together, fields the template
ignores, content parts without a type, control characters, nested or non-OpenAI tools schemas) and edge
rows Kiln refuses although TRL renders them; tests/kiln_train/data/test_conversations_oracle_corners.py
compares Kiln with it exactly, without TRL.

Regenerate (writes all three fixtures; a fixture's bytes do not change unless its cases do):

    .venv/bin/python qualification/sft_template_oracle.py --write

Check (re-runs the oracle; diffs it against all three fixtures, Kiln against the oracle on a further
500 random rows, 1,000 further generated conversations and 1,000 further probe2 rows, the edge rows'
expected outcomes, and Kiln's training template file rendered by Transformers against TRL's):

    .venv/bin/python qualification/sft_template_oracle.py --check

The code lives in the `qualification/sft_oracle/` package (its docstring maps the modules); this
file is the command line the fixtures record.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qualification.sft_oracle.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(__doc__.splitlines()[0]))
