"""`TrainRequest`: everything one call of `train_sft` needs, in one frozen object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln_train.artifacts.fencing import Fence
    from kiln_train.data.ingestion import IngestionResult
    from kiln_train.data.validation import ValidationSet
    from kiln_train.sft_config import SftConfig
    from kiln_train.train.evaluation import Evaluation
    from kiln_train.train.resident import ResidentModel
    from kiln_train.train.result import StepReport


@dataclass(frozen=True)
class TrainRequest:
    """One SFT run: the model, the rows, the config, where to publish, and how to report.

    Only the first five fields are required; a library run usually sets those and perhaps
    `adapter_name` and `progress`. The service also passes the fields it pinned at admission
    (`checkpoint_plan`, `resume_checkpoint`, `run_id`) and its callbacks and `fence`.
    """

    resident: ResidentModel
    """The loaded model, tokenizer and backend the run trains on (`load_resident`)."""
    config: SftConfig
    """The effective config (`SftConfig.resolve()`: learning rate and seed resolved)."""
    ingestion: IngestionResult
    """The admitted rows and their ingestion receipt (`ingest_examples` / `ingest_jsonl`)."""
    loss_route: str
    """The SFT loss route pinned at admission; it must equal the resident backend's."""
    output_root: str | Path
    """The adapter registry: the adapter, its checkpoints and failed receipts are written here."""
    adapter_name: str | None = None
    """The adapter's name; None takes `config.output_name`, else `sft-<run id prefix>`."""
    progress: Callable[[StepReport], None] | None = None
    """Called after every optimizer step (before that step's checkpoint is published)."""
    should_stop: Callable[[], bool] | None = None
    """Polled after every step; True stops the run cooperatively at a checkpoint (`cancelled`)."""
    checkpoint_plan: dict | None = None
    """The pinned gradient checkpoint plan `{max_segments, auto, budget_bytes}`; None: the
    config's fixed plan, or for a resume the plan its checkpoint recorded."""
    resume_checkpoint: str | Path | None = None
    """A `.kiln-checkpoint` directory to continue; every identity it binds must match this run."""
    on_checkpoint: Callable[[dict], None] | None = None
    """Called with each published checkpoint's record."""
    run_id: str | None = None
    """This attempt's id (failed receipts are named after it); None draws a new one."""
    fence: Fence | None = None
    """A service run's publication fence (`kiln_train.artifacts.fencing`); None for a library run."""
    validation: ValidationSet | None = None
    """Held-out rows to evaluate (`kiln_train.data.validation.prepare_validation`): before the first
    update, at every epoch's end and every `interval_steps` steps. Never changes what is trained."""
    on_evaluation: Callable[[Evaluation], None] | None = None
    """Called with each validation evaluation (before that step's checkpoint is published)."""
    requested_config: dict | None = None
    """The request's `config` as sent (the fields the caller set), recorded in the receipt as
    `requested_config` beside the effective `config`; None: not known, not recorded."""
    attempts: dict | None = None
    """The service's delivery record of this run: `{"attempt": n, "earlier": [...]}`, the progress
    record of each earlier attempt a worker lost; written to the receipt as `attempts`."""
