"""Error codes of the HF/TRL interop routes, beside the contract's (kiln_train.errors).

Each is a `KilnError` carrying its code and a static hint; the api answers it with the usual
envelope and picks the HTTP status (`api.errors`):

- `hf_export_not_found` (404): no export bundle of that name.
- `hf_export_already_exists` (409): export names are never overwritten.
- `hf_export_unsupported` (400): the requested run is one the pinned TRL runner cannot reproduce
  (Muon), so no bundle is written.
- `peft_import_invalid` (400): the upload is not a PEFT LoRA adapter Kiln can represent on the
  resident model (archive layout, adapter_config.json, tensor names, shapes, dtypes, values).
- `peft_import_mismatch` (409): the adapter is well formed but its run does not belong here (its
  result manifest names another export, base model, tokenizer or template, or its files are not
  the ones the run recorded).
"""

from __future__ import annotations

from kiln_train.errors import KilnError

HF_EXPORT_NOT_FOUND = "hf_export_not_found"
HF_EXPORT_ALREADY_EXISTS = "hf_export_already_exists"
HF_EXPORT_UNSUPPORTED = "hf_export_unsupported"
PEFT_IMPORT_INVALID = "peft_import_invalid"
PEFT_IMPORT_MISMATCH = "peft_import_mismatch"

# code -> static hint
INTEROP_HINTS: dict[str, str] = {
    HF_EXPORT_NOT_FOUND: "List export bundles with GET /v1/train/hf/exports.",
    HF_EXPORT_ALREADY_EXISTS: "Export names are never overwritten; pick a new name.",
    HF_EXPORT_UNSUPPORTED: (
        "Export with config.optimizer.kind sgd or adam_w; docs/interop.md lists what the TRL runner reproduces."
    ),
    PEFT_IMPORT_INVALID: (
        "Upload a gzip tar of a PEFT LoRA adapter directory (adapter_config.json, "
        "adapter_model.safetensors) trained on the resident model; docs/interop.md lists the checks."
    ),
    PEFT_IMPORT_MISMATCH: (
        "The adapter's run does not match this server's export or resident model; nothing was registered."
    ),
}


class InteropError(KilnError):
    """A `KilnError` whose code is one of `INTEROP_HINTS`."""

    def __init__(self, code: str, detail: str, *, hint: str | None = None) -> None:
        super().__init__(code, detail, hint=hint if hint is not None else INTEROP_HINTS[code])


def import_invalid(detail: str) -> InteropError:
    return InteropError(PEFT_IMPORT_INVALID, detail)


def import_mismatch(detail: str) -> InteropError:
    return InteropError(PEFT_IMPORT_MISMATCH, detail)
