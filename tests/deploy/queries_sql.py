"""The documented queries of deploy/queries.sql, parsed into {name: (question, sql)}."""

from __future__ import annotations

import re
from pathlib import Path

QUERIES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "queries.sql"
NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$")


def parse_queries(source: str) -> dict[str, tuple[str, str]]:
    """`-- name: x` sections → {name: (question, sql)}; comment lines form the question."""
    queries: dict[str, tuple[list[str], list[str]]] = {}
    current: str | None = None
    for line in source.splitlines():
        match = NAME_LINE.match(line.strip())
        if match:
            current = match.group(1)
            assert current not in queries, f"query {current} defined twice"
            queries[current] = ([], [])
        elif current is not None and line.strip().startswith("--"):
            queries[current][0].append(line.strip()[2:].strip())
        elif current is not None and line.strip():
            queries[current][1].append(line)
    return {name: (" ".join(doc), "\n".join(sql).strip().rstrip(";")) for name, (doc, sql) in queries.items()}


QUERIES = parse_queries(QUERIES_FILE.read_text())
