"""Benchmark: the memory one dataset upload or inspection costs, against its body.

    .venv/bin/python qualification/bench_request_memory.py [--cases upload:57:2000,...]

Each case `mode:MiB:line` builds a JSON Lines body of `MiB` MiB (one row if `line` >= the body) of
rows `line` bytes long, then runs what the route runs on it in a fresh process: the upload's
validation (`api/datasets.py: inspect_file`, every row slim) or an inspector page of 100 rows
(`inspect_file` with a `PageBudget`, then `inspect_response` serialised). A sampler thread reads
the process's resident set every 5 ms; printed: the body, the peak above the start, the ratio and
the answer's size. The figures in docs/security.md#what-a-request-may-cost come from here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CASES = "upload:57:2000,upload:15:2000,upload:1:1048000,inspect:15:2000,inspect:1:1048000"
WORDS = "the quick brown fox jumps over a lazy dog "


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def body_file(directory: Path, mib: float, line: int) -> Path:
    content = (WORDS * (line // len(WORDS) + 1))[: max(1, line - 90)]
    row = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]}
    )
    path = directory / "body.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for _ in range(max(1, int(mib * 2**20) // (len(row) + 1))):
            out.write(row + "\n")
    return path


def measure(mode: str, mib: float, line: int) -> dict:
    """One case in this process (call it in a fresh one: the peak is the process's)."""
    sys.path.insert(0, str(ROOT))
    from api.datasets import inspect_file, inspect_response, packaged_tokenizer
    from api.request_bounds import PageBudget

    tokenizer = packaged_tokenizer()
    with tempfile.TemporaryDirectory() as scratch:
        path = body_file(Path(scratch), mib, line)
        size = path.stat().st_size
        base = _rss()
        peak = [base]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.perf_counter()
        answer = 0
        try:
            page = PageBudget(0, 100) if mode == "inspect" else None
            inspection = inspect_file(path, tokenizer, "skip", "body", page)
            if mode == "inspect":
                answer = len(inspect_response(inspection, tokenizer, "bench", 0, 100).model_dump_json())
        finally:
            done.set()
            sampler.join()
        return {
            "mode": mode,
            "body_bytes": size,
            "line_bytes": line,
            "peak_bytes": peak[0] - base,
            "answer_bytes": answer,
            "seconds": time.perf_counter() - started,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, mib, line = args.one.split(":")
        print(json.dumps(measure(mode, float(mib), int(line))))
        return
    print(f"{'request':<8} {'body':>10} {'line':>10} {'peak':>10} {'ratio':>6} {'answer':>10} {'s':>6}")
    for case in args.cases.split(","):
        out = subprocess.run(
            [sys.executable, __file__, "--one", case], capture_output=True, text=True, check=True, cwd=ROOT
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        mib = 2**20
        print(
            f"{r['mode']:<8} {r['body_bytes'] / mib:>8.1f}Mi {r['line_bytes']:>10} "
            f"{r['peak_bytes'] / mib:>8.0f}Mi {r['peak_bytes'] / r['body_bytes']:>6.1f} "
            f"{r['answer_bytes']:>10} {r['seconds']:>6.1f}"
        )


if __name__ == "__main__":
    main()
