"""The Transformers + TRL oracle behind Kiln's three SFT rendering fixtures, as a package.

Run it through `qualification/sft_template_oracle.py` (`--write` / `--check`). The modules:

- `constants`: fixture paths, schema names, seeds and row counts, the recorded commands.
- `named_cases`, `random_rows`: the first fixture's hand-written cases and random rows.
- `conversations`, `conversation_edges`: the conversations fixture's generator and edge rows.
- `probe2`, `probe2_cases`: the corner-case fixture's generator, named rows and edge rows.
- `stack`: one row through the oracle and through Kiln, and their comparison.
- `fixtures`: building each fixture and writing it; `checks`: `--check`; `cli`: the command line.

The generators and case tables need neither Transformers nor TRL (nor Kiln): the tests import
them from here to prove that a fixture's rows are the documented generator's.
"""

from __future__ import annotations

from .conversation_edges import conversation_edges
from .conversations import conversation_rows
from .named_cases import named_cases
from .probe2 import probe2_rows
from .probe2_cases import probe2_edges, probe2_named, probe2_tools_rows
from .random_rows import random_rows

__all__ = [
    "conversation_edges",
    "conversation_rows",
    "named_cases",
    "probe2_edges",
    "probe2_named",
    "probe2_rows",
    "probe2_tools_rows",
    "random_rows",
]
