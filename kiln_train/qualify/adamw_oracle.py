"""Replay of the AdamW PyTorch oracle fixture (docs/optimizers.md#adamw-qualification).

The fixture (`qualification/fixtures/adamw_pytorch_oracle_v1.json`, written by
`qualification/adamw_pytorch_oracle.py`) records eager `torch.optim.AdamW(foreach=False,
fused=False)` after every step of four ten-step cases. This module decodes it and measures our
`AdamW` against it:

- f32 cases run the whole trajectory from the initial parameters (free-running) and every lane of
  every field at every step must satisfy `|ours - expected| <= 2e-12 + 5e-6 * |expected|`.
- bf16 cases are compared per step: before step k our parameters, moments and step counters are
  restored (through `load_state_tensors`) to the oracle's values after step k-1, so each comparison
  measures the rounding difference of exactly one update (one fused f32 rounding per output versus
  eager PyTorch's rounding after every tensor operation). That is the contract's per-step envelope:
  at most 1 bf16 ULP for parameters, 4 for first moments, 3 for second moments. The free-running
  bf16 drift is measured too and reported, not bounded (rounding differences accumulate over ten
  steps).

ULP distances are counted on the bit patterns (sign-magnitude mapped to a monotonic integer line,
so +0 and -0 are 0 apart).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from kiln_train.optim.adamw import AdamW
from kiln_train.optim.state import state_key

FIXTURE_SCHEMA = "kiln.adamw-pytorch-oracle.v1"
FIELDS = ("parameter", "exp_avg", "exp_avg_sq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BF16_ULP_BOUND_KEYS = {
    "parameter": "parameter_ulps",
    "exp_avg": "exp_avg_ulps",
    "exp_avg_sq": "exp_avg_sq_ulps",
}
PER_STEP = "per_step"
TRAJECTORY = "trajectory"


def decode_lanes(value, dtype_name: str, shape: list[int]) -> Tensor:
    """A fixture lane list as a CPU tensor: f32 from exact decimals, bf16 from its uint16 bits."""
    if dtype_name == "float32":
        return torch.tensor(value, dtype=torch.float32).reshape(shape)
    if dtype_name == "bfloat16":
        bits = torch.tensor(value["bits"], dtype=torch.int32)
        return bits.to(torch.int16).view(torch.bfloat16).reshape(shape)
    raise ValueError(f"unsupported fixture dtype {dtype_name!r}")


def ordered_bits(t: Tensor) -> Tensor:
    """Map f32/bf16 bit patterns onto a monotonic int64 line (adjacent floats differ by 1)."""
    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        sign, mag = bits >= 0x8000, bits & 0x7FFF
    elif t.dtype == torch.float32:
        bits = t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        sign, mag = bits >= 0x80000000, bits & 0x7FFFFFFF
    else:
        raise ValueError(f"ULP distance needs f32 or bf16, got {t.dtype}")
    return torch.where(sign, -mag, mag)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Per-lane distance in units in the last place of the shared dtype."""
    if a.dtype != b.dtype:
        raise ValueError(f"ULP distance needs one dtype, got {a.dtype} and {b.dtype}")
    return (ordered_bits(a.cpu()) - ordered_bits(b.cpu())).abs()


@dataclass
class FieldError:
    """The worst lane of one field over a case."""

    max_abs_error: float = 0.0
    max_ulps: int = 0
    max_bound_ratio: float | None = 0.0  # f32 only: error / (abs + rel * |expected|); <= 1 passes
    at: dict | None = None


@dataclass
class CaseReplay:
    """Our AdamW against one fixture case, worst error per field."""

    case_id: str
    dtype: str
    mode: str
    device: str
    fields: dict[str, FieldError] = field(default_factory=lambda: {f: FieldError() for f in FIELDS})
    violations: list[str] = field(default_factory=list)
    checked_lanes: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "float32":
            for err in self.fields.values():
                err.max_bound_ratio = None

    @property
    def passed(self) -> bool:
        return not self.violations and self.checked_lanes > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def _params_of(case: dict) -> dict[str, list[int]]:
    return {p["name"]: list(p["shape"]) for p in case["params"]}


def build_case_optimizer(case: dict, device: str) -> AdamW:
    dtype = case["dtype"]
    hp = case["hyperparameters"]
    params = [
        (p["name"], torch.nn.Parameter(decode_lanes(p["initial"], dtype, p["shape"]).to(device)))
        for p in case["params"]
    ]
    return AdamW(
        params,
        hp["lr"],
        beta1=hp["beta1"],
        beta2=hp["beta2"],
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )


