"""The native SFT run: the trainer and its loop, resume checks, results, the loss routes, the
gradient anomaly scan and the adapter canaries (docs/training-profile.md).

Read `trainer.py` first: `train_sft(TrainRequest)` (`request.py`) resolves the run, drives an
`SftRun` (`run.py`: set-up, the loop, checkpoints) and ends in a `TrainResult` (`result.py`),
publishing the adapter or the failed receipt (`publication.py`). Around the run: `resident.py`
(the loaded base model and what identifies it), `resume_state.py` (what a resumed run reads from
its checkpoint and adopts), `invariants.py` (the re-check of what admission enforced),
`identity.py` (the identity a checkpoint binds and a receipt records), `grad_norms.py`,
`scope.py`, `loss.py`, `anomaly.py`, `canary.py` (the adapter smoke test), `evaluation.py`
(held-out validation loss and token accuracy, docs/validation.md) and `warmup.py` (the worker's first step).
"""
