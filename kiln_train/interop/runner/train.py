#!/usr/bin/env python3
"""Kiln's pinned TRL runner: train one Kiln SFT export bundle with Hugging Face TRL.

Shipped in every `<name>.kiln-hf/` bundle next to `kiln_hf_export.json` (schema
`kiln.hf-trl-export.v1`). It keeps as much of Kiln's `native_online_lora_v1` profile as TRL
allows, and refuses to start when it could not:

1. every bundle file against the manifest's SHA-256, and the manifest against its bundle digest;
2. the installed versions of the enforced packages against requirements.lock;
3. the base model directory (--model): config.json and the base weight content against the
   identities the manifest records;
4. every step's row, rendered by transformers' apply_chat_template with the bundled training
   template and its assistant mask (the call TRL's SFTTrainer makes; a prompt/completion row's
   prompt is context; a raw-text row is tokenized as text and supervised from its completion;
   rows are cut to max_length when the run truncates), against Kiln's token ids and supervised
   token ranges in train.jsonl.

Then TRL's SFTTrainer trains the rows of train.jsonl in that order (sequential sampler, one
pass), one conversation per optimizer step (batch 1, no accumulation), constant learning rate,
no warmup, no clipping, assistant-only labels, PEFT LoRA loaded from initial_adapter/ (the
adapter Kiln starts from) with no dropout, and the exported optimizer (sgd or adam_w). A
non-finite loss, or an epoch whose mean loss trips Kiln's divergence guard, stops the run with no
adapter. The output directory gets adapter_config.json, adapter_model.safetensors,
step_losses.jsonl and kiln_hf_result.json (schema `kiln.hf-trl-result.v1`: the versions used,
this script's SHA-256, the export digest, the identities checked, the adapter file hashes).

    python train.py --model /path/to/base-model [--output-dir DIR] [--device cpu|cuda]
                    [--dtype float32|bfloat16] [--threads N] [--allow-version-drift]

Exit status: 0 trained; 2 bundle refused; 3 versions; 4 base model; 5 tokenization; 6 the run
stopped (non-finite loss or divergence); 7 the trainer would not follow the profile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

EXPORT_SCHEMA = "kiln.hf-trl-export.v1"
RESULT_SCHEMA = "kiln.hf-trl-result.v1"
MANIFEST = "kiln_hf_export.json"
RESULT = "kiln_hf_result.json"
LOSSES = "step_losses.jsonl"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BASE_MODEL_CONTENT = "kiln.base-model-content.v1"
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
TRL_OPTIM = {"sgd": "sgd", "adam_w": "adamw_torch"}


class Refusal(Exception):
    """The run cannot start or continue as the profile requires; `code` is the exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def existing_file_sha256(path: Path, code: int, missing: str) -> str:
    """The digest of the file at `path`; a refusal with exit status `code` when there is none."""
    if not path.is_file():
        raise Refusal(code, missing)
    return sha256_file(path)


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")  # noqa: UP017 (any Python 3)


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


# ----- checks 1-4: the bundle, versions, the base model, the rows -------------------------------


