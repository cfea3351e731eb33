"""`docker compose up` for real: the repository's images built from its Dockerfiles, the stack of
docker-compose.yml + deploy/compose.cpu.yml brought up by docker-compose against a Docker-API
engine (Debian's podman), used over HTTP and SQL, and brought down leaving nothing behind
(docs/deployment.md#the-compose-end-to-end-test).

In order: the api refuses a database that migrate has not run on; migrate waits for a database
that is not up yet; `up` brings every service to healthy; only the api and Flower are published,
on loopback; a job submitted over HTTP trains to an adapter that downloads and loads; Flower asks
for basic auth and lists the worker; every query of deploy/queries.sql answers for that job in
the compose Postgres; `down -v` removes the stack and the engine leaves no container, volume,
network, firewall rule, link or process on the host.

Needs root and Debian's podman, debootstrap, iptables and docker-compose (scripts/test installs
them). It fails, never skips, when the engine cannot be set up; it skips only on a machine whose
kernel refuses the namespaces every container needs. `-m "not compose"` deselects it.
"""

from __future__ import annotations

import base64
import csv
import fcntl
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.numpy import load as load_safetensors

from kiln.store import head_revision
from tests.deploy import stand_in_images
from tests.deploy.compose_project import (
    ROOT,
    ComposeProject,
    Timings,
    copy_working_tree,
    fetch_cpu_torch_wheel,
    link_or_copy,
)
from tests.deploy.host_state import (
    HostState,
    capture,
    differences,
    end_processes,
    processes_using,
    remove_added_rules,
)
from tests.deploy.podman_engine import REQUIRED_TOOLS, HealthChecks, PodmanEngine
from tests.deploy.queries_sql import QUERIES

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(1800)]

CACHE = Path(os.environ.get("KILN_COMPOSE_E2E_CACHE", "/var/tmp/kiln-compose-e2e"))
LOCK_WAIT_S = 1500  # another checkout's run of this test holds the engine's storage
SERVICES = ["postgres", "redis", "api", "worker-cpu", "flower"]
DEMO_ROWS = ROOT / "examples" / "demo.jsonl"
ROWS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_container_support() -> None:
    """Fail when the engine cannot be set up; skip only when this kernel cannot run containers."""
    probe = subprocess.run(
        ["unshare", "--mount", "--uts", "--ipc", "--net", "--pid", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if os.geteuid() == 0 and probe.returncode != 0:
        pytest.skip(f"this machine cannot run containers (no new namespaces: {probe.stderr.strip()})")
    if os.geteuid() != 0:
        pytest.fail("the compose end-to-end test needs root (rootful podman, debootstrap, iptables)")
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if shutil.which(tool) is None})
    if missing:
        pytest.fail(
            f"missing Debian packages: apt-get install {' '.join(missing)} (scripts/test installs them)"
        )


