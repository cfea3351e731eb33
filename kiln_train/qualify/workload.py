"""Qualification workloads and their receipts (docs/optimizers.md#adamw-qualification).

`adamw-pytorch-oracle-v1` (described by `qualification/workloads/adamw-pytorch-oracle-v1.json`)
runs three stages, fail-closed:

1. `fixture_contract`: the committed fixture is the one the workload pins (sha256), has the
   contract's schema, cases, step count, lane counts, exact encodings and bounds, and its
   low-gradient cases really are epsilon-dominated.
2. `portable_reference`: our AdamW on the CPU, f32 and bf16, against every recorded lane.
3. `resident_backend`: the same comparison on the resident backend's device. Only a CUDA device
   runs it; without one the stage is `not_run` ("no CUDA device"), never a pass.

The receipt (`kiln.qualification-receipt.v1`) records device, versions, git commit, every stage's
outcome with the worst error per case, and a verdict: `pass` (every stage passed), `fail` (any
stage failed) or `incomplete` (nothing failed but a required stage did not run). Exit codes:
0 pass, 1 fail, 3 incomplete (2 stays click's usage error).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

from kiln_train.ground.digest import file_sha256_hex

RECEIPT_SCHEMA = "kiln.qualification-receipt.v1"
WORKLOAD_SCHEMA = "kiln.qualification-workload.v1"
ADAMW_ORACLE_WORKLOAD = "adamw-pytorch-oracle-v1"
WORKLOADS = (ADAMW_ORACLE_WORKLOAD,)
PASS, FAIL, NOT_RUN = "pass", "fail", "not_run"
VERDICT_PASS, VERDICT_FAIL, VERDICT_INCOMPLETE = "pass", "fail", "incomplete"
EXIT_CODES = {VERDICT_PASS: 0, VERDICT_FAIL: 1, VERDICT_INCOMPLETE: 3}
DEFAULT_RECEIPT_DIR = Path("qualification") / "receipts"
NO_CUDA_REASON = "no CUDA device"


def repo_root() -> Path:
    """The source checkout holding `qualification/` (kiln_train's parent directory)."""
    return Path(__file__).resolve().parents[2]


def load_workload(workload_id: str, root: Path | None = None) -> dict:
    root = root or repo_root()
    if workload_id not in WORKLOADS:
        raise ValueError(f"unknown qualification workload {workload_id!r}; known: {', '.join(WORKLOADS)}")
    path = root / "qualification" / "workloads" / f"{workload_id}.json"
    workload = json.loads(path.read_text(encoding="utf-8"))
    if workload.get("schema") != WORKLOAD_SCHEMA or workload.get("id") != workload_id:
        raise ValueError(f"{path} is not the {WORKLOAD_SCHEMA} description of {workload_id}")
    return workload


# ----- stage 1: the fixture contract ---------------------------------------------------------
def check_fixture_contract(workload: dict, fixture_path: Path) -> tuple[dict | None, dict]:
    """Validate the fixture against the workload; returns (fixture or None, stage result)."""
    problems: list[str] = []
    stage = {"id": "fixture_contract", "outcome": FAIL, "reason": None, "fixture": str(fixture_path)}
    if not fixture_path.is_file():
        stage["reason"] = f"fixture {fixture_path} is missing"
        return None, stage
    digest = file_sha256_hex(fixture_path)
    stage["sha256"] = digest
    if digest != workload["fixture"]["sha256"]:
        problems.append(
            f"fixture sha256 {digest} differs from the workload's {workload['fixture']['sha256']}"
        )
    try:
        fixture = json.loads(fixture_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        stage["reason"] = f"fixture is not readable JSON: {exc}"
        return None, stage
    problems += fixture_problems(workload, fixture)
    stage["torch_version"] = fixture.get("generator", {}).get("torch_version")
    stage["problems"] = problems
    if problems:
        stage["reason"] = problems[0]
        return None, stage
    stage["outcome"] = PASS
    return fixture, stage


def fixture_problems(workload: dict, fixture: dict) -> list[str]:
    """Every way `fixture` departs from the workload's contract (empty when it conforms)."""
    from kiln_train.qualify.adamw_oracle import FIELDS, FIXTURE_SCHEMA

    out: list[str] = []
    if fixture.get("schema") != FIXTURE_SCHEMA:
        return [f"fixture schema is {fixture.get('schema')!r}, expected {FIXTURE_SCHEMA!r}"]
    gen = fixture.get("generator") or {}
    if not gen.get("torch_version") or not gen.get("command"):
        out.append("fixture generator must record torch_version and the regenerate command")
    if "foreach=False" not in str(gen.get("optimizer")) or "fused=False" not in str(gen.get("optimizer")):
        out.append("fixture must come from torch.optim.AdamW(foreach=False, fused=False)")
    bounds = workload["bounds"]
    tol = fixture.get("tolerances", {})
    if tol.get("float32") != {k: bounds["float32"][k] for k in ("absolute", "relative")}:
        out.append(f"fixture float32 tolerances {tol.get('float32')} differ from the workload's")
    want_bf16 = {k: bounds["bfloat16"][k] for k in ("parameter_ulps", "exp_avg_ulps", "exp_avg_sq_ulps")}
    if tol.get("bfloat16") != want_bf16:
        out.append(f"fixture bfloat16 tolerances {tol.get('bfloat16')} differ from the workload's")
    steps = workload["steps_per_case"]
    cases = {c.get("id"): c for c in fixture.get("cases", [])}
    wanted = {c["id"]: c for c in workload["cases"]}
    if set(cases) != set(wanted):
        out.append(f"fixture cases {sorted(cases)} differ from the workload's {sorted(wanted)}")
    for cid, spec in wanted.items():
        case = cases.get(cid)
        if case is None:
            continue
        out += _case_problems(case, spec, steps, FIELDS)
    return out


def _case_problems(case: dict, spec: dict, steps: int, fields: tuple[str, ...]) -> list[str]:
    cid, dtype = case["id"], spec["dtype"]
    out = []
    if case.get("class") != spec["class"] or case.get("dtype") != dtype:
        out.append(f"{cid}: class/dtype {case.get('class')}/{case.get('dtype')} differ from the workload's")
        return out
    sc = case.get("state_contract", {})
    if (
        sc.get("parameter_dtype") != dtype
        or sc.get("first_moment_dtype") != dtype
        or sc.get("second_moment_dtype") != dtype
        or sc.get("separate_master_parameter") is not False
    ):
        out.append(f"{cid}: moments must share the parameter dtype with no master copy")
    if len(case.get("gradients", [])) != steps or len(case.get("trajectory", [])) != steps:
        out.append(f"{cid}: expected {steps} gradients and {steps} recorded steps")
        return out
    if [r.get("step") for r in case["trajectory"]] != list(range(1, steps + 1)):
        out.append(f"{cid}: trajectory steps must be 1..={steps}")
    shapes = {p["name"]: p["shape"] for p in case.get("params", [])}
    if not shapes:
        out.append(f"{cid}: no parameters")
        return out
    for p in case["params"]:
        out += _lane_problems(f"{cid} {p['name']}.initial", p["initial"], dtype, p["shape"])
    for i, g in enumerate(case["gradients"]):
        if set(g) != set(shapes):
            out.append(f"{cid} gradient {i + 1}: parameters {sorted(g)} differ from {sorted(shapes)}")
            continue
        for n, s in shapes.items():
            out += _lane_problems(f"{cid} gradient {i + 1} {n}", g[n], dtype, s)
    for rec in case["trajectory"]:
        if set(rec.get("params", {})) != set(shapes):
            out.append(f"{cid} step {rec.get('step')}: parameters differ from {sorted(shapes)}")
            continue
        for n, s in shapes.items():
            for f in fields:
                out += _lane_problems(f"{cid} step {rec['step']} {n}.{f}", rec["params"][n].get(f), dtype, s)
    if not out:
        out += _regime_problems(case, spec)
    return out


def _lane_problems(where: str, value, dtype: str, shape: list[int]) -> list[str]:
    import struct

    n = math.prod(shape)
    if dtype == "float32":
        if not isinstance(value, list) or len(value) != n:
            return [f"{where}: expected {n} f32 lanes"]
        for x in value:
            if not isinstance(x, int | float) or not math.isfinite(x):
                return [f"{where}: non-finite or non-numeric lane {x!r}"]
            if struct.unpack("<f", struct.pack("<f", x))[0] != x:
                return [f"{where}: lane {x!r} is not an exact f32 value"]
        return []
    if not isinstance(value, dict) or len(value.get("bits", [])) != n or len(value.get("values", [])) != n:
        return [f"{where}: expected {n} bf16 lanes as bits and values"]
    for b, x in zip(value["bits"], value["values"], strict=True):
        if not isinstance(b, int) or not 0 <= b <= 0xFFFF:
            return [f"{where}: bf16 bit pattern {b!r} out of range"]
        decoded = struct.unpack("<f", struct.pack("<I", b << 16))[0]
        if not math.isfinite(decoded) or decoded != x:
            return [f"{where}: bits {b:#06x} decode to {decoded!r}, fixture says {x!r}"]
    return []


def _regime_problems(case: dict, spec: dict) -> list[str]:
    """Low-gradient cases must be epsilon-dominated at every lane and step; ordinary ones must not."""
    import torch

    from kiln_train.qualify.adamw_oracle import decode_lanes

    hp, dtype = case["hyperparameters"], case["dtype"]
    shapes = {p["name"]: p["shape"] for p in case["params"]}
    ratios = []
    for rec in case["trajectory"]:
        bc2 = 1 - hp["beta2"] ** rec["step"]
        for n, s in shapes.items():
            v = decode_lanes(rec["params"][n]["exp_avg_sq"], dtype, s).double()
            ratios.append(float((torch.sqrt(v / bc2) / hp["eps"]).max()))
    worst = max(ratios)
    if spec["class"] == "low_gradient" and worst >= 1.0:
        return [f"{case['id']}: sqrt(v_hat) reaches {worst:.3g} x eps; the case is not epsilon-dominated"]
    if spec["class"] == "ordinary" and worst < 100.0:
        return [f"{case['id']}: sqrt(v_hat) stays below 100 x eps; the case is not an ordinary-gradient case"]
    return []


# ----- stages 2 and 3: replay on a device ----------------------------------------------------
def run_replay_stage(stage_id: str, fixture: dict, device: str, dtypes: list[str]) -> dict:
    from kiln_train.qualify.adamw_oracle import TRAJECTORY, replay_case

    results, drift = [], []
    for case in fixture["cases"]:
        if case["dtype"] not in dtypes:
            continue
        replay = replay_case(case, fixture["tolerances"], device=device)
        results.append(replay.to_dict())
        if case["dtype"] == "bfloat16":
            # Reported, not bounded: free-running rounding differences accumulate over ten steps.
            free = replay_case(case, fixture["tolerances"], device=device, mode=TRAJECTORY)
            drift.append({"case_id": case["id"], "fields": {f: e.max_ulps for f, e in free.fields.items()}})
    failed = [r for r in results if not r["passed"]]
    return {
        "id": stage_id,
        "outcome": FAIL if failed or not results else PASS,
        "reason": (failed[0]["violations"] or ["no lanes compared"])[0] if failed else None,
        "device": device,
        "results": results,
        "bf16_free_running_drift_ulps": drift,
    }


def run_resident_stage(fixture: dict, device: str, dtypes: list[str]) -> dict:
    import torch

    if device == "cpu":
        return {
            "id": "resident_backend",
            "outcome": NOT_RUN,
            "reason": "the cpu backend's optimizer route is portable_reference; only a CUDA device "
            "runs the resident (native_device_hook) path",
            "device": device,
            "results": [],
        }
    if not torch.cuda.is_available():
        return {
            "id": "resident_backend",
            "outcome": NOT_RUN,
            "reason": NO_CUDA_REASON,
            "device": device,
            "results": [],
        }
    stage = run_replay_stage("resident_backend", fixture, device, dtypes)
    stage["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return stage


# ----- the receipt ---------------------------------------------------------------------------
def verdict_of(stages: list[dict]) -> str:
    outcomes = [s["outcome"] for s in stages]
    if FAIL in outcomes:
        return VERDICT_FAIL
    if NOT_RUN in outcomes:
        return VERDICT_INCOMPLETE
    return VERDICT_PASS


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: str) -> dict:
    import torch

    try:
        from importlib.metadata import version

        kiln_version = version("kiln")
    except Exception:  # not installed as a distribution
        kiln_version = None
    return {
        "requested_device": device,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda_runtime": torch.version.cuda,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "kiln_version": kiln_version,
    }


def qualify_adamw_oracle(device: str = "cuda", *, root: Path | None = None) -> dict:
    """Run the three stages and return the receipt (not yet written)."""
    root = root or repo_root()
    workload = load_workload(ADAMW_ORACLE_WORKLOAD, root)
    fixture_path = root / workload["fixture"]["path"]
    started = _dt.datetime.now(_dt.UTC)
    fixture, contract = check_fixture_contract(workload, fixture_path)
    stages = [contract]
    by_id = {s["id"]: s for s in workload["stages"]}
    if fixture is None:
        for sid in ("portable_reference", "resident_backend"):
            stages.append({"id": sid, "outcome": FAIL, "reason": "fixture contract failed", "results": []})
    else:
        stages.append(
            run_replay_stage("portable_reference", fixture, "cpu", by_id["portable_reference"]["dtypes"])
        )
        stages.append(run_resident_stage(fixture, device, by_id["resident_backend"]["dtypes"]))
    return {
        "schema": RECEIPT_SCHEMA,
        "workload": ADAMW_ORACLE_WORKLOAD,
        "workload_sha256": file_sha256_hex(
            root / "qualification" / "workloads" / f"{ADAMW_ORACLE_WORKLOAD}.json"
        ),
        "fixture": {"path": workload["fixture"]["path"], "sha256": contract.get("sha256")},
        "started_at": started.isoformat().replace("+00:00", "Z"),
        "finished_at": _dt.datetime.now(_dt.UTC).isoformat().replace("+00:00", "Z"),
        "git_commit": git_commit(root),
        "environment": environment(device),
        "bounds": workload["bounds"],
        "stages": stages,
        "verdict": verdict_of(stages),
    }


def write_receipt(receipt: dict, out_dir: Path) -> Path:
    """`<out>/<workload>-<device>-<UTC timestamp>.json`; never overwrites."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = receipt["started_at"].replace(":", "").replace("-", "").replace(".", "")
    device = receipt["environment"]["requested_device"].replace(":", "")
    path = out_dir / f"{receipt['workload']}-{device}-{stamp}.json"
    n = 1
    while path.exists():
        n += 1
        path = out_dir / f"{receipt['workload']}-{device}-{stamp}-{n}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(receipt, indent=2) + "\n", encoding="utf-8")
    tmp.rename(path)
    return path
