"""The conversations fixture's generator (`conversation_rows`): hundreds of seeded conversations.

Built to reach the corners a real dataset reaches: a system prompt or none, several turns,
reasoning under all three field names and inline <think> blocks in every shape, single and
parallel tool calls with JSON-string, object, "{}" and missing arguments, tool results with
name/tool_call_id and content-part arrays, tools listed in the system turn,
unicode/emoji/CJK/CRLF/tabs/NFD text, Unicode whitespace that `trim` removes, delimiter literals
typed into every role, empty and whitespace-only content. Every row has a valid tool-call structure.
"""

from __future__ import annotations

import json
import random

from .named_cases import WEATHER_TOOL

_ATOMS = [
    "hello",
    "world",
    "  padded  ",
    "\n",
    "\t",
    "\r\n",
    "\r",
    " ",
    "数据",
    "模型训练",
    "한국어",
    "😀",
    "👨‍👩‍👧‍👦",
    "🇯🇵",
    "\U0001f600\u200d",
    "e\u0301",
    "\u0301",
    "A\u030a",
    "Å",
    "ﬁ",
    "ｆｕｌｌ",
    "naïve",
    "Zürich",
    "ДАННЫЕ",
    "مرحبا",
    "x = [1, 2]",
    "{'a': 1}",
    '"quoted"',
    "\\n",
    "tab\there",
    "1.5",
    "assistant",
    "user\n",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<function=f>",
    "</parameter>",
    "\u3000",
    "\xa0",
    "\u2028",
    "\x85",
    "\x0b",
    "\x0c",
    "\x1c",
    "\u200b",
    "\ufeff",
]

_CONV_TOOLS = [
    WEATHER_TOOL,
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Recherche — <tool_call> literal ☀",
            "parameters": {"type": "object", "properties": {"q": {"type": "string", "minLength": 1}}},
        },
    },
    {"type": "function", "function": {"name": "noargs", "parameters": {"type": "object", "properties": {}}}},
]


def _ctext(rng: random.Random, lo: int = 0, hi: int = 6) -> str:
    return "".join(rng.choice(_ATOMS) + rng.choice(["", " ", "", "\n"]) for _ in range(rng.randint(lo, hi)))


def _ccontent(rng: random.Random, lo: int = 0, hi: int = 6):
    x = rng.random()
    if x < 0.12:
        return [{"type": "text", "text": _ctext(rng, 0, 3)} for _ in range(rng.randint(1, 3))]
    if x < 0.17:
        return None
    if x < 0.22:
        return rng.choice(["", " ", "\n\n", "\t \r\n", "\u3000"])
    return _ctext(rng, lo, hi)


def _cvalue(rng: random.Random, depth: int = 0):
    kind = rng.choice(["s", "i", "f", "b", "n", "l", "d"] if depth < 2 else ["s", "i"])
    if kind == "s":
        return _ctext(rng, 0, 3)
    if kind == "i":
        return rng.randint(-(10**6), 10**6)
    if kind == "f":
        return rng.choice([1.5, -0.25, 3.0, 1e-7, 123456.789, 2.5e20, 0.1, 1e16, 1e-5])
    if kind == "b":
        return rng.random() < 0.5
    if kind == "n":
        return None
    if kind == "l":
        return [_cvalue(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        (_ctext(rng, 1, 1).strip() or "k") + str(i): _cvalue(rng, depth + 1) for i in range(rng.randint(0, 3))
    }


def _ccall(rng: random.Random, k: int) -> dict:
    name = rng.choice(["get_weather", "search", "f", "noargs", "ns.tool-x_1", "数据"])
    args = {
        rng.choice(["city", "q", "p", "参数", "a b", "x\ny"]) + str(j): _cvalue(rng)
        for j in range(rng.randint(0, 3))
    }
    function: dict = {"name": name}
    mode = rng.random()
    if mode < 0.7:  # OpenAI: a JSON string, in whatever formatting the producer used
        function["arguments"] = json.dumps(
            args,
            ensure_ascii=rng.random() < 0.5,
            separators=rng.choice([None, (",", ":")]),
            indent=rng.choice([None, None, 2]),
        )
    elif mode < 0.8:  # already an object
        function["arguments"] = args
    elif mode < 0.9:
        function["arguments"] = "{}"
    return {"id": f"call_{k}", "type": "function", "function": function}


def _cthink(rng: random.Random) -> str:
    r, c = _ctext(rng, 0, 4), _ctext(rng, 0, 4)
    return rng.choice(
        [
            f"<think>{r}</think>{c}",
            f"<think>\n{r}\n</think>\n\n{c}",
            f"\n\n<think>\n\n{r}\n\n</think>{c}",
            f"</think>{c}",
            f"<think>{r}",
            f"{r}</think>{c}</think>{c}",
            f"pre<think>{r}</think>{c}",
            f"<think></think>{c}",
            f"<think>{r}</think>",
            "<think>a<think>b</think>c",
        ]
    )


def _cassistant(rng: random.Random) -> dict:
    message: dict = {"role": "assistant"}
    message["content"] = _cthink(rng) if rng.random() < 0.3 else _ccontent(rng, 0, 5)
    if rng.random() < 0.1:
        del message["content"]
    if rng.random() < 0.3:
        key = rng.choice(["reasoning_content", "reasoning_content", "thinking", "reasoning"])
        message[key] = rng.choice([_ctext(rng, 0, 4), "\n\n" + _ctext(rng, 1, 3) + "\n\n", "", " \n", None])
    return message


def conversation_row(rng: random.Random) -> dict:
    """One seeded conversation for the conversations fixture (always a valid tool-call structure)."""
    messages: list[dict] = []
    row: dict = {}
    if rng.random() < 0.35:
        row["tools"] = rng.sample(_CONV_TOOLS, rng.randint(1, 3))
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _ccontent(rng, 0, 4)})
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.1:  # a user turn that is only a wrapped tool response is not a query
            messages.append(
                {
                    "role": "user",
                    "content": rng.choice(
                        ["<tool_response>\nfoo\n</tool_response>", " <tool_response>x</tool_response>\n"]
                    ),
                }
            )
        messages.append({"role": "user", "content": _ccontent(rng, 1, 6)})
        assistant = _cassistant(rng)
        if rng.random() < 0.35:
            n = rng.randint(1, 3)
            assistant["tool_calls"] = [_ccall(rng, k) for k in range(n)]
            if rng.random() < 0.3:
                assistant["content"] = None
            messages.append(assistant)
            for k in range(rng.randint(1, n)):
                result: dict = {"role": "tool", "content": _ccontent(rng, 0, 4)}
                if rng.random() < 0.7:
                    result["tool_call_id"] = f"call_{k}"
                if rng.random() < 0.7:
                    result["name"] = "f"
                messages.append(result)
            if rng.random() < 0.6:
                messages.append(_cassistant(rng))
        else:
            messages.append(assistant)
    row["messages"] = messages
    return row


def conversation_rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [conversation_row(rng) for _ in range(n)]
