"""How the client commands reach the api and report its answers: the URL from the settings or
--url, bearer tokens, a refused connection (exit 3), the envelope of a 503 with Retry-After, and
an error page that is not Kiln's."""

from __future__ import annotations

import json
import threading

from werkzeug.serving import make_server

from kiln_cli.http_client import settings_url
from tests.api.conftest import example
from tests.kiln_cli.api_server import TOKEN, api_server, write_jsonl
from tests.worker.stack import free_port


def test_connection_refused_exits_3_naming_the_url(kiln):
    url = f"http://127.0.0.1:{free_port()}"
    for args in (("jobs", "list"), ("adapters", "list"), ("jobs", "show", "x")):
        code, out, err = kiln(*args, url=url)
        assert code == 3 and out == ""
        assert f"is Kiln running at {url}? Start it with `kiln up`" in err and "Connection refused" in err


def test_the_url_comes_from_the_settings(kiln, server, tmp_path):
    config = tmp_path / "kiln.toml"
    config.write_text(f'[server]\nhost = "0.0.0.0"\nport = {server.port}\n', encoding="utf-8")
    code, out, err = kiln("jobs", "list", "--json", "--config", str(config), url=None)
    assert code == 0, err
    assert isinstance(json.loads(out), list)
    assert settings_url("0.0.0.0", 8420) == "http://127.0.0.1:8420"
    assert settings_url("::", 9000) == "http://[::1]:9000"
    assert settings_url("fd00::5", 1) == "http://[fd00::5]:1"
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 0\n", encoding="utf-8")
    code, _out, err = kiln("jobs", "list", "--config", str(bad), url=None)
    assert code == 2 and "server.port" in err


def test_the_bearer_token_is_sent(kiln, secured, tmp_path):
    code, out, err = kiln("jobs", "list", url=secured.url)
    assert code == 1 and out == ""
    assert "kiln: unauthorized (HTTP 401): missing bearer token" in err
    assert "hint: Send `Authorization: Bearer <token>`" in err

    code, out, err = kiln("jobs", "list", "--json", "--token", TOKEN, url=secured.url)
    assert code == 0, err
    assert secured.recorder.requests[-1].authorization == f"Bearer {TOKEN}"

    code, out, err = kiln("adapters", "list", "--json", url=secured.url, env={"KILN_API_TOKEN": TOKEN})
    assert code == 0, err
    assert secured.recorder.requests[-1].authorization == f"Bearer {TOKEN}"

    code, _out, err = kiln("jobs", "list", "--token", "wrong", url=secured.url)
    assert code == 1 and "invalid bearer token" in err

    # Without --url the first of server.api_tokens goes with the settings' own address ...
    config = tmp_path / "kiln.toml"
    config.write_text(f'[server]\nport = {secured.port}\napi_tokens = ["{TOKEN}"]\n', encoding="utf-8")
    code, _out, err = kiln("jobs", "list", "--config", str(config), url=None)
    assert code == 0, err
    assert secured.recorder.requests[-1].authorization == f"Bearer {TOKEN}"
    # ... but never to a URL given by hand.
    code, _out, err = kiln("jobs", "list", "--config", str(config), url=secured.url)
    assert code == 1 and "missing bearer token" in err


def test_no_runner_is_a_503_with_retry_after(kiln, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    with api_server(tmp_path / "api", None) as bare:
        code, out, err = kiln("train", "sft", "--data", str(data), "--no-wait", url=bare.url)
    assert code == 1 and out == ""
    assert err.startswith("kiln: training_no_runner (HTTP 503): no live training runner")
    assert "  hint: Start a worker (`kiln worker`)" in err
    assert "  retry after: 10 s" in err


def test_a_non_kiln_error_page_is_reported_with_its_status(kiln):
    def bad_gateway(environ, start_response):
        start_response("502 Bad Gateway", [("Content-Type", "text/html")])
        return [b"<html>upstream down</html>"]

    proxy = make_server("127.0.0.1", 0, bad_gateway)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        code, _out, err = kiln("jobs", "list", url=f"http://127.0.0.1:{proxy.server_port}")
    finally:
        proxy.shutdown()
        thread.join()
    assert code == 1
    assert "kiln: http_502 (HTTP 502): " in err and "<html>upstream down</html>" in err