def _restore(opt: AdamW, case: dict, record: dict) -> None:
    """Set parameters, moments and counters to the oracle's values after `record['step']`."""
    dtype, shapes, step = case["dtype"], _params_of(case), record["step"]
    tensors: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        lanes = record["params"][name]
        with torch.no_grad():
            opt.params[name].copy_(decode_lanes(lanes["parameter"], dtype, shape))
        tensors[state_key(name, opt.kind, "m")] = decode_lanes(lanes["exp_avg"], dtype, shape).float()
        tensors[state_key(name, opt.kind, "v")] = decode_lanes(lanes["exp_avg_sq"], dtype, shape).float()
        tensors[state_key(name, opt.kind, "step")] = torch.tensor([step], dtype=torch.uint32)
    opt.load_state_tensors(tensors, global_step=step)


def _ours(opt: AdamW, name: str, fld: str) -> Tensor:
    if fld == "parameter":
        return opt.params[name].detach()
    return opt.state[name]["m" if fld == "exp_avg" else "v"]


def replay_case(case: dict, tolerances: dict, *, device: str = "cpu", mode: str | None = None) -> CaseReplay:
    """Run our AdamW through `case` on `device` and compare every lane after every step."""
    dtype = case["dtype"]
    mode = mode or (TRAJECTORY if dtype == "float32" else PER_STEP)
    result = CaseReplay(case["id"], dtype, mode, device)
    opt = build_case_optimizer(case, device)
    shapes = _params_of(case)
    previous = None
    for grads_rec, record in zip(case["gradients"], case["trajectory"], strict=True):
        if mode == PER_STEP and previous is not None:
            _restore(opt, case, previous)
        grads = {n: decode_lanes(grads_rec[n], dtype, s).to(device) for n, s in shapes.items()}
        opt.step(grads)
        for name, shape in shapes.items():
            for fld in FIELDS:
                expected = decode_lanes(record["params"][name][fld], dtype, shape)
                _compare(result, tolerances, record["step"], name, fld, _ours(opt, name, fld).cpu(), expected)
        previous = record
    return result


def _first_lane(out_of_bounds: Tensor) -> int | None:
    lanes = out_of_bounds.nonzero().reshape(-1)
    return int(lanes[0]) if lanes.numel() else None


def _compare(
    result: CaseReplay, tol: dict, step: int, name: str, fld: str, got: Tensor, want: Tensor
) -> None:
    err64 = (got.double() - want.double()).abs().reshape(-1)
    ulps = ulp_distance(got, want).reshape(-1)
    worst = result.fields[fld]
    result.checked_lanes += err64.numel()
    at = {"step": step, "param": name}
    if result.dtype == "float32":
        bound = tol["float32"]["absolute"] + tol["float32"]["relative"] * want.double().abs().reshape(-1)
        ratio = err64 / bound
        lane = int(ratio.argmax())
        if float(ratio[lane]) > worst.max_bound_ratio or worst.at is None:
            worst.max_bound_ratio = float(ratio[lane])
            worst.at = {**at, "lane": lane}
        i = _first_lane(err64 > bound)
        excess = f" error {float(err64[i]):.3e} > bound {float(bound[i]):.3e}" if i is not None else ""
    else:
        limit = tol["bfloat16"][BF16_ULP_BOUND_KEYS[fld]]
        lane = int(ulps.argmax())
        if int(ulps[lane]) > worst.max_ulps or worst.at is None:
            worst.at = {**at, "lane": lane}
        i = _first_lane(ulps > limit)
        excess = f": {int(ulps[i])} bf16 ULPs > {limit}" if i is not None else ""
    if i is not None:  # the first lane out of bounds, with how far out it is
        result.violations.append(
            f"{result.case_id} step {step} {name}.{fld}[{i}]: got {float(got.reshape(-1)[i])!r} "
            f"want {float(want.reshape(-1)[i])!r}{excess}"
        )
    worst.max_abs_error = max(worst.max_abs_error, float(err64.max()))
    worst.max_ulps = max(worst.max_ulps, int(ulps.max()))
    if not math.isfinite(worst.max_abs_error):
        result.violations.append(f"{result.case_id} step {step} {name}.{fld}: non-finite value")
