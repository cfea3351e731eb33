"""Print Kiln's requirements from pyproject.toml, one a line: its dependencies and those of the
extras named (`python requirements.py train,gpu`).

The api image installs these in a layer of its own before Kiln's code is copied in, so a change
to the code rebuilds one small layer instead of downloading every dependency again
(docs/deployment.md#images). Runs on the image's bare Python: standard library only.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The project's dependencies, then each named extra's, in pyproject.toml's order."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"unknown extra {', '.join(unknown)}: pyproject.toml declares {', '.join(optional)}")
    out = list(project.get("dependencies", []))
    for extra in extras:
        out += [req for req in optional[extra] if req not in out]
    return out


def main(argv: list[str]) -> None:
    extras = [e.strip() for e in argv[0].split(",") if e.strip()] if argv else []
    pyproject = Path.cwd() / "pyproject.toml"
    print("\n".join(requirements(pyproject, extras)))


if __name__ == "__main__":
    main(sys.argv[1:])
