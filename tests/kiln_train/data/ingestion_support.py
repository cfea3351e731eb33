"""Rows with hand-written canonical forms and golden digests, shared by the ingestion tests."""

from __future__ import annotations

import hashlib
import struct

from kiln_train.errors import TRAINING_INVALID_REQUEST, KilnError

PLAIN = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
TOOL_ROW = {
    "id": 7,  # unknown example-level keys are ignored
    "messages": [
        {"role": "user", "content": "Météo à Paris ?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "w", "content": "21°C"},
        {"role": "assistant", "content": "21°C.", "reasoning_content": "ok"},
    ],
}
# Hand-written canonical forms (sorted keys, no spaces, raw UTF-8; arguments stay the original string).
PLAIN_CANONICAL = '{"messages":[{"content":"Hi","role":"user"},{"content":"Hello","role":"assistant"}]}'
TOOL_CANONICAL = (
    '{"messages":[{"content":"Météo à Paris ?","role":"user"},{"content":"","role":"assistant","tool_calls":'
    '[{"function":{"arguments":"{\\"city\\": \\"Paris\\"}","name":"w"},"id":"c1","type":"function"}]},'
    '{"content":"21°C","name":"w","role":"tool","tool_call_id":"c1"},'
    '{"content":"21°C.","reasoning_content":"ok","role":"assistant"}]}'
)
# Golden digests (literal; the test below also recomputes them independently).
PLAIN_SHA = "sha256:e92c80e0bb106519492e476727768e86ed060e621afdf3b2526ccbd3149f2266"
TOOL_SHA = "sha256:52fc39135a2aae30e58600e8c83223320b13905b160a786c5ad3e67a807d250f"
RAW_SHA = "sha256:203c496303db2e4523301d8ce07b9525721c1a35ea40cd8873ead384bebcacb7"  # b'{"messages": ['
CORPUS_SHA = "sha256:967a601d75f178d0454c770e2b1b70183b0b063c59e0318b653e2f2c67a2603d"  # [PLAIN, TOOL]


def write_jsonl(path, lines: list[str]) -> None:
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))


def reject_message(exc: KilnError) -> str:
    assert exc.code == TRAINING_INVALID_REQUEST
    return exc.message


def independent_digest(domain: bytes, payload: bytes) -> str:
    """A row digest computed here, without Kiln's code."""
    return "sha256:" + hashlib.sha256(domain + b"\x00" + payload).hexdigest()


def independent_corpus(hashes: list[str]) -> str:
    """The kept-corpus digest computed here, without Kiln's code."""
    body = b"".join(struct.pack(">Q", len(h)) + h.encode("ascii") for h in hashes)
    return independent_digest(b"kiln.sft-kept-corpus.v1", body)
