"""Where the SFT oracle fixtures live, their schema names, and the seeds and sizes that make them."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "qualification" / "fixtures"

# The commands every fixture header records (the entry script keeps this path).
REGENERATE = ".venv/bin/python qualification/sft_template_oracle.py --write"
CHECK = ".venv/bin/python qualification/sft_template_oracle.py --check"

# The first fixture: named cases with full labels, plus a small random differential set.
FIXTURE = FIXTURES / "qwen35_sft_oracle_v1.json"
FIXTURE_SCHEMA = "kiln.qwen35-sft-oracle.v1"
RANDOM_SEED = 20260502
RANDOM_ROWS = 40
CHECK_SEED = 7
CHECK_ROWS = 500

# The conversations fixture: seeded `conversation_rows` plus named edge rows.
CONVERSATIONS_FIXTURE = FIXTURES / "qwen35_sft_conversations_v1.json"
CONVERSATIONS_SCHEMA = "kiln.qwen35-sft-conversations.v1"
CONVERSATIONS_SEED = 20260517
CONVERSATIONS_ROWS = 300
CONVERSATIONS_CHECK_SEED = 99
CONVERSATIONS_CHECK_ROWS = 1000

# The corner-case fixture: named corner rows, seeded `probe2_rows` and edge rows.
PROBE2_FIXTURE = FIXTURES / "qwen35_sft_probe2_v1.json"
PROBE2_SCHEMA = "kiln.qwen35-sft-probe2.v1"
PROBE2_SEED = 20260602
PROBE2_ROWS = 200
PROBE2_CHECK_SEED = 5
PROBE2_CHECK_ROWS = 1000
