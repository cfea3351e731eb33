"""`kiln train hf export-sft` and `kiln train hf import-peft`: the HF/TRL round trip from the
command line (docs/interop.md).

- `export-sft --file rows.jsonl --name N [--output DIR]`: the rows travel inline to
  `POST /v1/train/hf/sft/exports` (the server ingests them with the resident tokenizer and builds
  the bundle), then the bundle is downloaded and unpacked as `DIR/N.kiln-hf/` (default: the
  current directory). Run flags (`--epochs --rank --alpha --learning-rate --seed --optimizer`)
  are sent only when given; the server's defaults apply otherwise.
- `import-peft --bundle DIR --name N`: DIR is a run's output directory (`adapter_config.json`,
  `adapter_model.safetensors`, and from `train.py` `kiln_hf_result.json` and
  `step_losses.jsonl`), or a bundle whose `trl-output/` holds one. Those files, and the bundle's
  `kiln_hf_export.json` when there is one, go as a gzip tar to
  `POST /v1/train/hf/peft/imports/N`.

Talks to a running api like the other `kiln train` commands (exit 1 for an error envelope, 2 for
bad input, 3 when the api cannot be reached). Torch-free.
"""

from __future__ import annotations

import io
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from kiln_cli.client_connection import with_client
from kiln_cli.client_view import emit_json, format_bytes
from kiln_cli.http_client import (
    ApiClient,
    ApiError,
    ApiUnreachable,
    LocalFileError,
    _decode_json,
    api_error_from,
    extract_archive,
    quote_segment,
)
from kiln_cli.sft_submit import InputError, annotate_rows, read_examples

# The server ingests and tokenizes every row inside the request, as for a submission.
EXPORT_TIMEOUT_S = 330.0
RUN_FILES = ("adapter_config.json", "adapter_model.safetensors", "kiln_hf_result.json", "step_losses.jsonl")
EXPORT_MANIFEST = "kiln_hf_export.json"
RUN_DIR = "trl-output"


def register(cli: click.Group) -> None:
    train = cli.commands.get("train")
    if not isinstance(train, click.Group):
        train = click.Group("train", help="Submit training jobs to a running api.")
        cli.add_command(train)
    hf = click.Group("hf", help="Hugging Face / TRL round trips: export SFT bundles, import PEFT adapters.")
    train.add_command(hf)
    hf.add_command(export_sft)
    hf.add_command(import_peft)


def export_config(options: dict[str, Any]) -> dict[str, Any]:
    """The export's `config`: only the flags that were given."""
    fields = {
        "epochs": "epochs",
        "rank": "lora_rank",
        "alpha": "lora_alpha",
        "learning_rate": "learning_rate",
    }
    config = {name: options[flag] for flag, name in fields.items() if options.get(flag) is not None}
    if options.get("seed") is not None:
        config["seed"] = options["seed"]
    if options.get("optimizer") is not None:
        config["optimizer"] = {"kind": options["optimizer"]}
    if options.get("allow_high_lora_scale"):
        config["allow_high_lora_scale"] = True
    return config


