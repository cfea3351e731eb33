"""The names a run will write, checked before it starts: the output and base adapter names, the
longest path derived from the output name, and exact checkpoints a run would have to publish
again. The service's admission and the library's `finetune` run the same checks. Torch-free.
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln_train.artifacts.adapter import ADAPTER_NAME_RE
from kiln_train.checkpoint.manifest import CHECKPOINT_SUFFIX, checkpoint_dir_name
from kiln_train.checkpoint.publish import staging_dir_name
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError, invalid_request
from kiln_train.sft_config import SftConfig

NAME_MAX_BYTES = 255  # one path segment (Linux NAME_MAX)
CHECKPOINT_NAME_MARK = "-checkpoint-step-"


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter directory the trainer will write, or None."""
    if not ADAPTER_NAME_RE.fullmatch(name):
        return (
            "must be one path segment of [A-Za-z0-9._-] starting with a letter or digit (at most 255 bytes)"
        )
    if name.endswith(CHECKPOINT_SUFFIX) or CHECKPOINT_NAME_MARK in name:
        return f"must not look like an exact checkpoint (contain {CHECKPOINT_NAME_MARK!r} or end {CHECKPOINT_SUFFIX!r})"
    return None


def check_request_names(config: SftConfig) -> None:
    """Names the trainer would refuse only once the run starts are refused now (400)."""
    for field in ("output_name", "base_adapter"):
        name = getattr(config, field)
        if name is None:
            continue
        problem = adapter_name_problem(name)
        if problem is not None:
            raise invalid_request(f"config.{field} {name!r} {problem}")


def check_output_name_fits(name: str, total_steps: int) -> None:
    """Every name derived from the adapter's must fit one path segment: the longest is the hidden
    staging directory of its last checkpoint (docs/checkpoints.md#publication)."""
    longest = staging_dir_name(checkpoint_dir_name(name, max(total_steps, 1)))
    if len(longest.encode("utf-8")) > NAME_MAX_BYTES:
        overhead = len(longest) - len(name)
        raise invalid_request(
            f"config.output_name is {len(name)} bytes; with {total_steps} step(s) its checkpoint staging "
            f"directories need {overhead} more bytes and a path segment holds {NAME_MAX_BYTES}: use at "
            f"most {NAME_MAX_BYTES - overhead} bytes"
        )


def checkpoint_steps(adapters_dir: Path, name: str) -> dict[int, str]:
    """The adapter's exact checkpoint directories in the registry, by global step."""
    pattern = re.compile(rf"{re.escape(name)}-checkpoint-step-([0-9]{{8,}}){re.escape(CHECKPOINT_SUFFIX)}")
    found: dict[int, str] = {}
    if adapters_dir.is_dir():
        for entry in adapters_dir.iterdir():
            match = pattern.fullmatch(entry.name)
            if match is not None:
                found[int(match.group(1))] = entry.name
    return found


def check_no_later_checkpoints(adapters_dir: Path, name: str, start: int, *, resumed: bool) -> None:
    """A run publishes `<name>-checkpoint-step-N` for steps past its start and never overwrites
    one: a directory an earlier run left at such a step would fail this run half way through
    (409 `adapter_already_exists`). `start` is the resume point's step (0 for a new run)."""
    steps = checkpoint_steps(adapters_dir, name)
    later = sorted(step for step in steps if step > start)
    if later:
        existing = steps[later[0]]
        where = f"after the resume point (step {start})" if resumed else "from an earlier run"
        raise KilnError(
            ADAPTER_ALREADY_EXISTS,
            f"exact checkpoint {existing!r} of adapter {name!r} exists {where}; this run would have to "
            "publish that name again. Resume from the newest checkpoint with config.resume_checkpoint "
            "or choose another output_name",
        )
