"""Connection URLs are shown without their secrets: `kiln.redact.redact_url` (both forms: the
userinfo password and secret query parameters), and `kiln config show` (table and --json), which
never prints `user:password@` or `?password=` in clear."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln.redact import redact_url
from kiln_cli.main import cli


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://kiln:hunter2@db:5432/kiln", "postgresql+psycopg://kiln:***@db:5432/kiln"),
        (
            "postgresql://kiln@db/kiln?password=hunter2&sslmode=require",
            "postgresql://kiln@db/kiln?password=***&sslmode=require",
        ),
        (
            "postgresql://db/kiln?sslpassword=hunter2&PassWord=hunter3&user=me",
            "postgresql://db/kiln?sslpassword=***&PassWord=***&user=me",
        ),
        ("postgresql://db/kiln?a=1;password=hunter2", "postgresql://db/kiln?a=1;password=***"),
        ("postgresql://u:p@[::1]:5432/db?password=hunter2", "postgresql://u:***@[::1]:5432/db?password=***"),
        # SQLAlchemy reads an unescaped "/" or "?" into the password; so does the redaction.
        ("postgresql://kiln:hun/ter2@db/kiln", "postgresql://kiln:***@db/kiln"),
        ("postgresql://kiln:hun?ter2@db/kiln", "postgresql://kiln:***@db/kiln"),
        ("mysql://u:hunter%402@h/db", "mysql://u:***@h/db"),
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://user:hunter2@cache:6380/1", "rediss://user:***@cache:6380/1"),
        ("redis://cache:6379/0?password=hunter2", "redis://cache:6379/0?password=***"),
        (
            "redis://cache:6379/0?token=hunter2&access_key=hunter3",
            "redis://cache:6379/0?token=***&access_key=***",
        ),
        (
            "sentinel://:hunter2@h1:26379;sentinel://:hunter3@h2:26379",
            "sentinel://:***@h1:26379;sentinel://:***@h2:26379",
        ),
        # Nothing secret: kept as written.
        ("sqlite:////var/lib/kiln/kiln@2.db", "sqlite:////var/lib/kiln/kiln@2.db"),
        ("sqla+sqlite:////x/broker.db", "sqla+sqlite:////x/broker.db"),
        ("postgresql://kiln@db/kiln?sslmode=require#x", "postgresql://kiln@db/kiln?sslmode=require#x"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert "hunter" not in redact_url(url)


URLS = {
    "KILN_DATABASE_URL": "postgresql+psycopg://kiln:hunter2@db/kiln?sslpassword=hunter3",
    "KILN_QUEUE_BROKER_URL": "redis://cache:6379/0?password=hunter4",
}


def test_config_show_never_prints_a_url_password(tmp_path):
    env = {"KILN_CONFIG": "", "KILN_STORAGE_ROOT": str(tmp_path), **URLS}
    as_json = CliRunner().invoke(cli, ["config", "show", "--json"], env=env)
    assert as_json.exit_code == 0, as_json.output
    assert "hunter" not in as_json.output
    rows = {r["key"]: r for r in json.loads(as_json.output)["settings"]}
    assert rows["database.url"]["value"] == "postgresql+psycopg://kiln:***@db/kiln?sslpassword=***"
    assert rows["database.url"]["source"] == "env:KILN_DATABASE_URL"
    assert rows["derived.database_url"]["value"] == rows["database.url"]["value"]
    assert rows["queue.broker_url"]["value"] == "redis://cache:6379/0?password=***"
    assert rows["derived.broker_url"]["value"] == rows["queue.broker_url"]["value"]
    table = CliRunner().invoke(cli, ["config", "show"], env=env)
    assert table.exit_code == 0 and "hunter" not in table.output
    assert '"postgresql+psycopg://kiln:***@db/kiln?sslpassword=***"  [env:KILN_DATABASE_URL]' in table.output


def test_config_show_of_the_defaults_shows_no_url_setting(tmp_path):
    env = {"KILN_CONFIG": "", "KILN_STORAGE_ROOT": str(tmp_path)}
    result = CliRunner().invoke(cli, ["config", "show", "--json"], env=env)
    rows = {r["key"]: r for r in json.loads(result.output)["settings"]}
    assert rows["database.url"]["value"] is None
    assert rows["derived.database_url"]["value"] == f"sqlite:///{tmp_path.resolve() / 'kiln.db'}"
