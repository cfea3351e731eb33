"""Hugging Face / TRL interoperability: SFT export bundles, the pinned TRL runner, PEFT import.

Kiln trains one profile (`native_online_lora_v1`). Runs that need what the profile leaves out go
to Hugging Face TRL; this package keeps Kiln's row, template and artifact-identity guarantees on
that trip (docs/interop.md):

- `bundle`: an export bundle `<name>.kiln-hf/`: the admitted rows in Kiln's step order with their
  hashes and token digests, the ingestion receipt, the tokenizer, the model config, the training
  chat template (with `{% generation %}` blocks), the initial adapter Kiln would start from, the
  TRL runner `train.py` and its `requirements.lock`, and the manifest `kiln_hf_export.json`
  (schema `kiln.hf-trl-export.v1`) that hashes every file; `bundle_rows` writes `train.jsonl`,
  `bundle_fidelity` the manifest's `profile_fidelity` table.
- `runner/train.py`: the pinned TRL runner shipped in every bundle (package data).
- `peft_import`: the checks a PEFT LoRA adapter passes before Kiln registers it (`peft_upload`,
  `peft_config`, `peft_tensors`, `peft_run`), and its publication with an import receipt.
- `lora_init`, `safetensors_io`: torch-free pieces both need (the seeded LoRA initialisation,
  reproduced bit for bit; reading and writing safetensors files without torch).

Torch-free: the api imports all of it.
"""
