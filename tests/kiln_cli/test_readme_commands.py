"""The README is the user's manual: every `kiln ...` command it shows exists with the flags it
shows, and every curl example names a route the api serves with that method (the route table of
`GET /openapi.json`, which tests/api keeps equal to the app's routes).
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import click
import pytest

from api.openapi import build_document
from kiln_cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
MANUALS = (ROOT / "README.md", ROOT / "examples" / "README.md")


def kiln_snippets() -> list[str]:
    """Every inline or fenced `kiln ...` command, whitespace collapsed."""
    out = []
    for manual in MANUALS:
        text = manual.read_text(encoding="utf-8")
        for span in re.findall(r"`(kiln [^`]+)`", text):
            out.append(" ".join(span.split()))
        for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S):
            for line in block.splitlines():
                # a command block spells it as run from a fresh clone: `.venv/bin/kiln ...`
                line = line.split(" #")[0].strip().removeprefix(".venv/bin/")
                if line.startswith("kiln "):
                    out.append(line.split("|")[0].strip() if " | " in line else line)
    return sorted(set(out))


def expand(snippet: str) -> list[list[str]]:
    """`kiln jobs list|show` -> [[jobs, list], [jobs, show]]; positional values are dropped."""
    words = shlex.split(snippet)[1:]
    path_words, flags = [], []
    for word in words:
        if word.startswith("-"):
            flags.append(word.split("=")[0])
        elif not flags:
            path_words.append(word.split("|"))
    commands = []
    for choice in itertools.product(*path_words):
        commands.append([*choice, *flags])
    return commands


SNIPPETS = kiln_snippets()


def test_the_manuals_show_the_commands_people_need():
    shown = {" ".join(c) for s in SNIPPETS for c in expand(s)}
    for needed in ("serve", "worker", "demo", "db upgrade", "config show", "config reference"):
        assert any(c.startswith(needed) for c in shown), needed
    assert any(s.startswith("kiln train sft --data") for s in SNIPPETS)


def resolve(words: list[str]) -> tuple[click.Command, list[str], list[str]]:
    """(command, its path, the words after it) by walking the click groups."""
    command: click.Command = cli
    path: list[str] = []
    for i, word in enumerate(words):
        if isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
            path.append(word)
        else:
            return command, path, words[i:]
    return command, path, []


@pytest.mark.parametrize("snippet", SNIPPETS)
def test_every_kiln_command_in_the_manuals_exists_with_its_flags(snippet):
    for words in expand(snippet):
        command, path, rest = resolve(words)
        assert path, snippet
        positional = [w for w in rest if not w.startswith("-")]
        flags = [w for w in rest if w.startswith("-")]
        assert not (isinstance(command, click.Group) and positional), (
            snippet,
            "no such subcommand",
            positional,
        )
        options = {opt for param in command.params for opt in param.opts}
        for flag in flags:
            assert flag in options, (snippet, flag)
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        for value, argument in zip(positional, arguments, strict=False):
            if isinstance(argument.type, click.Choice):
                assert value in argument.type.choices, (snippet, value)


def curl_examples() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\nAPI=(.*?)```", text, re.S).group(1)
    examples = []
    for command in re.split(r"\n(?=curl )", block):
        if not command.startswith("curl "):
            continue
        first = command.split("#")[0]
        method = re.search(r"-X (\w+)", first)
        verb = method.group(1) if method else ("POST" if " -d " in first else "GET")
        url = re.search(r'"?\$API(/[^\s"?]*)', first).group(1)
        examples.append((verb.lower(), url))
    return examples


def test_every_curl_example_is_a_route_with_that_method():
    paths = build_document(auth=True)["paths"]
    examples = curl_examples()
    assert len(examples) >= 16
    for verb, url in examples:
        template = re.sub(r"\$JOB", "{job_id}", url).replace("/support-bot", "/{name}")
        template = template.replace("/datasets/rows.jsonl", "/datasets/{dataset}")
        assert template in paths, (verb, url)
        assert verb in paths[template], (verb, url, sorted(paths[template]))
