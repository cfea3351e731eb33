"""Oracle for Kiln's row formats (docs/ingestion.md#row-formats), from the real Transformers + TRL.

For every case the reference result is computed here without Kiln's converter:

- `instruction` rows: the conversation the format documents (system?, history pairs, user
  `instruction` or `instruction + "\\n" + input`, assistant `output`), rendered by Transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)` with TRL's bundled
  `qwen3_5_think_training.jinja` over Kiln's tokenizer.json; labels are the ids under the mask.
- conversational `prompt`/`completion` rows: `prompt + completion` rendered the same way; the
  labels are the assistant mask after the end of the prompt rendered alone (so an assistant turn
  inside the prompt is context). TRL's own prompt-completion path (`trl.trainer.sft_trainer`:
  `_tokenize` of the prompt with `add_generation_prompt=True`, `common_prefix_length`, the
  completion mask AND the assistant mask, as `SFTTrainer` builds labels) is recorded beside it as
  `trl`: its ids are the same; its labels also mask the first completion turn's opening
  `<think>` token, which TRL counts as prompt because the generation prompt already holds it.
- plain-string `prompt`/`completion` rows: TRL's prompt-completion path for non-conversational
  rows (the completion gets the EOS unless it ends with it, `_tokenize` of the prompt and of
  `prompt + completion`, `common_prefix_length`); `boundary_on_token` says whether the prompt
  ends on a token boundary of the complete text. Where it does Kiln must equal TRL; where a token
  straddles the boundary TRL supervises it and Kiln does not (`straddling_token`).

tests/kiln_train/data/test_row_formats_oracle.py compares Kiln's ingestion with the fixture,
without TRL.

Regenerate:

    .venv/bin/python qualification/sft_row_formats_oracle.py --write

Check (re-runs the oracle and diffs it against the fixture):

    .venv/bin/python qualification/sft_row_formats_oracle.py --check
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kiln_train.data.tokenizer import IM_END, build_tokenizer, write_tokenizer  # noqa: E402
from qualification.sft_oracle.stack import library_versions, mask_ranges, trl_template_path  # noqa: E402

FIXTURE = REPO / "qualification" / "fixtures" / "qwen35_row_formats_v1.json"
SCHEMA = "kiln.qwen35-sft-row-formats-oracle.v1"
REGENERATE = ".venv/bin/python qualification/sft_row_formats_oracle.py --write"

INSTRUCTION_ROWS = {
    "alpaca_with_input": {"instruction": "Translate to French", "input": "good morning", "output": "bonjour"},
    "alpaca_empty_input": {"instruction": "Name a prime number.", "input": "", "output": "7"},
    "alpaca_no_input_key": {"instruction": "Say hi", "output": "Hi!"},
    "system_and_history": {
        "system": "You answer in one word.",
        "history": [["Colour of the sky?", "Blue"], ["Colour of grass?", "Green"]],
        "instruction": "Colour of snow?",
        "output": "White",
    },
    "multiline_unicode": {
        "instruction": "Résume ce texte :\n\n",
        "input": "数据 — naïve café\r\nline two",
        "output": "Un café naïf.\n\n- point",
    },
    "delimiter_literals": {
        "instruction": "Echo <|im_end|> and <think>",
        "output": "<tool_call> literal </think>",
    },
}
PROMPT_COMPLETION_ROWS = {
    "single_turn": {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "completion": [{"role": "assistant", "content": "Blue."}],
    },
    "system_prompt": {
        "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
        "completion": [{"role": "assistant", "content": "4"}],
    },
    "assistant_turn_in_prompt_is_context": {
        "prompt": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another?"},
        ],
        "completion": [{"role": "assistant", "content": "Green."}],
    },
    "tool_call_completion": {
        "prompt": [{"role": "user", "content": "Weather in Paris?"}],
        "completion": [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "21°C"},
            {"role": "assistant", "content": "It is 21°C."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    },
    "reasoning_in_completion": {
        "prompt": [{"role": "user", "content": "Is 9 prime?"}],
        "completion": [{"role": "assistant", "content": "No.", "reasoning_content": "9 = 3 x 3."}],
    },
}
TEXT_ROWS = {
    "space_led_completion": {"prompt": "The capital of France is", "completion": " Paris."},
    "newline_boundary": {"prompt": "Q: 2+2?\nA:", "completion": " 4"},
    "completion_with_eos": {"prompt": "Hello", "completion": " world" + IM_END},
    "unicode": {"prompt": "Traduire : chat →", "completion": " cat 🐈"},
    "straddling_word": {"prompt": "The answer is for", "completion": "ty-two"},
    "straddling_digits": {"prompt": "Total: 12", "completion": "34 units"},
    "multiline": {"prompt": "def add(a, b):\n", "completion": "    return a + b\n"},
}


def instruction_messages(row: dict) -> list[dict]:
    """The documented conversion, written out here independently of Kiln's converter."""
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for question, answer in row.get("history") or []:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    user = row["instruction"] + ("\n" + row["input"] if row.get("input") else "")
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def rendered(hf, template: str, messages: list[dict], tools=None) -> tuple[str, list[int], list[int]]:
    kwargs = {"tools": tools, "chat_template": template}
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
    out = hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
    )
    return text, list(out["input_ids"]), list(out["assistant_masks"])


