"""The ``console_server`` fixture itself, with a stand-in for ``kafka-idem console`` (a
small HTTP server with the console's ``/healthz?ready=1``): it passes the app, the port,
the arguments and the environment, waits for readiness, reports a console that ends or
never gets ready with its stderr, and stops it with SIGTERM (SIGKILL if it must)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tests.console.conftest as console
from tests.conftest import ADMIN_DSN, BOOTSTRAP, DB, ROOT, dsn_for

STAND_IN = r'''
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ.get("STAND_IN_MODE", "ok")
names = ("KAFKA_IDEM_DATABASE_URL", "KAFKA_IDEM_BOOTSTRAP_SERVERS", "PYTHONPATH",
         "STAND_IN_EXTRA", "STAND_IN_GONE")
with open(os.environ["STAND_IN_RECORD"], "w") as f:
    json.dump({"argv": args, "cwd": os.getcwd(),
               "env": {k: os.environ.get(k) for k in names}}, f)
if mode == "crash":
    print("boom: the app does not import", file=sys.stderr)
    sys.exit(3)
ready_at = time.monotonic() + 0.5

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/healthz?ready=1":
            ok = mode != "never" and time.monotonic() >= ready_at
            body = b'{"ready": true}' if ok else b'{"ready": false}'
            self.send_response(200 if ok else 503)
        else:
            body = b"not found"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=server.shutdown).start())
print("serving", file=sys.stderr, flush=True)
server.serve_forever()
print("stopped", file=sys.stderr, flush=True)
'''


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], dict[str, Any]]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    record = tmp_path / "record.json"
    monkeypatch.setattr(console, "CONSOLE_COMMAND", [sys.executable, str(script)])
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    return lambda: json.loads(record.read_text())


def test_the_console_gets_its_app_port_args_and_env_and_is_waited_for(
        console_server: Callable[..., console.ConsoleServer],
        stand_in: Callable[[], dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_GONE", "inherited")
    server = console_server("tests.apps.stock:app", args=("--read-only",),
                            env={"STAND_IN_EXTRA": "1", "STAND_IN_GONE": None})
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert server.get("/healthz?ready=1") == (200, b'{"ready": true}')
    assert server.get("/nope")[0] == 404
    seen = stand_in()
    assert seen["argv"] == ["tests.apps.stock:app", "--port", str(server.port), "--read-only"]
    assert seen["cwd"] == str(ROOT)
    env = seen["env"]
    assert env["KAFKA_IDEM_DATABASE_URL"] == ADMIN_DSN
    assert env["KAFKA_IDEM_BOOTSTRAP_SERVERS"] == BOOTSTRAP
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert env["STAND_IN_EXTRA"] == "1" and env["STAND_IN_GONE"] is None
    assert server.stop() == 0
    assert "stopped" in server.stderr_text()


def test_a_database_and_a_pythonpath_of_the_test(
        console_server: Callable[..., console.ConsoleServer],
        stand_in: Callable[[], dict[str, Any]], tmp_path: Path) -> None:
    console_server("app:app", db=DB("kafka_idem_t_x"), env={"PYTHONPATH": str(tmp_path)})
    env = stand_in()["env"]
    assert env["KAFKA_IDEM_DATABASE_URL"] == dsn_for("kafka_idem_t_x")
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path), str(ROOT)]


def test_a_console_that_ends_before_it_is_ready_fails_the_test_with_its_stderr(
        console_server: Callable[..., console.ConsoleServer], stand_in: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_MODE", "crash")
    with pytest.raises(pytest.fail.Exception,
                       match=r"(?s)exited with 3 before it was ready.*boom: the app"):
        console_server("tests.apps.stock:app")


def test_a_console_that_never_gets_ready_is_stopped_and_fails_the_test(
        console_server: Callable[..., console.ConsoleServer], stand_in: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_MODE", "never")
    monkeypatch.setattr(console, "CONSOLE_READY_TIMEOUT", 1.0)
    with pytest.raises(pytest.fail.Exception,
                       match=r"(?s)not ready .* within 1s \(last: 503 .*serving"):
        console_server("tests.apps.stock:app")


def test_a_console_deaf_to_sigterm_is_killed(
        console_server: Callable[..., console.ConsoleServer], stand_in: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_MODE", "stubborn")
    monkeypatch.setattr(console, "CONSOLE_STOP_TIMEOUT", 0.5)
    server = console_server("tests.apps.stock:app")
    assert server.stop() is None and server.killed
    assert server.proc.returncode == -9
