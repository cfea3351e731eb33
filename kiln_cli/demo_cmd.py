"""`kiln demo`: the README's main command, end to end on embedded defaults.

Builds a random Qwen3.5 checkpoint once per root (real tokenizer, marked as random), migrates a
SQLite job store, starts `kiln serve` and `kiln worker` as child processes (SQLite broker, CPU),
submits the demo conversations over HTTP with `kiln train sft` (live progress, receipt summary,
adapter path), names the model the job ran on and the time each part took, and stops everything
it started. It holds its root while it runs: another demo or a `kiln up` there is refused with
this one's address (kiln_cli/stack_lock.py).

Interrupting it (Ctrl-C, SIGTERM, SIGHUP) cancels the job it submitted, stops the api and the
worker, and exits 128 + the signal number, so the next run in the same root starts clean: a
run that was killed outright (SIGKILL) leaves no process behind either (the children are told to
stop when the demo dies) and its unfinished jobs are cancelled by the next run. The model is
built beside its final directory and renamed into place, so an interrupted build never leaves a
half-written checkpoint that a later run would try to load.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import click

from kiln.demo import DEMO_RUN
from kiln_cli.client_view import TERMINAL_STATES
from kiln_cli.http_client import ApiClient, ApiError, ApiUnreachable, Connection, quote_segment
from kiln_cli.stack_lock import stack_lock

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO_ROOT / "examples" / "demo.jsonl"
START_TIMEOUT_S = 240
# How long an interrupted demo waits for its cancelled job to stop at a step boundary.
CANCEL_WAIT_S = 60
STOP_TIMEOUT_S = 60
ADAPTER_PREFIX = "demo-"
# Files a finished `write_tiny_checkpoint` directory holds; anything less is an interrupted build.
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


class Interrupted(Exception):
    """A signal asked the demo to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _say(message: str, err: bool = False) -> None:
    """Print, ignoring a closed stdout (`scripts/demo | tee` whose tee died with the Ctrl-C):
    stopping what the demo started matters more than telling about it."""
    with contextlib.suppress(OSError):
        click.echo(message, err=err)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _hold_signals() -> None:
    """While cleaning up, a second Ctrl-C must not abandon the children half-stopped."""
    for s in HANDLED_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _load_prctl():
    """libc's prctl, looked up in the parent (a preexec_fn must not run ldconfig); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """preexec_fn of every child: SIGTERM it when the demo process dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kiln_cli.main", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_runner(port: int, procs: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        health = _health(port)
        if health and health.get("runner"):
            return
        for name, proc in procs.items():
            if proc.poll() is not None:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise click.ClickException(f"`kiln {name}` exited with {proc.returncode}:\n{tail}")
        time.sleep(0.5)
    raise click.ClickException(f"the worker did not register within {START_TIMEOUT_S}s; see {logs}")


def model_is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in MODEL_FILES)


def describe_preset(preset: str) -> str:
    """`preset small (hidden 256, 8 layers, full vocabulary)`: the shape a preset draws."""
    from kiln_train.model.tiny import PRESETS

    shape = PRESETS[preset]
    return f"preset {preset} (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, full vocabulary)"