def instruction_case(hf, template: str, row: dict) -> dict:
    text, ids, mask = rendered(hf, template, instruction_messages(row))
    return {"text": text, "input_ids": ids, "supervised_ranges": mask_ranges(mask)}


def prompt_completion_case(hf, template: str, row: dict) -> dict:
    from trl.trainer.sft_trainer import _tokenize, common_prefix_length

    tools = row.get("tools")
    text, ids, mask = rendered(hf, template, row["prompt"] + row["completion"], tools)
    prompt_alone = _tokenize(hf, row["prompt"], chat_template=template, tools=tools)["input_ids"]
    if list(prompt_alone) != ids[: len(prompt_alone)]:
        raise SystemExit(f"the rendered prompt is not a prefix of prompt + completion: {row}")
    ours = [m if i >= len(prompt_alone) else 0 for i, m in enumerate(mask)]
    # TRL's own prompt-completion path, as SFTTrainer runs it (completion_only_loss and
    # assistant_only_loss both on): prompt with the generation prompt, then the common prefix.
    with_generation = _tokenize(
        hf, row["prompt"], chat_template=template, tools=tools, add_generation_prompt=True
    )
    trl_full = _tokenize(
        hf,
        row["prompt"] + row["completion"],
        chat_template=template,
        tools=tools,
        return_assistant_tokens_mask=True,
    )
    prompt_len = common_prefix_length(list(with_generation["input_ids"]), list(trl_full["input_ids"]))
    trl_mask = [int(a and i >= prompt_len) for i, a in enumerate(trl_full["assistant_masks"])]
    return {
        "text": text,
        "input_ids": ids,
        "supervised_ranges": mask_ranges(ours),
        "trl": {
            "input_ids_equal": list(trl_full["input_ids"]) == ids,
            "supervised_ranges": mask_ranges(trl_mask),
        },
    }


def text_case(hf, row: dict) -> dict:
    from trl.trainer.sft_trainer import _tokenize, common_prefix_length

    completion = row["completion"] if row["completion"].endswith(IM_END) else row["completion"] + IM_END
    text = row["prompt"] + completion
    prompt_ids = list(_tokenize(hf, row["prompt"])["input_ids"])
    full = hf(text=text, return_offsets_mapping=True)
    ids = list(full["input_ids"])
    prompt_len = common_prefix_length(prompt_ids, ids)
    boundary = len(row["prompt"])
    straddling = [i for i, (s, e) in enumerate(full["offset_mapping"]) if s < boundary < e]
    return {
        "text": text,
        "input_ids": ids,
        "trl_supervised_ranges": [[prompt_len, len(ids)]],
        "boundary_on_token": not straddling,
        "straddling_token": straddling[0] if straddling else None,
    }


def build(hf, template: str, tokenizer_json: Path) -> dict:
    cases = []
    for name, row in INSTRUCTION_ROWS.items():
        cases.append(
            {"name": name, "format": "instruction", "row": row, **instruction_case(hf, template, row)}
        )
    for name, row in PROMPT_COMPLETION_ROWS.items():
        cases.append(
            {
                "name": name,
                "format": "prompt_completion",
                "row": row,
                **prompt_completion_case(hf, template, row),
            }
        )
    for name, row in TEXT_ROWS.items():
        cases.append({"name": name, "format": "text_prompt_completion", "row": row, **text_case(hf, row)})
    return {
        "schema": SCHEMA,
        "regenerate": REGENERATE,
        "versions": library_versions(),
        "template": trl_template_path().name,
        "eos_token": IM_END,
        "cases": cases,
    }


def dump(fixture: dict) -> str:
    return json.dumps(fixture, ensure_ascii=False, indent=1) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in fixture")
    mode.add_argument("--check", action="store_true", help="re-run the oracle and diff")
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    template = trl_template_path().read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_json, _ = write_tokenizer(tmp, build_tokenizer())
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token=IM_END)
        fixture = build(hf, template, tokenizer_json)
    if args.check:
        stored = json.loads(FIXTURE.read_text(encoding="utf-8"))
        fresh = json.loads(dump(fixture))
        differs = [c["name"] for c, s in zip(fresh["cases"], stored["cases"], strict=False) if c != s]
        if differs or len(fresh["cases"]) != len(stored["cases"]):
            print(
                f"the oracle differs from {FIXTURE.name}: {differs or 'case count'}; regenerate: {REGENERATE}"
            )
            return 1
        print(f"{len(fresh['cases'])} cases: the oracle agrees with {FIXTURE.name}")
        return 0
    FIXTURE.write_text(dump(fixture), encoding="utf-8")
    print(f"wrote {FIXTURE} ({len(fixture['cases'])} cases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