def verify_bundle(bundle: Path) -> dict:
    try:
        manifest = json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Refusal(2, f"{bundle / MANIFEST} is not readable JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != EXPORT_SCHEMA:
        raise Refusal(2, f"{MANIFEST}: schema is not {EXPORT_SCHEMA}")
    for rel, entry in sorted(manifest["files"].items()):
        got = existing_file_sha256(bundle / rel, 2, f"{rel} is missing from the bundle")
        if got != entry["sha256"]:
            raise Refusal(
                2, f"{rel} has sha256 {got}, but {MANIFEST} records {entry['sha256']}: the bundle was changed"
            )
    body = {k: v for k, v in manifest.items() if k != "bundle_digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    digest = "sha256:" + hashlib.sha256(canonical).hexdigest()
    if digest != manifest.get("bundle_digest"):
        raise Refusal(
            2, f"{MANIFEST}: bundle_digest {manifest.get('bundle_digest')} does not recompute ({digest})"
        )
    return manifest


def read_lock(path: Path) -> dict[str, str]:
    """`name==version` lines of requirements.lock (comments and blanks skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    pairs = (line.partition("==") for line in lines if line)
    return {name.strip().lower(): version.strip() for name, _, version in pairs}


def check_versions(manifest: dict, bundle: Path, allow_drift: bool) -> tuple[dict, list]:
    pins = read_lock(bundle / manifest["trl_runner"]["requirements"])
    versions = {"python": platform.python_version()}
    drift = []
    for name, pinned in sorted(pins.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        versions[name] = have
        if have is None or have.split("+", 1)[0] != pinned:
            drift.append({"package": name, "pinned": pinned, "installed": have})
    enforced = manifest["trl_runner"]["enforced_pins"]
    bad = [d for d in drift if d["package"] in enforced]
    if bad and not allow_drift:
        first = bad[0]
        raise Refusal(
            3,
            f"{first['package']} {first['installed']} is installed but the bundle pins {first['pinned']} "
            f"({len(bad)} enforced package(s) differ); pip install -r requirements.lock, or pass "
            "--allow-version-drift (recorded in the result)",
        )
    return versions, drift


def base_weights_digest(model_dir: Path) -> str:
    """`kiln.base-model-content.v1` over the model's *.safetensors shards (filenames excluded)."""
    shards = [
        path for path in sorted(model_dir.iterdir()) if path.suffix == ".safetensors" and path.is_file()
    ]
    pairs = sorted((bytes.fromhex(sha256_file(path)[7:]), path.stat().st_size) for path in shards)
    h = hashlib.sha256(BASE_MODEL_CONTENT.encode("ascii") + b"\0" + len(pairs).to_bytes(8, "little"))
    for digest, size in pairs:
        h.update(size.to_bytes(8, "little") + digest)
    return "sha256:" + h.hexdigest()


def check_model(model_dir: Path, manifest: dict) -> None:
    base = manifest["base_model"]
    config = model_dir / "config.json"
    got = existing_file_sha256(config, 4, f"{model_dir} has no config.json")
    if got != base["model_config_sha256"]:
        raise Refusal(
            4, f"{config} has sha256 {got}, the bundle was exported for {base['model_config_sha256']}"
        )
    weights = base_weights_digest(model_dir)
    if weights != base["base_weights_sha256"]:
        raise Refusal(
            4,
            f"the base weights in {model_dir} digest to {weights}, the bundle was exported for {base['base_weights_sha256']}",
        )


def load_steps(bundle: Path, manifest: dict) -> list[dict]:
    lines = (bundle / manifest["data"]["train_file"]).read_text(encoding="utf-8").splitlines()
    steps = [json.loads(line) for line in lines if line.strip()]
    total = manifest["schedule"]["total_steps"]
    if len(steps) != total or [s["step"] for s in steps] != list(range(1, total + 1)):
        raise Refusal(2, f"train.jsonl holds {len(steps)} step(s), the manifest {total}")
    return steps


def mask_ranges(mask: list[int]) -> list[list[int]]:
    ranges, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            ranges.append([start, i])
            start = None
    return ranges


def tokenize_step(tokenizer, template: str, s: dict) -> tuple[list[int], list[int]]:
    """One step's ids and supervision mask, derived with transformers from what the row is:
    a conversation (the training template's assistant mask; a prompt/completion row's prompt
    messages, `context_messages`, are context), or raw text (`text`: tokens from
    `completion_start` on). Cut to `max_length` when the run truncates rows."""
    if s.get("text") is not None:
        enc = tokenizer(s["text"], add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(start >= s["completion_start"]) for start, _end in enc["offset_mapping"]]
    else:
        kwargs = {"tools": s["tools"], "chat_template": template, "add_generation_prompt": False}
        out = tokenizer.apply_chat_template(
            s["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        context = s.get("context_messages")
        if context:
            prompt = tokenizer.apply_chat_template(
                s["messages"][:context], tokenize=True, return_dict=True, **kwargs
            )
            prompt_ids = list(prompt["input_ids"])
            if prompt_ids != ids[: len(prompt_ids)]:
                raise Refusal(
                    5,
                    f"step {s['step']} (row {s['row_index']}): the prompt rendered alone is not where the "
                    "rendered row begins, so its end cannot mark the completion",
                )
            mask = [0] * len(prompt_ids) + mask[len(prompt_ids) :]
    limit = s.get("max_length")
    if limit is not None:
        ids, mask = ids[:limit], mask[:limit]
    return ids, mask


def tokenize_steps(tokenizer, template: str, steps: list[dict]) -> tuple[list, list]:
    """Each step's ids and assistant mask from transformers (the call TRL's SFTTrainer makes),
    refused unless they are Kiln's token ids and supervised ranges."""
    by_row: dict[str, tuple[list[int], list[int]]] = {}
    for s in steps:
        key = s["row_sha256"]
        if key in by_row:
            continue
        got_ids, got_mask = tokenize_step(tokenizer, template, s)
        where = f"step {s['step']} (row {s['row_index']}, {key})"
        if got_ids != s["input_ids"]:
            first = next(
                (i for i, (a, b) in enumerate(zip(got_ids, s["input_ids"], strict=False)) if a != b),
                min(len(got_ids), len(s["input_ids"])),
            )
            raise Refusal(
                5,
                f"{where}: transformers tokenizes the row to {len(got_ids)} ids, Kiln to "
                f"{len(s['input_ids'])}; the first difference is at token {first}",
            )
        if mask_ranges(got_mask) != s["supervised_ranges"]:
            raise Refusal(
                5,
                f"{where}: the assistant mask covers tokens {mask_ranges(got_mask)}, Kiln supervises "
                f"{s['supervised_ranges']}",
            )
        by_row[key] = (got_ids, got_mask)
    return [by_row[s["row_sha256"]][0] for s in steps], [by_row[s["row_sha256"]][1] for s in steps]


# ----- training, its result and the command ---------------------------------------------------


def check_optimizer(optimizer, manifest: dict, lora_params: set) -> dict:
    """The optimizer TRL built must be the exported one on exactly the LoRA leaves."""
    spec = manifest["optimizer"]
    want_cls = {"sgd": "SGD", "adam_w": "AdamW"}[spec["kind"]]
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    if type(inner).__name__ != want_cls:
        raise Refusal(7, f"TRL built {type(inner).__name__}, the bundle needs torch.optim.{want_cls}")
    seen, groups = set(), []
    for group in inner.param_groups:
        seen.update(id(p) for p in group["params"])
        if group["lr"] != spec["learning_rate"]:
            raise Refusal(
                7, f"optimizer learning rate {group['lr']} is not the exported {spec['learning_rate']}"
            )
        if spec["kind"] == "sgd":
            extras = {k: group[k] for k in ("momentum", "dampening", "weight_decay", "nesterov")}
            if any(extras.values()):
                raise Refusal(7, f"SGD with {extras}: the profile's SGD has none of them")
        else:
            betas = (spec["beta1"], spec["beta2"])
            want = {"betas": betas, "eps": spec["eps"], "weight_decay": spec["weight_decay"]}
            got = {"betas": tuple(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"]}
            if group["params"] and got != want:
                raise Refusal(7, f"AdamW group {got} differs from the exported {want}")
        groups.append(
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        )
    if seen != lora_params:
        raise Refusal(
            7, f"the optimizer holds {len(seen)} parameter(s), the LoRA leaves are {len(lora_params)}"
        )
    return {"class": f"torch.optim.{want_cls}", "param_groups": groups}


def load_model(args, manifest: dict, bundle: Path):
    """The base model with the bundle's initial adapter (trainable); refused unless the trainable
    parameters are exactly the adapter's LoRA leaves. Returns (model, ids of those leaves)."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    initial = bundle / manifest["lora"]["initial_adapter"]["dir"]
    model = PeftModel.from_pretrained(model, initial, is_trainable=True, autocast_adapter_dtype=False)
    # The adapter's tensor names as PEFT names the parameters it loaded (its `default` adapter).
    with safe_open(str(initial / "adapter_model.safetensors"), framework="pt") as f:
        want = {re.sub(r"\.lora_([AB])\.weight", r".lora_\1.default.weight", k) for k in f.keys()}  # noqa: SIM118
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if trainable != want:
        extra, missing = sorted(trainable - want), sorted(want - trainable)
        raise Refusal(
            7,
            f"the trainable parameters are not exactly the LoRA leaves: {len(extra)} more (first "
            f"{extra[:1]}), {len(missing)} missing (first {missing[:1]})",
        )
    return model, {id(p) for p in model.parameters() if p.requires_grad}


class StepLog:
    """Each step's loss, written to step_losses.jsonl as it comes, and the stops Kiln's trainer
    makes: a non-finite loss, or an epoch whose mean trips the divergence guard."""

    def __init__(self, path: Path, steps: list[dict], manifest: dict) -> None:
        self.steps, self.rows = steps, manifest["schedule"]["rows_kept"]
        self.guard = manifest["schedule"]["divergence_guard"]
        self.losses: list[float] = []
        self.epoch_means: list[float] = []
        self.file = path.open("w", encoding="utf-8")

    def record(self, value: float) -> None:
        step = self.steps[len(self.losses)]
        self.losses.append(value)
        entry = {k: step[k] for k in ("step", "epoch", "row_index", "row_sha256")}
        entry.update(loss=value, tokens=step["tokens"], supervised_tokens=step["supervised_tokens"])
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        if not math.isfinite(value):
            raise Refusal(
                6, f"step {step['step']}: the loss is {value} (Kiln fails such a run with nan_loss)"
            )
        if step["position"] == self.rows - 1:
            self.end_epoch(step)
        print(f"step {step['step']}/{len(self.steps)} epoch {step['epoch'] + 1} loss {value:.6f}", flush=True)

    def end_epoch(self, step: dict) -> None:
        mean = sum(self.losses[-self.rows :]) / self.rows
        first = self.epoch_means[0] if self.epoch_means else None
        best = min(self.epoch_means) if self.epoch_means else None
        self.epoch_means.append(mean)
        ratio, margin = self.guard["ratio"], self.guard["margin"]
        if first is not None and mean > first * ratio and mean - best > margin:
            raise Refusal(
                6,
                f"divergence guard: epoch {step['epoch'] + 1} mean loss {mean:.4f} exceeds "
                f"{ratio:g}x the first epoch's {first:.4f} and the best epoch {best:.4f} by more than {margin:g}",
            )


# The SFTConfig settings that hold TRL to the profile: one conversation per step in the bundle's
# order, one pass, constant learning rate, no clipping, packing, checkpoints or logging.
PROFILE_SETTINGS = {
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 1,
    "max_steps": -1,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "max_grad_norm": 0.0,
    "train_sampling_strategy": "sequential",
    "max_length": None,
    "packing": False,
    "padding_free": False,
    "shuffle_dataset": False,
    "gradient_checkpointing": False,
    "bf16": False,
    "fp16": False,
    "save_strategy": "no",
    "eval_strategy": "no",
    "logging_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
    "dataloader_pin_memory": False,
}


def train(
    args, manifest: dict, bundle: Path, tokenizer, steps: list[dict], ids: list, masks: list, out: Path
):
    """TRL's SFTTrainer over the steps; returns (step log, optimizer record, run facts)."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, lora_params = load_model(args, manifest, bundle)
    log = StepLog(out / LOSSES, steps, manifest)

    class KilnProfileTrainer(SFTTrainer):
        """SFTTrainer that records each step's loss and stops where Kiln's trainer would."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            log.record(float((result[0] if return_outputs else result).detach().float().item()))
            return result

    opt = manifest["optimizer"]
    config = SFTConfig(
        output_dir=str(out),
        learning_rate=opt["learning_rate"],
        optim=TRL_OPTIM[opt["kind"]],
        weight_decay=opt.get("weight_decay", 0.0),
        adam_beta1=opt.get("beta1", 0.9),
        adam_beta2=opt.get("beta2", 0.999),
        adam_epsilon=opt.get("eps", 1e-8),
        use_cpu=args.device == "cpu",
        seed=int(manifest["seed"]) % 2**32,
        **PROFILE_SETTINGS,
    )
    dataset = Dataset.from_dict({"input_ids": ids, "assistant_masks": masks})
    trainer = KilnProfileTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    optimizer = check_optimizer(trainer.create_optimizer(), manifest, lora_params)
    try:
        trainer.train()
    finally:
        log.file.close()
    if len(log.losses) != len(steps):
        raise Refusal(7, f"TRL ran {len(log.losses)} step(s), the bundle has {len(steps)}")
    model.save_pretrained(str(out))
    run = {
        "device": str(torch.device(trainer.args.device)),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    return log, optimizer, {**run, "steps": len(log.losses), "epochs": manifest["schedule"]["epochs"]}


def result_record(manifest: dict, versions: tuple, log: StepLog, optimizer: dict, run: dict, out: Path):
    """`kiln_hf_result.json` of a finished run (schema `kiln.hf-trl-result.v1`)."""
    script = Path(__file__).resolve()
    return {
        "schema": RESULT_SCHEMA,
        "status": "success",
        "export": {"name": manifest["name"], "bundle_digest": manifest["bundle_digest"]},
        "script": {"file": script.name, "sha256": sha256_file(script)},
        "versions": versions[0],
        "version_drift": versions[1],
        "base_model": {k: manifest["base_model"][k] for k in ("model_config_sha256", "base_weights_sha256")},
        "tokenizer": {"tokenizer_vocab_sha256": manifest["tokenizer"]["tokenizer_vocab_sha256"]},
        "template": {"training_chat_template_sha256": manifest["template"]["training_chat_template_sha256"]},
        "lora": {k: manifest["lora"][k] for k in ("rank", "alpha", "target_modules")},
        "optimizer": {**manifest["optimizer"], **optimizer},
        "run": run,
        "losses": {
            "file": LOSSES,
            "sha256": sha256_file(out / LOSSES),
            "final_loss": log.losses[-1],
            "epoch_mean_losses": log.epoch_means,
        },
        "adapter": {name: sha256_file(out / name) for name in ADAPTER_FILES},
        "profile_fidelity": manifest["profile_fidelity"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a Kiln SFT export bundle with the pinned TRL stack.")
    add = parser.add_argument
    add("--model", required=True, help="the base model directory (config.json, *.safetensors)")
    add("--bundle", default=str(Path(__file__).resolve().parent), help="the bundle (default: here)")
    add("--output-dir", default=None, help="where the adapter goes (default: BUNDLE/trl-output)")
    add("--device", choices=("cpu", "cuda"), default=None)
    add("--dtype", choices=("float32", "bfloat16"), default=None, help="default: the manifest's")
    add("--threads", type=int, default=None, help="torch intra-op threads")
    add("--allow-version-drift", action="store_true")
    args = parser.parse_args(argv)
    started, t0 = now(), time.perf_counter()
    bundle = Path(args.bundle).resolve()
    out = Path(args.output_dir).resolve() if args.output_dir else bundle / "trl-output"
    try:
        manifest = verify_bundle(bundle)
        versions = check_versions(manifest, bundle, args.allow_version_drift)
        model_dir = Path(args.model).resolve()
        check_model(model_dir, manifest)
        args.model = str(model_dir)
        args.dtype = args.dtype or manifest["trl_runner"]["dtype"]
        steps = load_steps(bundle, manifest)
        if out.exists() and any(out.iterdir()):
            raise Refusal(2, f"{out} is not empty; results are never overwritten")
        out.mkdir(parents=True, exist_ok=True)
        import torch
        from transformers import PreTrainedTokenizerFast

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.device is None:
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(bundle / manifest["tokenizer"]["file"]))
        tokenizer.pad_token, tokenizer.eos_token = PAD_TOKEN, EOS_TOKEN
        template = (bundle / manifest["template"]["file"]).read_text(encoding="utf-8")
        ids, masks = tokenize_steps(tokenizer, template, steps)
        log, optimizer, run = train(args, manifest, bundle, tokenizer, steps, ids, masks, out)
    except Refusal as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        if out.is_dir() and exc.code >= 5:  # the run began: say why it has no adapter
            failed = {"schema": RESULT_SCHEMA, "status": "failed", "exit_status": exc.code}
            write_json(out / RESULT, {**failed, "message": str(exc)})
        return exc.code
    run.update(started_at=started, finished_at=now(), wall_clock_s=round(time.perf_counter() - t0, 3))
    write_json(out / RESULT, result_record(manifest, versions, log, optimizer, run, out))
    losses = log.losses
    summary = {"status": "success", "output_dir": str(out), "final_loss": losses[-1], "steps": len(losses)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