def ensure_model(model_dir: Path, preset: str) -> None:
    """Build the random checkpoint once per root, atomically (staging directory + rename)."""
    from kiln_train.data.packaged_tokenizer import cached_tokenizer
    from kiln_train.model.tiny import write_tiny_checkpoint

    if model_is_complete(model_dir):
        _say(f"reusing the random checkpoint in {model_dir} (built on the first run)")
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in model_dir.parent.glob(f".{model_dir.name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a build that was killed outright
    if model_dir.exists():
        _say(f"{model_dir} is incomplete (an interrupted build); rebuilding it")
        shutil.rmtree(model_dir)
    _say(
        f"building a random Qwen3.5 checkpoint, {describe_preset(preset)}, in {model_dir} (once per root) ..."
    )
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.staging-", dir=model_dir.parent))
    try:
        write_tiny_checkpoint(staging, preset=preset, seed=0, tokenizer=cached_tokenizer())
        staging.chmod(0o755)
        staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _open_jobs(client: ApiClient) -> list[dict]:
    try:
        return [j for j in client.get("/v1/train/status") if j["state"] not in TERMINAL_STATES]
    except (ApiError, ApiUnreachable):
        return []


def _cancel(client: ApiClient, job_id: str) -> bool:
    try:
        client.delete(f"/v1/train/queue/{quote_segment(job_id)}")
        return True
    except ApiError as err:
        return err.code == "training_job_not_cancellable"  # it finished meanwhile
    except ApiUnreachable:
        return False


def cancel_leftovers(db_url: str) -> None:
    """Cancel the jobs an earlier demo run in this root left unfinished (it was killed before it
    could cancel them), before this run's worker starts, so none of them runs ahead of this
    run's job. A queued one ends at once; a running one (its worker died with its demo) stops at
    its first step boundary once the reconciler hands it on."""
    from kiln.store import list_jobs as store_jobs
    from kiln.store import make_engine, request_cancel, session_factory, states
    from kiln_train.errors import KilnError

    engine = make_engine(db_url)
    try:
        sessions = session_factory(engine)
        with sessions.begin() as session:
            leftovers = [
                (job.id, job.adapter_name, job.state)
                for job in store_jobs(session)
                if job.state in (states.QUEUED, states.RUNNING)
                and job.adapter_name.startswith(ADAPTER_PREFIX)
            ]
        for job_id, adapter, state in leftovers:
            try:
                with sessions.begin() as session:
                    request_cancel(session, job_id)
            except KilnError:
                continue  # it finished meanwhile
            _say(f"cancelled job {job_id} ({adapter}), left {state} by an interrupted demo")
    finally:
        engine.dispose()


def cancel_own_job(client: ApiClient, adapter_name: str) -> None:
    """Cancel this run's job and wait (bounded) until it stopped at a step boundary."""
    for job in _open_jobs(client):
        if job.get("adapter_name") != adapter_name:
            continue
        job_id = job["job_id"]
        if not _cancel(client, job_id):
            continue
        deadline = time.monotonic() + CANCEL_WAIT_S
        state = job["state"]
        while time.monotonic() < deadline:
            try:
                status = client.get(f"/v1/train/status/{quote_segment(job_id)}")
            except (ApiError, ApiUnreachable):
                break
            state = status["state"]
            if state in TERMINAL_STATES:
                _say(
                    f"cancelled job {job_id} at step {status.get('global_step')}/{status.get('total_steps')}"
                )
                break
            time.sleep(0.5)
        else:
            _say(f"job {job_id} is still {state}; the worker stops it as it shuts down")


def preset_option(help_text: str) -> Callable:
    """`--preset tiny|small`: the shape of the random model built when none is configured."""
    return click.option(
        "--preset", type=click.Choice(["tiny", "small"]), default="small", show_default=True, help=help_text
    )


def register(cli: click.Group) -> None:
    @cli.command("demo")
    @click.option(
        "--root",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".kiln-demo"),
        show_default=True,
        help="Storage root for the demo (models, adapters, SQLite files, logs).",
    )
    @click.option(
        "--data",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=DEMO_DATA,
        show_default=True,
        help="Conversations to train on (JSONL).",
    )
    @preset_option("Random Qwen3.5 shape to build (small: hidden 256, 8 layers, full vocabulary).")
    @click.option("--epochs", type=click.IntRange(min=1), default=DEMO_RUN["epochs"], show_default=True)
    def demo(root: Path, data: Path, preset: str, epochs: int) -> None:
        """Run api + worker on embedded defaults, train the demo adapter over HTTP, then stop.

        Ctrl-C cancels the job, stops the api and the worker and exits 130."""
        try:
            with _signals_raise():
                code = run_demo(root, data.resolve(), preset, epochs)
        except Interrupted as exc:
            _say(f"demo interrupted ({exc}); nothing it started is left running", err=True)
            sys.exit(128 + exc.signum)
        if code != 0:
            sys.exit(code)


def run_demo(root: Path, data: Path, preset: str, epochs: int) -> int:
    """The demo itself; an Interrupted raised anywhere in it still stops what it started."""
    root = root.resolve()
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    # One stack per root: another demo or a `kiln up` on it would share its store and broker
    # and could take this demo's job to a different model (kiln_cli/stack_lock.py).
    with stack_lock(root, "kiln demo", f"http://127.0.0.1:{port}/"):
        return _run_demo_locked(root, logs, data, preset, epochs, port)


