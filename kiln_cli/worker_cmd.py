"""`kiln worker` (the resident GPU worker) and `kiln health worker` (its container healthcheck).

Torch is imported only inside the worker command: the model is loaded in the very process that
trains (Celery solo pool), so CUDA is never touched before that process exists.
"""

from __future__ import annotations

import sys
import time

import click

from kiln.settings import ConfigError
from kiln_cli.config_cmd import load_or_exit
from kiln_cli.service_cmd import check_schema, database_errors, ensure_dirs_or_exit, health_group, root_option


def register(cli: click.Group) -> None:
    register_worker(cli)
    register_health_worker(health_group(cli))


def register_worker(cli: click.Group) -> None:
    @cli.command("worker")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml.")
    @root_option
    @click.option(
        "--model-path", default=None, help="Hugging Face Qwen3.5 checkpoint directory (model.path)."
    )
    @click.option("--device", default=None, help="cpu, cuda or cuda:N (model.device).")
    @click.option("--upgrade-db", is_flag=True, help="Run the database migrations before starting.")
    def worker_command(
        config_file: str | None,
        root: str | None,
        model_path: str | None,
        device: str | None,
        upgrade_db: bool,
    ) -> None:
        """Run the resident training worker: one process, one device, one job at a time. Another
        worker on a running stack's root (and its settings) adds capacity to it."""
        flags = {"storage.root": root, "model.path": model_path, "model.device": device}
        loaded = load_or_exit(config_file, cli=flags)
        settings = loaded.settings
        ensure_dirs_or_exit("worker", settings)
        try:
            with database_errors("worker", settings):
                if upgrade_db:
                    from kiln.store import upgrade_database

                    upgrade_database(settings.database_url)
                check_schema(settings)
        except ConfigError as exc:
            click.echo(f"kiln worker: {exc}", err=True)
            sys.exit(2)
        run_worker(settings)


def run_worker(settings) -> None:
    from celery import signals

    from kiln_train.errors import KilnError
    from kiln_train.plan.budget import apply_cpu_allocator_policy
    from kiln_train.train.resident import load_resident, missing_device
    from kiln_train.train.warmup import warm_up
    from worker.celery_app import make_celery
    from worker.runtime import WorkerRuntime
    from worker.tasks import install_runtime

    if not (settings.model_path / "config.json").is_file():
        click.echo(
            f"kiln worker: no model at {settings.model_path}; set model.path (KILN_MODEL_PATH) or build a tiny "
            "one with `kiln model init-tiny DIR`",
            err=True,
        )
        sys.exit(2)
    device_problem = missing_device(
        settings.model.device,
        "use --device cpu (KILN_MODEL_DEVICE=cpu) or run the worker where a GPU is visible",
    )
    if device_problem:
        click.echo(f"kiln worker: model.device is {settings.model.device}, but {device_problem}", err=True)
        sys.exit(2)
    click.echo(f"loading {settings.model_path} on {settings.model.device} ...")
    t0 = time.perf_counter()
    if settings.model.device == "cpu":
        apply_cpu_allocator_policy()  # freed tensors go back to the OS: what the cpu estimate assumes
    try:
        resident = load_resident(
            settings.model_path,
            device=settings.model.device,
            server_config={"memory": settings.memory.model_dump(mode="json")},
        )
    except (KilnError, OSError) as exc:
        # A directory that is not a complete Qwen3.5 checkpoint (no tokenizer.json, a foreign
        # config.json, unreadable weights) or a device that is not there.
        reason = getattr(exc, "message", None) or (exc.strerror if isinstance(exc, OSError) else None) or exc
        click.echo(f"kiln worker: cannot load the model at {settings.model_path}: {reason}", err=True)
        sys.exit(2)
    warm_up(resident)
    click.echo(
        f"model resident in {time.perf_counter() - t0:.1f}s; identity {resident.execution_identity_digest}"
    )
    celery_app = make_celery(settings)
    runtime = WorkerRuntime(settings, resident, celery=celery_app)
    install_runtime(runtime)
    runtime.start()
    signals.worker_shutting_down.connect(lambda **_: runtime.request_shutdown(), weak=False)
    try:
        celery_app.worker_main(
            [
                "worker",
                "--pool=solo",
                "--concurrency=1",
                "--queues",
                settings.queue.queue_name,
                "--hostname",
                f"kiln-{runtime.worker_id}@%h",
                "--task-events",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=INFO",
            ]
        )
    finally:
        runtime.stop()


def register_health_worker(health: click.Group) -> None:
    @health.command("worker")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml.")
    @click.option(
        "--max-age", type=float, default=60.0, show_default=True, help="Seconds since the last heartbeat."
    )
    def health_worker(config_file: str | None, max_age: float) -> None:
        """Exit 0 when this host's worker wrote its heartbeat file within --max-age seconds."""
        from worker.runner import heartbeat_file

        path = heartbeat_file(load_or_exit(config_file).settings)
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            click.echo(f"unhealthy: no heartbeat file at {path}", err=True)
            sys.exit(1)
        if age > max_age:
            click.echo(f"unhealthy: last heartbeat {age:.0f}s ago (> {max_age:.0f}s)", err=True)
            sys.exit(1)
        click.echo(f"healthy: last heartbeat {age:.1f}s ago")