@contextmanager
def exclusive(lock: Path, wait_s: float) -> Iterator[None]:
    with open(lock, "a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{lock} stayed locked for {wait_s:.0f} s (another run of this test)")
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class EndToEnd:
    """The state the tests of this module share, in the order they build it."""

    def __init__(self) -> None:
        self.engine = PodmanEngine(CACHE)
        self.timings = Timings()
        self.host_before: HostState | None = None
        self.project: ComposeProject | None = None
        self.health: HealthChecks | None = None
        self.settings: dict[str, str] = {}
        self.up = False
        self.job: dict | None = None
        self.torn_down = False
        self.image_sizes: dict[str, int] = {}
        self.build_output = ""
        self.started = time.monotonic()

    def prepare(self) -> None:
        with self.timings.stage("engine start"):
            self.engine.start()
        with self.timings.stage("debian base (debootstrap + import)"):
            stand_in_images.ensure_debian_base(self.engine, CACHE / "work")
        with self.timings.stage("stand-in images (python, redis, postgres)"):
            stand_in_images.build_stand_ins(self.engine)
        with self.timings.stage("torch CPU wheel + build context"):
            wheel = fetch_cpu_torch_wheel(CACHE / "wheels")
            context = CACHE / "context"
            copy_working_tree(context)
            link_or_copy(wheel, context / "deploy" / "wheels" / wheel.name)
        name = f"kilne2e{os.getpid()}"
        self.settings = {
            "POSTGRES_USER": "kiln",
            "POSTGRES_PASSWORD": f"pg-{secrets.token_hex(8)}",
            "POSTGRES_DB": "kiln",
            "KILN_API_TOKENS": f"tok-{secrets.token_hex(12)}",
            "FLOWER_BASIC_AUTH": f"admin:fl-{secrets.token_hex(8)}",
            "KILN_API_PORT": str(free_port()),
            "FLOWER_PORT": str(free_port()),
            "KILN_POSTGRES_IMAGE": stand_in_images.POSTGRES.tag,
            "KILN_TORCH_SPEC": "torch==2.13.0+cpu",
        }
        self.project = ComposeProject(self.engine, context, name, self.settings)
        with self.timings.stage("project images (docker-compose build)"):
            # One build per image: migrate and flower run the api's image (kiln-api:local).
            built = self.project.run("build", "api", "worker-cpu", timeout=1800)
        self.build_output = built.stdout + built.stderr
        self.health = HealthChecks(self.engine, name)
        self.health.start()

    def api(self, method: str, path: str, body: dict | None = None, token: bool = True):
        url = f"http://127.0.0.1:{self.settings['KILN_API_PORT']}{path}"
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {self.settings['KILN_API_TOKENS']}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read()

    def flower(self, path: str, auth: bool) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.settings['FLOWER_PORT']}{path}"
        headers = {}
        if auth:
            headers["Authorization"] = (
                "Basic " + base64.b64encode(self.settings["FLOWER_BASIC_AUTH"].encode()).decode()
            )
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def psql(self, script: str, **variables: str) -> str:
        """A psql script run in the postgres container (CSV output)."""
        args = [f"--variable={k}={v}" for k, v in variables.items()]
        user, db = self.settings["POSTGRES_USER"], self.settings["POSTGRES_DB"]
        done = self.project.run(
            "exec", "-T", "postgres", "psql", "-U", user, "-d", db, "--csv", "--variable=ON_ERROR_STOP=1",
            *args, "--file=-", timeout=120, input=script,
        )  # fmt: skip
        return done.stdout

    def teardown(self) -> list[str]:
        """Bring the stack down with its volumes, stop the engine and undo what it did to the host;
        return what was still there (empty when everything went as it should)."""
        if self.torn_down:
            return []
        self.torn_down = True
        problems = []
        if self.health is not None:
            self.health.stop()
        if self.project is not None and self.engine.service is not None:
            with self.timings.stage("down -v"):
                done = self.project.run(
                    "down", "--volumes", "--remove-orphans", "--timeout", "60", timeout=300, check=False
                )
            if done.returncode != 0:
                problems.append(f"down: exit {done.returncode}: {done.stderr[-2000:]}")
            left = self.engine.inventory()
            problems += [f"{kind} left after down: {names}" for kind, names in left.items() if names]
            self.engine.remove_everything()
            # Images an earlier run built and this one replaced: the cache keeps only current ones.
            self.engine.podman("image", "prune", "--force", timeout=300, check=False)
        self.engine.stop()
        # conmon processes of finished exec sessions linger for containers.conf's exit_command_delay.
        before = self.host_before.pids if self.host_before is not None else frozenset()
        deadline = time.monotonic() + 30
        while set(processes_using(str(CACHE))) - before and time.monotonic() < deadline:
            time.sleep(1)
        stray = {pid: cmd for pid, cmd in processes_using(str(CACHE)).items() if pid not in before}
        problems += [f"process {pid} still running: {cmd[:200]}" for pid, cmd in stray.items()]
        end_processes(list(stray))
        if self.host_before is not None:
            remove_added_rules(self.host_before)
            problems += differences(self.host_before, str(CACHE))
        self.write_record(problems)
        return problems

    def write_record(self, problems: list[str]) -> None:
        """Stage times and image sizes of this run, in the cache directory (`last-run.json`)."""
        record = {
            "total_s": round(time.monotonic() - self.started, 1),
            "stages_s": self.timings.stages,
            "image_bytes": self.image_sizes,
            "problems": problems,
        }
        (CACHE / "last-run.json").write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record, indent=2))


@pytest.fixture(scope="module")
def e2e() -> Iterator[EndToEnd]:
    require_container_support()
    CACHE.mkdir(parents=True, exist_ok=True)
    with exclusive(CACHE / "lock", LOCK_WAIT_S):
        run = EndToEnd()
        run.host_before = capture(str(CACHE))
        try:
            run.prepare()
            yield run
        finally:
            run.teardown()


@pytest.fixture(autouse=True)
def logs_on_failure(request, e2e) -> Iterator[None]:
    yield
    report = getattr(request.node, "outcome_call", None)
    if report is not None and report.failed and e2e.project is not None and not e2e.torn_down:
        print(f"---- docker-compose logs of {e2e.project.name} ----\n{e2e.project.logs()}")
        if e2e.health is not None and e2e.health.failures:
            print("---- health-check driver ----\n" + "\n".join(e2e.health.failures[-10:]))


def bring_up(e2e: EndToEnd) -> None:
    if not e2e.up:
        with e2e.timings.stage("up -d"):
            e2e.project.run("up", "--detach", timeout=600)
        with e2e.timings.stage("healthy"):
            e2e.project.wait_healthy(SERVICES, timeout_s=300)
        e2e.up = True


