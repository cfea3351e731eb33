"""Choosing and reading a run's row source (kiln_train/data/row_source.py): the one place that
decides between inline `examples` and a `dataset_path`, for the service and the library alike."""

from __future__ import annotations

import json

import pytest

from kiln_train.data.ingestion import ingest_examples, ingest_jsonl
from kiln_train.data.row_source import DATASET_PATH, EXAMPLES, RowSource, row_source
from kiln_train.errors import KilnError
from tests.kiln_train.data.ingestion_support import PLAIN

BAD = {"messages": [{"role": "user", "content": "no answer"}]}


@pytest.fixture
def datasets(tmp_path):
    root = tmp_path / "datasets"
    root.mkdir()
    (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in (PLAIN, BAD, PLAIN)) + "\n")
    return root


def test_examples_are_read_as_inline_rows(qwen_tokenizer):
    source = row_source(examples=[PLAIN, BAD])
    assert source == RowSource(examples=[PLAIN, BAD]) and source.data_source == EXAMPLES
    got = source.ingest(tokenizer=qwen_tokenizer, policy="skip")
    want = ingest_examples([PLAIN, BAD], tokenizer=qwen_tokenizer, policy="skip")
    assert got.receipt == want.receipt and got.receipt["source"] == "inline"
    assert (got.receipt["rows_kept"], got.receipt["rows_rejected"]) == (1, 1)


def test_a_dataset_path_resolves_inside_the_root_and_the_receipt_names_it_as_given(qwen_tokenizer, datasets):
    source = row_source(dataset_path="chat.jsonl", datasets_root=datasets)
    assert source.path == (datasets / "chat.jsonl").resolve() and source.data_source == DATASET_PATH
    got = source.ingest(tokenizer=qwen_tokenizer, policy="skip")
    want = ingest_jsonl(source.path, tokenizer=qwen_tokenizer, policy="skip", source_locator="chat.jsonl")
    assert got.receipt == want.receipt
    assert (got.receipt["source"], got.receipt["source_locator"]) == ("dataset_path", "chat.jsonl")
    assert got.receipt["rows_kept"] == 2


def test_without_a_root_a_dataset_path_is_any_file_named_by_its_path(qwen_tokenizer, datasets):
    path = datasets / "chat.jsonl"
    got = row_source(dataset_path=path).ingest(tokenizer=qwen_tokenizer, policy="skip")
    assert got.receipt["source_locator"] == str(path) and got.receipt["rows_kept"] == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of examples or dataset_path is required"),
        (
            {"examples": [PLAIN], "dataset_path": "chat.jsonl"},
            "exactly one of examples or dataset_path is required",
        ),
        ({"dataset_path": "../chat.jsonl"}, "must not contain '..' segments"),
        ({"dataset_path": "/etc/passwd"}, "outside the server's datasets directory"),
    ],
)
def test_a_bad_choice_is_a_400_naming_the_problem(kwargs, message, datasets):
    with pytest.raises(KilnError, match=message) as caught:
        row_source(**kwargs, datasets_root=datasets)
    assert caught.value.code == "training_invalid_request"
