#!/usr/bin/env python3
"""Check that the docs point at code that exists and that every docs anchor resolves.

Two checks, both over the files git tracks:

1. Code references in `docs/*.md` and `README.md`: a backquoted `path/file.py: name` (or
   `Class.method`) must name a file that defines that name at module level (a def, class or
   assignment; importing it is not defining it), and a backquoted repository path
   (`api/app.py`, `deploy/queries.sql`) must exist. A path followed by a parenthesised list of
   backquoted names (`kiln_train/train/trainer.py` (`train_sft`)), or by more backquoted names
   after `path.py: name`, is checked the same way. A bare file name (`formulas.py: estimate`)
   must match exactly one tracked file. A dotted reference whose module part has at least two
   components (`kiln.broker`, `kiln_train.errors.KilnError`) must name a module, and the rest a
   name it defines.
2. Citations `docs/<page>.md#<anchor>` anywhere in the repository, and relative links
   `(<page>.md#<anchor>)` inside docs/, must name a heading of that page (GitHub's slug).

Usage: .venv/bin/python scripts/check_docs_refs.py   (exit 1 and one line per problem)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_DIRS = ("api/", "kiln/", "kiln_cli/", "kiln_train/", "worker/", "migrations/", "tests/", "qualification/")
TOP_DIRS += ("deploy/", "scripts/", "docs/", "examples/")
PACKAGES = ("api", "kiln", "kiln_cli", "kiln_train", "worker", "migrations")
# Placeholders that stand for "some file", not a file of this repository.
PLACEHOLDERS = {"path/to/module.py", "path/file.py"}

SPAN = re.compile(r"`([^`\n]+)`")
PATH = r"[A-Za-z0-9_./-]+\.[A-Za-z0-9]+"
REF = re.compile(rf"^({PATH}):\s*([A-Za-z_][\w.]*)(\(\))?$")
NAME_LIST = re.compile(r"\s*\(((?:`[A-Za-z_][\w.]*(?:\(\))?`(?:,\s*|\s+and\s+)?)+)\)")
# More names of the same file after `path.py: name`: ", `other`, `third`".
MORE_NAMES = re.compile(r"((?:(?:,\s*|\s+and\s+)`[A-Za-z_][\w.]*(?:\(\))?`)+)")
DOC_ANCHOR = re.compile(r"docs/([A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)")
LOCAL_LINK = re.compile(r"\]\(([A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)\)")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: str) -> frozenset[str]:
    path = ROOT / "docs" / page
    if not path.is_file():
        return frozenset()
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if in_fence or not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(out)


@cache
def definitions(rel: str) -> frozenset[str]:
    """Module-level names a Python file defines, plus `Class.member` for its classes."""
    tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
    names: set[str] = set()

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Assign):
            return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    def walk(body: list[ast.stmt], prefix: str = "") -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef) and not prefix:
                    walk(node.body, node.name + ".")
            elif isinstance(node, ast.If | ast.Try):
                walk(node.body, prefix)
                walk(getattr(node, "orelse", []), prefix)
            else:
                names.update(prefix + name for name in targets(node))

    walk(tree.body)
    return frozenset(names)


def resolve(path: str, files: list[str]) -> str | None:
    if "/" in path:
        return path if path in files else None
    hits = [f for f in files if f.rsplit("/", 1)[-1] == path and not f.startswith("tests/")]
    return hits[0] if len(hits) == 1 else None


def check_name(where: str, path: str, name: str, files: list[str], problems: list[str]) -> None:
    rel = resolve(path, files)
    if rel is None:
        problems.append(f"{where}: `{path}` is not a (unique) tracked file")
    elif rel.endswith(".py") and name not in definitions(rel):
        problems.append(f"{where}: `{path}` does not define `{name}`")


def check_dotted(where: str, text: str, files: list[str], problems: list[str]) -> bool:
    """Check `pkg.module[.Name]`; False when `text` is not such a reference."""
    parts = text.split(".")
    if parts[0] not in PACKAGES or len(parts) < 2:
        return False
    for cut in range(len(parts), 1, -1):
        base = "/".join(parts[:cut])
        module = next((f for f in (base + ".py", base + "/__init__.py") if f in files), None)
        if module is None:
            continue
        rest = ".".join(parts[cut:])
        if rest:
            check_name(where, module, rest, files, problems)
        return True
    if (ROOT / parts[0] / (parts[1] + ".py")).exists() or (ROOT / parts[0] / parts[1]).is_dir():
        problems.append(f"{where}: `{text}` names no module")
        return True
    return False


def check_code_refs(files: list[str], problems: list[str]) -> int:
    count = 0
    pages = [f for f in files if f.startswith("docs/") and f.endswith(".md")] + ["README.md"]
    for page in pages:
        for lineno, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
            where = f"{page}:{lineno}"
            for span in SPAN.finditer(line):
                text = span.group(1).strip()
                ref = REF.match(text)
                if ref and ref.group(1) not in PLACEHOLDERS:
                    count += 1
                    check_name(where, ref.group(1), ref.group(2), files, problems)
                    more = MORE_NAMES.match(line, span.end())
                    for name in re.findall(r"`([A-Za-z_][\w.]*)(?:\(\))?`", more.group(1) if more else ""):
                        count += 1
                        check_name(where, ref.group(1), name, files, problems)
                    continue
                if re.fullmatch(r"[A-Za-z_][\w.]*[A-Za-z_0-9]", text) and check_dotted(
                    where, text, files, problems
                ):
                    count += 1
                    continue
                if not re.fullmatch(PATH, text) or not text.startswith(TOP_DIRS):
                    continue
                count += 1
                if text not in files and not (ROOT / text).is_dir():
                    problems.append(f"{where}: `{text}` does not exist")
                    continue
                listed = NAME_LIST.match(line, span.end())
                if listed and text.endswith(".py"):
                    for name in re.findall(r"`([A-Za-z_][\w.]*)(?:\(\))?`", listed.group(1)):
                        count += 1
                        check_name(where, text, name, files, problems)
    return count


def check_anchors(files: list[str], problems: list[str]) -> int:
    count = 0
    for rel in files:
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        in_docs = rel.startswith("docs/")
        for lineno, line in enumerate(text.splitlines(), 1):
            found = list(DOC_ANCHOR.finditer(line))
            if in_docs:
                found += list(LOCAL_LINK.finditer(line))
            for match in found:
                count += 1
                page, anchor = match.groups()
                if not (ROOT / "docs" / page).is_file():
                    problems.append(f"{rel}:{lineno}: docs/{page} does not exist")
                elif anchor not in anchors(page):
                    problems.append(f"{rel}:{lineno}: docs/{page} has no section #{anchor}")
    return count


def main() -> int:
    files = tracked()
    problems: list[str] = []
    refs = check_code_refs(files, problems)
    cites = check_anchors(files, problems)
    for problem in problems:
        print(problem)
    print(f"{refs} code references, {cites} docs anchors checked; {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