def _run_demo_locked(root: Path, logs: Path, data: Path, preset: str, epochs: int, port: int) -> int:
    from kiln.store import upgrade_database

    model_dir = root / "models" / f"kiln-{preset}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        {
            "KILN_STORAGE_ROOT": str(root),
            "KILN_MODEL_PATH": str(model_dir),
            "KILN_MODEL_DEVICE": "cpu",
            "KILN_SERVER_HOST": "127.0.0.1",
            "KILN_SERVER_PORT": str(port),
            "KILN_SERVER_WORKERS": "1",
            "KILN_TRAINING_HEARTBEAT_SECONDS": "2",
            # A job whose worker was killed with its demo is reaped within seconds, not minutes.
            "KILN_TRAINING_LEASE_SECONDS": "20",
            "KILN_TRAINING_RECONCILE_INTERVAL_SECONDS": "5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    timer = Stopwatch()
    ensure_model(model_dir, preset)
    timer.lap("model")
    db_url = f"sqlite:///{root / 'kiln.db'}"
    if not (root / "kiln.db").exists():
        _say(f"initialising the job database {root / 'kiln.db'}")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # not a line per migration
    upgrade_database(db_url)
    cancel_leftovers(db_url)
    name = ADAPTER_PREFIX + datetime.now(UTC).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    client = ApiClient(Connection(f"http://127.0.0.1:{port}"), timeout=10)
    _say(f"starting kiln serve (127.0.0.1:{port}) and kiln worker; logs in {logs}")
    procs: dict[str, subprocess.Popen] = {}
    submit: subprocess.Popen | None = None
    interrupted: Interrupted | None = None
    code = 1
    try:
        procs["serve"] = _spawn(["serve"], env, logs / "serve.log")
        procs["worker"] = _spawn(["worker"], env, logs / "worker.log")
        _wait_for_runner(port, procs, logs)
        timer.lap("api and worker start")
        args = [
            sys.executable, "-m", "kiln_cli.main", "train", "sft",
            "--url", f"http://127.0.0.1:{port}",
            "--data", str(data),
            "--epochs", str(epochs),
            "--rank", str(DEMO_RUN["lora_rank"]),
            "--alpha", f"{DEMO_RUN['lora_alpha']:g}",
            "--optimizer", DEMO_RUN["optimizer"],
            "--learning-rate", str(DEMO_RUN["learning_rate"]),
            "--seed", str(DEMO_RUN["seed"]),
            "--checkpoint-interval", str(DEMO_RUN["checkpoint_interval"]),
            "--output-name", name,
            "--adapter-smoke-test",
        ]  # fmt: skip
        # Its own session: a Ctrl-C reaches the demo only, which cancels the job instead of
        # leaving it to a server that is about to stop.
        submit = subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        code = submit.wait()
        timer.lap("training")
    except Interrupted as exc:
        interrupted = exc
    finally:
        _hold_signals()
        if submit is not None and submit.poll() is None:
            _stop([submit])
        if interrupted is not None and procs:
            _say(f"\ninterrupted ({interrupted}): cancelling the demo job ...", err=True)
            cancel_own_job(client, name)
        if procs:
            _say("stopping kiln serve and kiln worker ...")
            _stop(list(procs.values()))
    if interrupted is not None:
        raise interrupted
    if code == 0:
        _say(f"demo finished: adapter in {root / 'adapters' / name}")
        _say(trained_on(root / "adapters" / name / "train_receipt.json"))
        _say(f"demo time: {timer}")
    return code


class Stopwatch:
    """Named laps of the demo, printed as `model 41s, api and worker start 12s, training 1m 30s`."""

    def __init__(self) -> None:
        self.laps: list[tuple[str, float]] = []
        self.last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {_duration(s)}" for name, s in self.laps)


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"


def trained_on(receipt_path: Path) -> str:
    """The summary's line naming the model the demo's job ran on, from its receipt."""
    try:
        model = json.loads(receipt_path.read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"trained on: unknown (no readable receipt at {receipt_path})"
    random = model.get("random_init")
    if random:
        return (
            f"trained on {model.get('path')}: a random {random.get('preset')} checkpoint, so the run shows "
            "the mechanics, not a useful model (kiln up --model-path DIR trains a real Qwen3.5)"
        )
    return f"trained on {model.get('path')}"
