"""Generate the AdamW PyTorch oracle fixture (docs/optimizers.md#adamw-qualification).

Runs eager `torch.optim.AdamW(foreach=False, fused=False)` over four cases, each ten steps:

- `ordinary_float32`, `ordinary_bfloat16`: gradients from 1e-4 to 1e-1 in magnitude;
- `low_gradient_float32`, `low_gradient_bfloat16`: gradients from 1e-12 to 1e-9, so `eps` (1e-8)
  dominates `sqrt(v_hat)` in the denominator (the epsilon-dominated regime).

Every case has two parameters (`[4, 8]` and `[8, 4]`, shaped like a LoRA A/B pair) whose initial
values span magnitudes ~0.05..3 with random signs (several bf16 exponents, no zero crossing).
The moments have the parameter's dtype (no master copy), as PyTorch allocates them. After every
step the fixture records every lane of every parameter, first moment (`exp_avg`) and second moment
(`exp_avg_sq`). f32 values are written as the exact decimal of the f32 number; bf16 values as the
raw uint16 bit patterns (`bits`) plus their exact decimal (`values`).

Regenerate (from the repository root, with the pinned torch):

    .venv/bin/python qualification/adamw_pytorch_oracle.py \
        --out qualification/fixtures/adamw_pytorch_oracle_v1.json

then update the fixture sha256 in `qualification/workloads/adamw-pytorch-oracle-v1.json`
(`kiln qualify adamw-pytorch-oracle-v1` checks it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

SCHEMA = "kiln.adamw-pytorch-oracle.v1"
REGENERATE = (
    ".venv/bin/python qualification/adamw_pytorch_oracle.py "
    "--out qualification/fixtures/adamw_pytorch_oracle_v1.json"
)
STEPS = 10
PARAM_SHAPES = {"lora_A": [4, 8], "lora_B": [8, 4]}
TOLERANCES = {
    "float32": {"absolute": 2e-12, "relative": 5e-6},
    "bfloat16": {"parameter_ulps": 1, "exp_avg_ulps": 4, "exp_avg_sq_ulps": 3},
}
CASE_CLASSES = {
    # class: (seed, hyperparameters, log10 gradient magnitude range)
    "ordinary": (
        20260101,
        {"lr": 2e-3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.05},
        (-4.0, -1.0),
    ),
    "low_gradient": (
        20260102,
        {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
        (-12.0, -9.0),
    ),
}
# Initial parameter magnitudes 10**U(-1.3, 0.5) (about 0.05 to 3): ten steps move a lane by at
# most ~10 * lr, so no lane crosses zero, where a ULP distance stops measuring rounding error.
INIT_LOG10 = (-1.3, 0.5)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log_uniform(gen: torch.Generator, shape: list[int], lo: float, hi: float) -> torch.Tensor:
    """Random signs times magnitudes 10**U(lo, hi), in f64."""
    exponent = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    sign = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return sign * torch.pow(10.0, exponent)


def encode(t: torch.Tensor) -> dict | list[float]:
    """Exact lane values: floats for f32; uint16 bits plus floats for bf16."""
    flat = t.detach().reshape(-1)
    if t.dtype == torch.float32:
        return [float(x) for x in flat.tolist()]
    if t.dtype == torch.bfloat16:
        bits = flat.view(torch.int16).to(torch.int32) & 0xFFFF
        return {"bits": [int(b) for b in bits.tolist()], "values": [float(x) for x in flat.float().tolist()]}
    raise ValueError(f"unsupported dtype {t.dtype}")


def run_case(cls: str, dtype_name: str) -> dict:
    seed, hp, (glo, ghi) = CASE_CLASSES[cls]
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    # The same f64 draws for both dtypes of a class; each dtype rounds them once.
    initial = {n: log_uniform(gen, shape, INIT_LOG10[0], INIT_LOG10[1]) for n, shape in PARAM_SHAPES.items()}
    grads = [
        {n: log_uniform(gen, shape, glo, ghi) for n, shape in PARAM_SHAPES.items()} for _ in range(STEPS)
    ]
    params = {n: torch.nn.Parameter(v.to(dtype)) for n, v in initial.items()}
    opt = torch.optim.AdamW(
        list(params.values()),
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        foreach=False,
        fused=False,
    )
    stored_grads, trajectory = [], []
    for step in range(1, STEPS + 1):
        step_grads = {n: g.to(dtype) for n, g in grads[step - 1].items()}
        for n, p in params.items():
            p.grad = step_grads[n].clone()
        opt.step()
        stored_grads.append({n: encode(g) for n, g in step_grads.items()})
        record = {"step": step, "params": {}}
        for n, p in params.items():
            st = opt.state[p]
            assert st["exp_avg"].dtype == dtype and st["exp_avg_sq"].dtype == dtype
            assert int(st["step"].item()) == step
            record["params"][n] = {
                "parameter": encode(p),
                "exp_avg": encode(st["exp_avg"]),
                "exp_avg_sq": encode(st["exp_avg_sq"]),
            }
        trajectory.append(record)
    return {
        "id": f"{cls}_{dtype_name}",
        "class": cls,
        "dtype": dtype_name,
        "seed": seed,
        "hyperparameters": hp,
        "state_contract": {
            "parameter_dtype": dtype_name,
            "first_moment_dtype": dtype_name,
            "second_moment_dtype": dtype_name,
            "separate_master_parameter": False,
        },
        "params": [
            {"name": n, "shape": shape, "initial": encode(initial[n].to(dtype))}
            for n, shape in PARAM_SHAPES.items()
        ],
        "gradients": stored_grads,
        "trajectory": trajectory,
    }


def build_fixture() -> dict:
    return {
        "schema": SCHEMA,
        "generator": {
            "script": "qualification/adamw_pytorch_oracle.py",
            "command": REGENERATE,
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "optimizer": "torch.optim.AdamW(foreach=False, fused=False)",
            "device": "cpu",
        },
        "steps_per_case": STEPS,
        "tolerances": TOLERANCES,
        "cases": [run_case(cls, dt) for cls in CASE_CLASSES for dt in DTYPES],
    }


def dump(fixture: dict) -> str:
    """Indented JSON with every list of numbers kept on one line (a readable, modest file)."""
    text = json.dumps(fixture, indent=1, sort_keys=False)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the fixture JSON")
    args = parser.parse_args(argv)
    fixture = build_fixture()
    text = dump(fixture)
    assert json.loads(text) == json.loads(json.dumps(fixture)), "compact dump must round-trip"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(text)} bytes, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
