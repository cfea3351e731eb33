"""The divergence guard's thresholds, torch-free so that export bundles can record them.

An epoch whose mean loss is both `DIVERGENCE_RATIO` times the first epoch's and
`DIVERGENCE_MARGIN` above the best epoch's fails the run (docs/training-profile.md).
"""

from __future__ import annotations

DIVERGENCE_RATIO = 8.0
DIVERGENCE_MARGIN = 5.0
