"""The progress line of a waiting `kiln train sft`: redrawn on a terminal, logged when it moves
otherwise."""

from __future__ import annotations

from kiln_cli import client_view
from kiln_cli.client_view import ProgressLine


def test_progress_line_redraws_on_a_terminal_and_logs_moves_otherwise(capsys, monkeypatch):
    status = {
        "state": "running",
        "global_step": 3,
        "total_steps": 8,
        "current_loss": 1.23456,
        "elapsed_secs": 61.0,
    }
    live = ProgressLine(rows_kept=4, live=True)
    live.show({"state": "queued", "queue_position": 2})
    live.show(status)
    live.finish()
    err = capsys.readouterr().err
    first, second = err.split("\r")[1:]
    assert first.startswith("queued (position 2), waiting 0:0")
    assert second == "[#########---------------] step 3/8  epoch 1/2  loss 1.2346  1:01\n"  # finish() ends it

    clock = iter([0.0, 0.0, 1.0, 2.0, 7.0, 8.0])
    monkeypatch.setattr(client_view.time, "monotonic", lambda: next(clock))
    log = ProgressLine(rows_kept=4, live=False)
    log.show(status)  # t=0: first line
    log.show({**status, "elapsed_secs": 62.0})  # t=1: only the clock moved
    log.show({**status, "global_step": 4})  # t=2: moved, but within 5 s of the last line
    log.show({**status, "global_step": 5, "elapsed_secs": 70.0})  # t=7: moved, printed
    log.show({**status, "state": "completed", "global_step": 8})  # t=8: a new state is always printed
    assert capsys.readouterr().err.splitlines() == [
        "[#########---------------] step 3/8  epoch 1/2  loss 1.2346  1:01",
        "[###############---------] step 5/8  epoch 2/2  loss 1.2346  1:10",
        "[########################] step 8/8  epoch 2/2  loss 1.2346  1:01  completed",
    ]
