"""Loopback and Host names in the settings: the bind check parses addresses, and
`server.allowed_hosts` / `server.max_concurrent_admissions` follow the settings conventions."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kiln.settings import (
    ConfigError,
    ServerSettings,
    check_bind_safety,
    host_name,
    is_loopback_host,
    load_settings,
)
from kiln_cli.main import cli


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0:0:0:0:0:0:0:1", True),
        ("::ffff:127.0.0.1", True),
        ("127.attacker.example", False),
        ("127.0.0.1.nip.io", False),
        ("localhost.attacker.example", False),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("kiln.internal", False),
    ],
)
def test_loopback_is_parsed_not_prefix_matched(host, loopback):
    assert is_loopback_host(host) is loopback


def test_serve_refuses_a_name_that_only_starts_like_loopback(tmp_path):
    result = CliRunner().invoke(
        cli,
        ["serve", "--host", "127.attacker.example"],
        env={"KILN_CONFIG": "", "KILN_STORAGE_ROOT": str(tmp_path)},
    )
    assert result.exit_code == 2
    assert "server.host=127.attacker.example is not a loopback address" in result.output
    with pytest.raises(ConfigError, match="not a loopback address"):
        check_bind_safety(load_settings(environ={"KILN_SERVER_HOST": "127.attacker.example"}).settings)


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8420", "localhost"),
        ("LocalHost", "localhost"),
        ("[::1]:8420", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("127.0.0.1:1", "127.0.0.1"),
        ("evil.example:80:80", "evil.example:80:80"),
        ("[::1]junk", "[::1]junk"),
    ],
)
def test_host_name_drops_the_port_and_brackets(header, name):
    assert host_name(header) == name


def test_allowed_hosts_default_follows_the_bind_and_the_tokens():
    assert ServerSettings().allowed_host_names() == {"localhost", "127.0.0.1", "::1"}
    assert ServerSettings(host="127.0.0.2").allowed_host_names() == {
        "localhost",
        "127.0.0.1",
        "::1",
        "127.0.0.2",
    }
    assert ServerSettings(host="0.0.0.0", allow_unauthenticated_remote=True).allowed_host_names() is None
    assert ServerSettings(api_tokens=["t"]).allowed_host_names() is None
    assert ServerSettings(allowed_hosts=["Kiln.Internal", "[::1]"]).allowed_host_names() == {
        "kiln.internal",
        "::1",
    }
    assert ServerSettings(allowed_hosts=["*"]).allowed_host_names() is None


def test_allowed_hosts_from_the_environment_and_toml(tmp_path):
    env = load_settings(environ={"KILN_SERVER_ALLOWED_HOSTS": "kiln.lan, 10.0.0.5"}, cwd=tmp_path)
    assert env.settings.server.allowed_hosts == ["kiln.lan", "10.0.0.5"]
    assert env.sources["server.allowed_hosts"] == "env:KILN_SERVER_ALLOWED_HOSTS"
    unset = load_settings(environ={"KILN_SERVER_ALLOWED_HOSTS": ""}, cwd=tmp_path)
    assert unset.settings.server.allowed_hosts is None
    (tmp_path / "kiln.toml").write_text(
        '[server]\nallowed_hosts = ["kiln.lan"]\nmax_concurrent_admissions = 3\n'
    )
    toml = load_settings(cwd=tmp_path, environ={})
    assert toml.settings.server.allowed_hosts == ["kiln.lan"]
    assert toml.settings.server.max_concurrent_admissions == 3


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"KILN_SERVER_ALLOWED_HOSTS": '["http://kiln.lan"]'}, "is not a host name or IP address"),
        ({"KILN_SERVER_ALLOWED_HOSTS": '["kiln.lan/x"]'}, "is not a host name or IP address"),
        ({"KILN_SERVER_ALLOWED_HOSTS": "[]"}, "must name at least one host"),
        ({"KILN_SERVER_MAX_CONCURRENT_ADMISSIONS": "0"}, "server.max_concurrent_admissions"),
        ({"KILN_SERVER_MAX_CONCURRENT_ADMISSIONS": "65"}, "server.max_concurrent_admissions"),
    ],
)
def test_bad_front_door_settings_stop_start_up(values, fragment, tmp_path):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_settings(environ=values, cwd=tmp_path)