@click.command("export-sft")
@click.option(
    "--file", "data", required=True, type=click.Path(dir_okay=False, path_type=Path), help="JSONL rows."
)
@click.option("--name", required=True, help="The bundle's name (NAME.kiln-hf; never overwritten).")
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Unpack the bundle as OUTPUT/NAME.kiln-hf/.",
)
@click.option("--epochs", type=click.IntRange(min=1))
@click.option("--rank", type=click.IntRange(min=1), help="LoRA rank.")
@click.option("--alpha", type=float, help="LoRA alpha.")
@click.option("--learning-rate", type=float)
@click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1))
@click.option("--optimizer", type=click.Choice(["sgd", "adam_w"]), help="Default: the server's (adam_w).")
@click.option("--allow-high-lora-scale", is_flag=True, help="Allow alpha/rank above 2.")
@click.option("--invalid-row-policy", type=click.Choice(["fail", "skip"]))
@click.option("--input-adapter", help="Start from this registry adapter instead of Kiln's seeded init.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@with_client
def export_sft(client: ApiClient, data: Path, name: str, output: Path, as_json: bool, **options: Any) -> None:
    """Export JSONL rows as a bundle for the pinned TRL runner, and download it."""
    target = output / f"{name}.kiln-hf"
    if target.exists():
        raise LocalFileError(f"{target} exists; remove it or choose another --output")
    policy = options.get("invalid_row_policy")
    rows, lines = read_examples(data, policy)
    body: dict[str, Any] = {"name": name, "examples": rows, "config": export_config(options)}
    if policy is not None:
        body["invalid_row_policy"] = policy
    if options.get("input_adapter") is not None:
        body["input_adapter"] = options["input_adapter"]
    try:
        info = client.request("POST", "/v1/train/hf/sft/exports", body=body, timeout=EXPORT_TIMEOUT_S).body
    except ApiError as err:
        annotate_rows(err, lines, data)
        raise
    path, files = extract_archive(
        client, f"/v1/train/hf/exports/{quote_segment(name)}/download", target.name, output
    )
    if as_json:
        emit_json({"export": info, "extracted_to": str(path), "files": files})
        return
    click.echo(
        f"export {name}: {info['rows_kept']} row(s) ({info['rows_rejected']} rejected), "
        f"{info['total_steps']} step(s), {info['optimizer']} lr {info['manifest']['optimizer']['learning_rate']:g}, "
        f"LoRA r={info['lora_rank']} alpha={info['lora_alpha']:g}, seed {info['seed']}"
    )
    click.echo(f"  bundle {info['bundle_digest']} unpacked to {path} ({len(files)} files)")
    click.echo(f"  train it:  pip install -r {path / 'requirements.lock'}")
    click.echo(f"             python {path / 'train.py'} --model <base model directory>")
    click.echo(f"  import it: kiln train hf import-peft --bundle {path} --name <adapter name>")


def run_files(bundle: Path) -> tuple[Path, dict[str, bytes]]:
    """The adapter directory behind --bundle and the files the import sends."""
    if (bundle / "adapter_config.json").is_file():
        run = bundle
    elif (bundle / RUN_DIR / "adapter_config.json").is_file():
        run = bundle / RUN_DIR
    else:
        raise InputError(
            f"--bundle {bundle}: no adapter_config.json there or in {bundle / RUN_DIR}; pass the output "
            "directory of train.py (or of any PEFT run)"
        )
    files = {name: (run / name).read_bytes() for name in RUN_FILES if (run / name).is_file()}
    if "adapter_model.safetensors" not in files:
        raise InputError(f"--bundle {bundle}: {run} has no adapter_model.safetensors")
    for manifest in (run / EXPORT_MANIFEST, run.parent / EXPORT_MANIFEST):
        if "kiln_hf_result.json" in files and manifest.is_file():
            files[EXPORT_MANIFEST] = manifest.read_bytes()
            break
    return run, files


def gzip_tar(files: dict[str, bytes], root: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def post_archive(client: ApiClient, path: str, data: bytes) -> Any:
    """POST a gzip body; the decoded JSON answer, ApiError for an error status."""
    headers = {"Content-Type": "application/gzip", "Accept": "application/json"}
    if client.connection.token:
        headers["Authorization"] = f"Bearer {client.connection.token}"
    url = client.base_url + path
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=EXPORT_TIMEOUT_S) as response:  # noqa: S310 (operator URL)
            return _decode_json(response.read(), response.status, url)
    except urllib.error.HTTPError as exc:
        raise api_error_from(exc, url) from None
    except OSError as exc:
        raise ApiUnreachable(url, str(getattr(exc, "reason", exc)), client.base_url) from None


@click.command("import-peft")
@click.option("--bundle", required=True, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--name", required=True, help="The adapter's name in the registry (never overwritten).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@with_client
def import_peft(client: ApiClient, bundle: Path, name: str, as_json: bool) -> None:
    """Register a PEFT LoRA adapter (a TRL run of a bundle, or any PEFT run) after the server's checks."""
    run, files = run_files(bundle)
    archive = gzip_tar(files, run.name or "adapter")
    answer = post_archive(client, f"/v1/train/hf/peft/imports/{quote_segment(name)}", archive)
    if as_json:
        emit_json(answer)
        return
    adapter, receipt = answer["adapter"], answer["import_receipt"]
    origin = (
        "a TRL run of export " + str(receipt["run"]["export"]["name"]) if receipt["run"] else "a PEFT adapter"
    )
    click.echo(
        f"adapter {adapter['name']} imported from {origin}: r={adapter['rank']} alpha={adapter['alpha']:g}, "
        f"{format_bytes(adapter['size_bytes'])}, {len(receipt['checks'])} check(s) passed"
    )
    if receipt["adapter"]["targets_filled"]:
        click.echo(
            f"  targets the run did not train (zero-delta pairs): {', '.join(receipt['adapter']['targets_filled'])}"
        )
    click.echo(f"  train on from it: kiln train sft --base-adapter {adapter['name']} ...")
    click.echo(f"  adapter_model.safetensors {receipt['published']['adapter_model_sha256']}")
