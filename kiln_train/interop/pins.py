"""The versions the TRL runner is pinned to: `runner/requirements.lock` and how it is made.

The lock pins the installed closure of `ROOTS` (every distribution they require, transitively,
without extras) at the versions of the environment Kiln's interop tests run in, so a bundle names
exactly the stack its agreement with Kiln was measured on. Local version labels are dropped
(`torch==2.13.0` admits the CPU and the CUDA wheels of 2.13.0).
`tests/kiln_train/interop/test_pins.py` fails when the environment and the lock part ways;
regenerate with

    .venv/bin/python -m kiln_train.interop.pins --write
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

ROOTS = (
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "safetensors",
    "tokenizers",
    "jinja2",
)
LOCK_PATH = Path(__file__).parent / "runner" / "requirements.lock"
HEADER = (
    "# The TRL runner's pinned stack (kiln_train/interop/pins.py): the closure of\n"
    f"# {' '.join(ROOTS)}\n"
    "# at the versions Kiln's interop tests ran on. Install into a fresh environment:\n"
    "#     pip install -r requirements.lock\n"
)


def public_version(version: str) -> str:
    return version.split("+", 1)[0]


def installed_closure(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """Canonical distribution name -> public version, for `roots` and everything they require."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        dist = metadata.distribution(name)
        found[name] = public_version(dist.version)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pending.append(req.name)
    return dict(sorted(found.items()))


def lock_text(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


if __name__ == "__main__":
    text = lock_text(installed_closure())
    if sys.argv[1:] == ["--write"]:
        LOCK_PATH.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
