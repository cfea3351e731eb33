"""Benchmark: SFT ingestion throughput (render, tokenize, label, hash) on the CPU.

Builds 10,000 seeded multi-turn conversations of about 1,000 tokens each (a third with a tools
list, tool calls and tool responses, half with reasoning), writes them as JSONL, then ingests
them through `ingest_jsonl` (the dataset_path transport, JSON parsing included) and through
`ingest_examples` (inline objects). Prints rows/s, tokens/s and the time split per stage.

    .venv/bin/python qualification/bench_ingestion.py [--rows 10000] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln_train.data.chat_template import training_template  # noqa: E402
from kiln_train.data.ingestion import IngestionTimings, ingest_examples, ingest_jsonl  # noqa: E402
from kiln_train.data.tokenizer import build_tokenizer  # noqa: E402

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "an",
    "el",
    "is",
    "on",
    "ur",
    "ex",
    "qu",
    "str",
    "ing",
    "tion",
    "able",
    "ment",
    "er",
    "ly",
    "pre",
    "con",
]
CJK = "数据模型训练推理优化学习网络参数梯度损失函数"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a record by key",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]


def sentence(rng: random.Random, words: int) -> str:
    out = []
    for _ in range(words):
        r = rng.random()
        if r < 0.05:
            out.append(str(rng.randint(0, 99999)))
        elif r < 0.08:
            out.append("".join(rng.choice(CJK) for _ in range(rng.randint(2, 5))))
        else:
            out.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))))
    return " ".join(out).capitalize() + rng.choice([".", "?", "!", ";"])


def conversation(rng: random.Random, target_tokens: int) -> dict:
    """One multi-turn row of roughly `target_tokens` tokens (about 2.3 tokens per generated word)."""
    words_left = int(target_tokens / 2.3)
    row: dict = {"messages": [{"role": "system", "content": sentence(rng, 12)}]}
    with_tools = rng.random() < 1 / 3
    if with_tools:
        row["tools"] = TOOLS
        words_left -= 150  # the tools preamble (~350 tokens)
    while words_left > 0:
        n = min(words_left, rng.randint(40, 160))
        row["messages"].append({"role": "user", "content": sentence(rng, n // 3)})
        answer = {"role": "assistant", "content": sentence(rng, n - n // 3)}
        if rng.random() < 0.5:
            answer["reasoning_content"] = sentence(rng, 20)
            words_left -= 20
        if with_tools and rng.random() < 0.5:
            call = {"function": {"name": "lookup", "arguments": json.dumps({"key": sentence(rng, 3)})}}
            row["messages"].append({"role": "assistant", "content": None, "tool_calls": [call]})
            row["messages"].append({"role": "tool", "content": sentence(rng, 15)})
            words_left -= 25
        row["messages"].append(answer)
        words_left -= n
    return row


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (tokenizers encodes on a thread pool)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def report(label: str, seconds: float, cpu: float, result, timings: IngestionTimings) -> None:
    rows = len(result.rows)
    print(
        f"{label}: {rows} rows, {result.total_tokens} tokens "
        f"({result.total_tokens / rows:.0f}/row, max {result.max_seq_len}) in {seconds:.2f} s -> "
        f"{rows / seconds:,.0f} rows/s, {result.total_tokens / seconds:,.0f} tokens/s"
    )
    # Wall figures depend on what else the machine runs; CPU figures do not.
    print(
        f"  cpu {cpu:.2f} s ({cpu / seconds:.2f} cores busy) -> {result.total_tokens / cpu:,.0f} tokens per cpu-second"
    )
    accounted = timings.parse_hash + timings.render + timings.tokenize + timings.label
    print(
        f"  split: parse+normalise+hash {timings.parse_hash:.2f} s, render {timings.render:.2f} s, "
        f"tokenize {timings.tokenize:.2f} s, label {timings.label:.2f} s, "
        f"other (I/O, policy, receipt) {seconds - accounted:.2f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=1_000, help="approximate tokens per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    training_template()
    print(
        f"tokenizer build {time.perf_counter() - t0:.2f} s; cpus {os.cpu_count()}; load {os.getloadavg()[0]:.1f}"
    )
    rng = random.Random(args.seed)
    rows = [conversation(rng, args.tokens) for _ in range(args.rows)]

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"dataset {path.stat().st_size / 1e6:.1f} MB")
        timings = IngestionTimings()
        t0, c0 = time.perf_counter(), cpu_seconds()
        result = ingest_jsonl(path, tokenizer=tokenizer, timings=timings)
        report("ingest_jsonl", time.perf_counter() - t0, cpu_seconds() - c0, result, timings)
        corpus = result.receipt["kept_corpus_sha256"]
        del result

    timings = IngestionTimings()
    t0, c0 = time.perf_counter(), cpu_seconds()
    result = ingest_examples(rows, tokenizer=tokenizer, timings=timings)
    report("ingest_examples", time.perf_counter() - t0, cpu_seconds() - c0, result, timings)
    assert result.receipt["kept_corpus_sha256"] == corpus, (
        "the two transports must agree on the data identity"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
