"""Where a run's training rows come from: inline `examples` or one JSONL file.

Every path that ingests a run's rows (the service's admission, the worker's re-ingestion, the
library's `finetune`, the HF export) chooses the source with `row_source` and reads it with
`RowSource.ingest`, so "examples or dataset_path?" is decided once. Held-out validation rows have
their own reader (`validation.py`). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln_train.data.chat_template import ChatTemplate
from kiln_train.data.ingestion import IngestionResult, LengthRule, ingest_examples, ingest_jsonl
from kiln_train.data.ingestion_sources import resolve_dataset_path
from kiln_train.errors import invalid_request

# `data_source` of an admission (the job store's column values).
EXAMPLES = "examples"
DATASET_PATH = "dataset_path"


@dataclass(frozen=True)
class RowSource:
    """Inline `examples`, or the JSONL file at `path` that the receipt names `locator` (the
    request's `dataset_path`; None: the path itself)."""

    examples: list | None = None
    path: Path | None = None
    locator: str | None = None

    @property
    def data_source(self) -> str:
        """`examples` or `dataset_path`."""
        return EXAMPLES if self.examples is not None else DATASET_PATH

    def ingest(
        self,
        *,
        tokenizer,
        policy: str,
        template: ChatTemplate | None = None,
        limit: LengthRule | None = None,
    ) -> IngestionResult:
        """The source's rows, ingested with `tokenizer`, `template`, the invalid-row `policy` and
        the length rule `limit` (`max_length`/`truncation`; None: no limit)."""
        if self.examples is not None:
            return ingest_examples(
                list(self.examples), tokenizer=tokenizer, template=template, policy=policy, limit=limit
            )
        assert self.path is not None
        return ingest_jsonl(
            self.path,
            tokenizer=tokenizer,
            template=template,
            policy=policy,
            source=DATASET_PATH,
            source_locator=self.locator,
            limit=limit,
        )


def row_source(
    *, examples: list | None = None, dataset_path: str | Path | None = None, datasets_root: Path | None = None
) -> RowSource:
    """The one source given: `examples`, or `dataset_path`, which must lie inside `datasets_root`
    when there is one (a server's datasets directory) and is any file path otherwise (the library).
    400 when neither or both are given, or for a `dataset_path` outside the root."""
    if (examples is None) == (dataset_path is None):
        raise invalid_request("exactly one of examples or dataset_path is required")
    if examples is not None:
        return RowSource(examples=examples)
    if datasets_root is None:
        return RowSource(path=Path(dataset_path))
    return RowSource(path=resolve_dataset_path(str(dataset_path), datasets_root), locator=str(dataset_path))
