"""`kiln qualify WORKLOAD`: run a qualification workload and write its receipt.

Exit status: 0 pass, 1 fail, 3 incomplete (a required stage, such as the CUDA resident path,
did not run); 2 is a usage error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

WORKLOAD_CHOICES = ("adamw-pytorch-oracle-v1",)


def register(cli: click.Group) -> None:
    @cli.command("qualify")
    @click.argument("workload", type=click.Choice(WORKLOAD_CHOICES), metavar="WORKLOAD")
    @click.option(
        "--device",
        type=click.Choice(["cpu", "cuda"]),
        default="cuda",
        show_default=True,
        help="Resident backend device to qualify; without a CUDA device that stage is not run.",
    )
    @click.option(
        "--out",
        "out_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Receipt directory (default: qualification/receipts/ in the checkout).",
    )
    def qualify(workload: str, device: str, out_dir: Path | None) -> None:
        """Run WORKLOAD (fixture contract, portable reference, resident backend) and write a receipt."""
        from kiln_train.qualify.workload import (
            DEFAULT_RECEIPT_DIR,
            EXIT_CODES,
            qualify_adamw_oracle,
            repo_root,
            write_receipt,
        )

        receipt = qualify_adamw_oracle(device)
        path = write_receipt(receipt, out_dir if out_dir is not None else repo_root() / DEFAULT_RECEIPT_DIR)
        for stage in receipt["stages"]:
            line = f"{stage['id']:<20} {stage['outcome']}"
            if stage.get("reason"):
                line += f"  ({stage['reason']})"
            click.echo(line)
            for case in stage.get("results", []):
                worst = ", ".join(
                    f"{f} {e['max_abs_error']:.3g} abs / {e['max_ulps']} ulp"
                    for f, e in case["fields"].items()
                )
                click.echo(f"    {case['case_id']:<24} {'pass' if case['passed'] else 'FAIL'}  {worst}")
        click.echo(f"verdict: {receipt['verdict']}")
        click.echo(f"receipt: {path}")
        sys.exit(EXIT_CODES[receipt["verdict"]])
