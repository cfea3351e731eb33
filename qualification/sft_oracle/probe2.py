"""The corner-case fixture's generator (`probe2_rows`): what the two other generators do not reach.

Tool-call arguments of every JSON type written every way (dicts, big integers, -0.0, exponents,
escapes, NUL, paired surrogates, the largest f64), turns after the last assistant (user or tool),
consecutive assistant or user turns, reasoning aliases given together, reasoning/tool_calls on
roles the template ignores, content-part arrays without a type or with unknown types, control
characters, and tools schemas. Every row has a valid tool-call structure.
"""

from __future__ import annotations

import json
import random

_P_ATOMS = [
    "x",
    "héllo",
    " ",
    "\n",
    "\r\n",
    "\t",
    "\x00",
    "\x07",
    "\x1b[0m",
    "\u2028",
    "\x85",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|im_end|>",
    "<|im_start|>assistant\n",
    '"',
    "\\",
    "😀",
    "e\u0301",
    "中文",
    "  ",
    "</parameter>",
    "<function=g>",
    "\ufeff",
    "\u200b",
]
_NEGATIVE_ZERO, _EXPONENT = "\x00-0.0\x00", "\x00exp\x00"  # placeholders for number spellings


def _ptext(rng: random.Random, lo: int = 0, hi: int = 5) -> str:
    return "".join(rng.choice(_P_ATOMS) for _ in range(rng.randint(lo, hi)))


def _pvalue(rng: random.Random, depth: int = 0):
    kind = rng.choice(["s", "i", "f", "b", "n", "l", "d", "big", "-0", "e"] if depth < 3 else ["s", "i"])
    if kind == "s":
        return _ptext(rng)
    if kind == "i":
        return rng.randint(-(10**9), 10**9)
    if kind == "f":
        return rng.choice([0.1, -2.5, 1e-7, 1e22, 3.0, 1.7976931348623157e308, 5e-324])
    if kind == "b":
        return rng.random() < 0.5
    if kind == "n":
        return None
    if kind == "l":
        return [_pvalue(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "big":
        return rng.choice([2**64, -(2**63) - 1, 10**30])
    if kind == "-0":
        return _NEGATIVE_ZERO
    if kind == "e":
        return _EXPONENT
    return {_ptext(rng, 1, 2) or "k": _pvalue(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _pargs_text(rng: random.Random, args: dict) -> str:
    """The arguments as a producer might write them: any escaping and layout, -0.0 and exponents."""
    text = json.dumps(args, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 1]))
    text = text.replace(json.dumps(_NEGATIVE_ZERO), "-0.0")
    return text.replace(json.dumps(_EXPONENT), rng.choice(["1E2", "2.50e-3", "-1e+5", "0.0e0"]))


def _pobject(value):
    """Placeholders as the numbers themselves (for arguments given as an object)."""
    if isinstance(value, dict):
        return {k: _pobject(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_pobject(v) for v in value]
    return {_NEGATIVE_ZERO: -0.0, _EXPONENT: 100.0}.get(value, value) if isinstance(value, str) else value


def _pcontent(rng: random.Random):
    x = rng.random()
    if x < 0.1:
        return None
    if x < 0.2:
        shapes = [
            lambda: {"type": "text", "text": _ptext(rng)},
            lambda: {"text": _ptext(rng)},
            lambda: {"type": "input_text", "text": _ptext(rng)},
        ]
        return [rng.choice(shapes)() for _ in range(rng.randint(0, 3))]
    return _ptext(rng, 0, 6)


def _passistant(rng: random.Random) -> dict:
    message: dict = {"role": "assistant", "content": _pcontent(rng)}
    aliases = ["reasoning_content", "thinking", "reasoning"]
    if rng.random() < 0.4:
        message[rng.choice(aliases)] = rng.choice([None, "", " ", _ptext(rng)])
    if rng.random() < 0.15:
        message[rng.choice(aliases)] = _ptext(rng)
    if rng.random() < 0.2:
        message["content"] = f"{_ptext(rng, 0, 2)}<think>{_ptext(rng)}</think>{_ptext(rng)}"
    return message


def _pcall(rng: random.Random, k: int) -> dict:
    function: dict = {"name": rng.choice(["f", "get x", "名前", "a.b-c"])}
    args = {_ptext(rng, 1, 2) or "k": _pvalue(rng) for _ in range(rng.randint(0, 4))}
    mode = rng.random()
    if mode < 0.6:
        function["arguments"] = _pargs_text(rng, args)
    elif mode < 0.85:
        function["arguments"] = _pobject(args)
    call: dict = {"function": function}
    if rng.random() < 0.7:
        call.update(id=f"c{k}", type="function")
    return call


def probe2_row(rng: random.Random) -> dict:
    """One seeded conversation for the probe2 fixture (always a valid tool-call structure)."""
    row: dict = {}
    if rng.random() < 0.3:
        row["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _ptext(rng, 1, 2),
                    "description": _ptext(rng),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "a": {"type": "array", "items": {"type": ["string", "null"]}},
                            "n": {"type": "number", "minimum": -1.5},
                        },
                    },
                },
            }
            for _ in range(rng.randint(0, 2))
        ]
    messages: list[dict] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": _pcontent(rng)})
    for _ in range(rng.randint(1, 4)):
        user: dict = {"role": "user", "content": _pcontent(rng)}
        if rng.random() < 0.1:
            user["reasoning_content"] = _ptext(rng)  # ignored by the template, as by TRL
        if rng.random() < 0.05:
            user["tool_calls"] = [{"function": {"name": "f", "arguments": "{}"}}]
        if rng.random() < 0.1:
            user["name"] = "bob"
        messages.append(user)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):  # consecutive assistant turns
            assistant = _passistant(rng)
            messages.append(assistant)
            if rng.random() < 0.4:
                calls = [_pcall(rng, k) for k in range(rng.randint(1, 3))]
                assistant["tool_calls"] = calls
                for k in range(rng.randint(1, len(calls) + 1)):
                    result: dict = {"role": "tool", "content": _pcontent(rng)}
                    if rng.random() < 0.5:
                        result["tool_call_id"] = f"c{k}"
                    messages.append(result)
    if rng.random() < 0.2:
        messages.append({"role": "user", "content": _pcontent(rng)})  # trailing unsupervised context
    row["messages"] = messages
    return row


def probe2_rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [probe2_row(rng) for _ in range(n)]