# ----- before migrate -----------------------------------------------------------------------------


def test_the_api_refuses_to_serve_a_database_migrate_has_not_run_on(e2e):
    project = e2e.project
    with e2e.timings.stage("api against an unmigrated database"):
        project.run("up", "--detach", "postgres", timeout=300)
        project.wait_healthy(["postgres"], timeout_s=180)
        done = project.run("run", "--rm", "--no-deps", "-T", "api", timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "kiln serve: the job database is at revision <empty> but this release needs" in output
    assert "run `kiln db upgrade` first" in output
    tables = e2e.psql(
        "SELECT count(*) AS tables FROM information_schema.tables WHERE table_schema = 'public';"
    )
    assert tables.split() == ["tables", "0"]  # refused, and created nothing


def test_migrate_waits_for_a_database_that_is_not_up_yet(e2e):
    project = e2e.project
    with e2e.timings.stage("migrate waits for postgres"):
        project.run("stop", "postgres", timeout=300)
        migrate = project.popen("run", "--rm", "--no-deps", "-T", "migrate")
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(migrate.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any("kiln db upgrade: waiting for the job database" in line for line in lines):
            assert migrate.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        project.run("start", "postgres", timeout=300)
        migrate.wait(timeout=300)
        reader.join(timeout=30)
    output = "".join(lines)
    assert migrate.returncode == 0, output
    assert f"job database at revision {head_revision()}" in output


# ----- the stack ----------------------------------------------------------------------------------


def test_the_images_build_without_warnings_from_useradd(e2e):
    """A cached build shows no RUN output; a cold one shows every useradd of both images."""
    assert "useradd warning" not in e2e.build_output
    assert "Successfully tagged" in e2e.build_output or "COMMIT" in e2e.build_output


def test_up_brings_every_service_to_healthy(e2e):
    bring_up(e2e)
    migrate = e2e.project.container("migrate")["State"]
    assert (migrate["Status"], migrate["ExitCode"]) == ("exited", 0)
    status, _, body = e2e.api("GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["database"]["dialect"] == "postgresql"
    assert health["runner"]["state"] == "ready"


def host_bindings(info: dict) -> list[tuple[str, str]]:
    """(host ip, host port) of every published port of a container."""
    out = []
    for bindings in (info["NetworkSettings"].get("Ports") or {}).values():
        out += [(b.get("HostIp", ""), str(b.get("HostPort", ""))) for b in bindings or []]
    return out


def non_loopback_addresses() -> list[str]:
    done = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30)
    addresses = [line.split()[3].split("/")[0] for line in done.stdout.splitlines() if " inet " in line]
    return [a for a in addresses if not a.startswith("127.") and not a.startswith("10.89.")]


def test_only_the_api_and_flower_are_published_and_only_on_loopback(e2e):
    bring_up(e2e)
    project, settings = e2e.project, e2e.settings
    assert host_bindings(project.container("redis")) == []
    assert host_bindings(project.container("postgres")) == []
    assert host_bindings(project.container("worker-cpu")) == []
    assert host_bindings(project.container("api")) == [("127.0.0.1", settings["KILN_API_PORT"])]
    assert host_bindings(project.container("flower")) == [("127.0.0.1", settings["FLOWER_PORT"])]
    for address in non_loopback_addresses():
        for port in (settings["FLOWER_PORT"], settings["KILN_API_PORT"]):
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(3)
                s.connect((address, int(port)))


def submit_demo_job(e2e: EndToEnd) -> dict:
    rows = [json.loads(line) for line in DEMO_ROWS.read_text().splitlines() if line.strip()][:ROWS]
    name = f"e2e-{secrets.token_hex(3)}"
    body = {
        "examples": rows,
        "config": {
            "training_profile": "native_online_lora_v1",
            "epochs": 1,
            "lora_rank": 8,
            "lora_alpha": 16,
            "optimizer": {"kind": "adam_w"},
            "output_name": name,
        },
        "validation": {"holdout_percent": 25, "interval_steps": 2},
    }
    status, _, answer = e2e.api("POST", "/v1/train/sft", body)
    assert status == 200, answer
    return {**json.loads(answer), "adapter_name": name}


def test_a_job_submitted_over_http_trains_to_an_adapter_that_downloads(e2e):
    bring_up(e2e)
    with e2e.timings.stage("job (submit to completed)"):
        job = submit_demo_job(e2e)
        deadline = time.monotonic() + 900
        while True:
            _, _, body = e2e.api("GET", f"/v1/train/status/{job['job_id']}")
            status = json.loads(body)
            if status["state"] in ("completed", "failed", "cancelled"):
                break
            assert time.monotonic() < deadline, status
            time.sleep(2)
    assert status["state"] == "completed", status
    assert status["global_step"] == status["total_steps"] == job["total_steps"] > 0
    assert len(status["validation_history"]) >= 2  # the baseline and at least one evaluation
    e2e.job = {**job, **status}

    code, headers, archive = e2e.api("GET", f"/v1/adapters/{job['adapter_name']}/download")
    assert code == 200 and headers["Content-Type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    prefix = job["adapter_name"] + "/"
    assert {
        prefix + f for f in ("adapter_config.json", "adapter_model.safetensors", "train_receipt.json")
    } <= set(members)
    config = json.loads(members[prefix + "adapter_config.json"])
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    tensors = load_safetensors(members[prefix + "adapter_model.safetensors"])
    lora_b = [t for name, t in tensors.items() if "lora_B" in name]
    assert lora_b and any(abs(t).max() > 0 for t in lora_b)  # trained: B starts at zero
    receipt = json.loads(members[prefix + "train_receipt.json"])
    assert (receipt["adapter_name"], receipt["status"]) == (job["adapter_name"], "success")
    assert receipt["config"]["seed"] == job["effective_seed"]


def test_flower_asks_for_basic_auth_and_lists_the_worker(e2e):
    bring_up(e2e)
    assert e2e.flower("/", auth=False)[0] == 401
    assert e2e.flower("/", auth=True)[0] == 200
    assert e2e.flower("/healthcheck", auth=False) == (200, b"OK")  # what its health check asks
    deadline = time.monotonic() + 120
    while True:
        status, body = e2e.flower("/workers?json=1", auth=True)
        workers = json.loads(body)["data"] if status == 200 else []
        # A worker busy training sends no heartbeat, so Flower may list it offline for a while.
        if any(w["hostname"].startswith("kiln-") and w["status"] for w in workers):
            break
        assert time.monotonic() < deadline, (status, workers)
        time.sleep(3)
    assert e2e.project.health("flower") == "healthy"


def run_queries(e2e: EndToEnd, job: dict) -> dict[str, list[dict]]:
    """Every query of deploy/queries.sql in one psql session: {name: rows}."""
    script = "".join(f"\\echo @@{name}\n{sql};\n" for name, (_, sql) in QUERIES.items())
    output = e2e.psql(
        script,
        since="now() - interval '7 days'",
        job_id=f"'{job['job_id']}'",
        adapter_name=f"'{job['adapter_name']}'",
        limit="5",
    )
    answers: dict[str, list[dict]] = {}
    for section in output.split("@@")[1:]:
        name, _, table = section.partition("\n")
        answers[name.strip()] = list(csv.DictReader(io.StringIO(table)))
    return answers


def test_the_queries_of_deploy_queries_sql_answer_for_the_job(e2e):
    if e2e.job is None:
        pytest.fail("needs the job of test_a_job_submitted_over_http_trains_to_an_adapter_that_downloads")
    job = e2e.job
    answers = run_queries(e2e, job)
    assert set(answers) == set(QUERIES)
    curve = answers["loss_curve"]
    assert [int(r["global_step"]) for r in curve] == list(range(1, job["total_steps"] + 1))
    assert all(float(r["loss"]) > 0 for r in curve)
    assert [r["job_id"] for r in answers["slowest_jobs"]] == [job["job_id"]]
    assert answers["adapter_lineage"][0]["job_id"] == job["job_id"]
    assert (answers["adapter_lineage"][0]["lora_rank"], answers["adapter_lineage"][0]["optimizer_kind"]) == (
        "8",
        "adam_w",
    )
    [by_optimizer] = answers["final_loss_by_optimizer"]
    assert (by_optimizer["optimizer_kind"], by_optimizer["jobs"]) == ("adam_w", "1")
    [throughput] = answers["throughput_by_rank_optimizer"]
    assert int(throughput["steps"]) == job["total_steps"] and float(throughput["tokens_per_second"]) > 0
    [by_rank] = answers["mean_step_time_by_rank"]
    assert (by_rank["lora_rank"], int(by_rank["steps"])) == ("8", job["total_steps"])
    validation = answers["validation_curve"]
    assert validation[0]["global_step"] == "0" and len(validation) == len(job["validation_history"])
    assert answers["validation_by_job"][0]["job_id"] == job["job_id"]
    assert answers["queue_depth"] == [{"queued": "0", "oldest_submitted_at": ""}]
    for empty in ("failed_oom_last_week", "failures_by_reason", "queue", "retried_jobs", "running_jobs"):
        assert answers[empty] == [], empty


# ----- down ---------------------------------------------------------------------------------------


def test_down_removes_the_stack_and_leaves_nothing_on_the_host(e2e):
    names = ["kiln-api:local", "kiln-worker-cpu:local", *(image.tag for image in stand_in_images.STAND_INS)]
    e2e.image_sizes = e2e.engine.image_sizes([stand_in_images.BASE_IMAGE, *names])
    assert e2e.teardown() == []
