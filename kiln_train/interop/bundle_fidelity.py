"""The export manifest's `profile_fidelity` table (docs/interop.md#export).

How closely `train.py` follows `native_online_lora_v1`, aspect by aspect. Each cell is a template
filled from the run's facts (the optimizer, the resident runner's dtypes and loss route).
"""

from __future__ import annotations

from kiln_train.checkpoint.epoch_order import EPOCH_ORDER_ALGORITHM
from kiln_train.data.labels import MASK_CONTRACT
from kiln_train.interop.lora_init import LORA_INIT_ALGORITHM
from kiln_train.sft_config import SftConfig
from kiln_train.train.guards import DIVERGENCE_MARGIN, DIVERGENCE_RATIO

# optimizer kind -> (Kiln, the runner, agreement); AdamW's agreement is that of the precision.
_OPTIMIZERS = {
    "sgd": (
        "sgd: p <- p - lr * g on every LoRA leaf",
        "optim=sgd: torch.optim.SGD (no momentum, dampening or weight decay)",
        "exact",
    ),
    "adam_w": (
        "adam_w: the single-tensor torch.optim.AdamW update (decoupled decay, bias correction)",
        "optim=adamw_torch: torch.optim.AdamW with the exported betas, eps and weight decay on every "
        "LoRA leaf (on CUDA torch may pick its foreach kernels: same math, other rounding)",
        "{precision}",
    ),
}
# f32 base weights and LoRA leaves -> (the runner, agreement) of the precision aspect.
_PRECISIONS = {
    True: ("float32 model and LoRA leaves (the default --dtype this manifest names)", "exact"),
    False: (
        "bfloat16 model and LoRA leaves (autocast_adapter_dtype off); torch's eager optimizer "
        "rounds after every operation where Kiln rounds once",
        "rounding",
    ),
}
# (aspect, Kiln, the runner, agreement), in manifest order; `{name}` cells come from `_facts`.
_ASPECTS = (
    (
        "rows",
        "one admitted conversation per optimizer step; nothing truncated, packed, split or dropped",
        "pre-tokenized rows, batch size 1, packing off, padding-free off, max_length None",
        "exact",
    ),
    (
        "order",
        "epochs x rows steps; each epoch in the order {order_algorithm} draws from the seed",
        "train.jsonl lists every step in that order; sequential sampler, one pass (num_train_epochs 1)",
        "exact",
    ),
    (
        "tokens_and_labels",
        "Kiln's training template and assistant-only labels ({mask_contract})",
        "transformers apply_chat_template with the bundled template and return_assistant_tokens_mask "
        "(the call TRL's SFTTrainer makes); TRL builds the labels from the masks; train.py refuses to "
        "train when any row's token ids or supervised positions differ from Kiln's",
        "exact",
    ),
    (
        "initial_adapter",
        "{lora_init} from the seed, or the base adapter's tensors",
        "PEFT loads initial_adapter/ (trainable), no re-initialisation",
        "exact",
    ),
    (
        "lora",
        "r and alpha on the ten targets, scale alpha/r, no dropout, no bias, nothing else trainable",
        "PEFT LoRA with the same r, alpha and targets, lora_dropout 0, bias none; train.py checks the "
        "trainable parameters are exactly the LoRA leaves",
        "exact",
    ),
    (
        "loss",
        "mean next-token cross-entropy over the supervised targets, f32 accumulation, chunked linear "
        "cross-entropy ({loss_route})",
        "transformers' causal LM loss on dense logits: summed over supervised targets, divided by "
        "their count (num_items_in_batch)",
        "rounding",
    ),
    (
        "model",
        "Kiln's Qwen3.5 implementation",
        "transformers Qwen3_5ForCausalLM (its torch gated delta rule and causal conv on CPU)",
        "rounding",
    ),
    ("optimizer", "{optimizer_kiln}", "{optimizer_runner}", "{optimizer_agreement}"),
    ("learning_rate", "constant, no warmup or schedule", "lr_scheduler_type constant, warmup 0", "exact"),
    ("gradient_clipping", "none", "max_grad_norm 0 (off)", "exact"),
    ("gradient_accumulation", "none", "gradient_accumulation_steps 1", "exact"),
    (
        "precision",
        "base weights {base_weight_dtype}, LoRA leaves {lora_dtype}",
        "{precision_runner}",
        "{precision_agreement}",
    ),
    ("gradient_checkpointing", "segment recomputation (values unchanged)", "off (values unchanged)", "exact"),
    (
        "non_finite_loss",
        "a non-finite loss fails the run (nan_loss); no adapter",
        "train.py stops at the first non-finite loss and writes no adapter",
        "exact",
    ),
    (
        "divergence_guard",
        "an epoch mean loss above {ratio:g}x the first epoch's and {margin:g} above the best epoch's fails "
        "the run",
        "train.py applies the same rule at each epoch end and stops without an adapter",
        "exact",
    ),
    (
        "checkpoints",
        "exact checkpoints (optimizer state, cursor, RNG) that resume bit for bit",
        "none (save_strategy no); an interrupted TRL run starts again from step 0",
        "differs",
    ),
    (
        "epoch_accounting",
        "epoch i covers steps i*rows+1 .. (i+1)*rows",
        "TRL counts one epoch over all steps; train.py records each step's Kiln epoch",
        "differs",
    ),
)


def _facts(config: SftConfig, resident) -> dict:
    """The values the `{name}` cells of `_ASPECTS` stand for."""
    f32 = resident.base_weight_dtype == "f32" and resident.lora_dtype == "f32"
    precision_runner, precision = _PRECISIONS[f32]
    optimizer_kiln, optimizer_runner, optimizer_agreement = _OPTIMIZERS[config.optimizer.kind]
    return {
        "order_algorithm": EPOCH_ORDER_ALGORITHM,
        "mask_contract": MASK_CONTRACT,
        "lora_init": LORA_INIT_ALGORITHM,
        "loss_route": resident.loss_route,
        "ratio": DIVERGENCE_RATIO,
        "margin": DIVERGENCE_MARGIN,
        "base_weight_dtype": resident.base_weight_dtype,
        "lora_dtype": resident.lora_dtype,
        "optimizer_kiln": optimizer_kiln,
        "optimizer_runner": optimizer_runner,
        "optimizer_agreement": optimizer_agreement.format(precision=precision),
        "precision_runner": precision_runner,
        "precision_agreement": precision,
    }


def profile_fidelity(config: SftConfig, resident) -> list[dict]:
    """How closely `train.py` follows `native_online_lora_v1`, aspect by aspect.

    `agreement`: `exact` (the same operations on the same values), `rounding` (the same math,
    different floating-point rounding: Kiln's kernels against transformers'), `differs` (the runner
    does something else; the note says what). `resident` is the `bundle.ResidentFacts` exported.
    """
    facts = _facts(config, resident)
    return [
        {
            "aspect": aspect,
            "kiln": kiln.format(**facts),
            "trl_runner": runner.format(**facts),
            "agreement": agreement.format(**facts),
        }
        for aspect, kiln, runner, agreement in _ASPECTS
    ]
