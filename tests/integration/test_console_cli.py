"""``kafka-idem console MODULE:APP`` as a real process: what it refuses to start with
(exit 2: a non-loopback address without a token, a token too short, a store never
migrated), and a running console serving real HTTP on loopback (its token, read-only)
until SIGTERM stops it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.conftest import KAFKA_IDEM, kafka_idem
from tests.conftest import ADMIN_DSN, BOOTSTRAP, DB, ROOT, empty_database, wait_for

APP = "tests.apps.consoled:app"
TOKEN = "cli-console-token-0123456789"


def env(**extra: str) -> dict[str, str]:
    return {"CONSOLED_ORDERS": f"cli-orders-{uuid.uuid4().hex[:8]}",
            "CONSOLED_REFUNDS": f"cli-refunds-{uuid.uuid4().hex[:8]}", **extra}


@pytest.mark.parametrize("addr", ["0.0.0.0", "10.1.2.3", "127.0.0.1.evil.example", "::"])
def test_an_address_other_than_loopback_needs_a_token(db: DB, addr: str) -> None:
    r = kafka_idem("console", APP, "--addr", addr, db=db, env=env(), timeout=30)
    assert r.code == 2, (r.code, r.err)
    assert "console_token" in r.err and "KAFKA_IDEM_CONSOLE_TOKEN" in r.err, r.err
    assert "--addr" in r.err


def test_a_token_too_short_is_refused_naming_the_setting(db: DB) -> None:
    r = kafka_idem("console", APP, db=db, env=env(KAFKA_IDEM_CONSOLE_TOKEN="short-token"),
                   timeout=30)
    assert r.code == 2, (r.code, r.err)
    assert "console_token" in r.err and "16 characters" in r.err, r.err
    assert "short-token" not in r.err  # a secret, even a bad one, is not echoed


def test_a_store_never_migrated_is_refused() -> None:
    with empty_database("kafka_idem_cli") as name:
        info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
        url = psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=name)
        assert info.get("dbname") != name
        r = kafka_idem("console", APP, "--database-url", url, env=env(), timeout=30)
        assert r.code == 2, (r.code, r.err)
        assert "migrate" in r.err, r.err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(url: str, **headers: str) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def running(db: DB, tmp_path: Path) -> Iterator[Any]:
    """Start ``kafka-idem console`` on a free loopback port (stopped by pid at the end)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str, **extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
        import os

        port = free_port()
        log = tmp_path / f"console-{len(procs)}.log"
        e = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP, "PYTHONPATH": str(ROOT),
             "KAFKA_IDEM_DATABASE_URL": db.dsn, **env(**extra)}
        with open(log, "wb") as out:
            proc = subprocess.Popen([*KAFKA_IDEM, "console", APP, "--port", str(port), *args],
                                    cwd=ROOT, env=e, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return fetch(f"{base}/healthz")[0] == 200
            except OSError:
                return False

        wait_for(up, timeout=60, what="the console to listen", interval=0.1)
        return proc, base, log

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_running_console_serves_http_and_stops_on_sigterm(running: Any) -> None:
    proc, base, log = running("--actor", "ops")
    assert fetch(f"{base}/healthz?ready=1")[0] in (200, 503)
    status, body = fetch(f"{base}/records")
    assert status == 200 and "ops" in body
    status, _ = fetch(f"{base}/records", Host="evil.example")  # DNS rebinding
    assert status == 403
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    took = time.monotonic() - started
    assert code == 0, (code, log.read_text())  # a graceful stop, as kafka-idem run's
    assert took < 15, took
    text = log.read_text()
    assert "kafka-idem console of app consoled: http://127.0.0.1:" in text
    assert "Traceback" not in text, text


def test_a_running_console_with_a_token_and_read_only(running: Any) -> None:
    proc, base, log = running("--read-only", KAFKA_IDEM_CONSOLE_TOKEN=TOKEN)
    assert "(read-only) (token required)" in log.read_text()
    assert fetch(f"{base}/records")[0] == 401
    assert fetch(f"{base}/records", Authorization=f"Bearer {TOKEN}x")[0] == 401
    status, body = fetch(f"{base}/records", Authorization=f"Bearer {TOKEN}")
    assert status == 200 and 'id="read-only"' in body and 'method="post" action="/rerun' not in body
    req = urllib.request.Request(f"{base}/rerun/dry-run", data=b"kind=permanent&csrf=x",
                                 headers={"Authorization": f"Bearer {TOKEN}"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 403
    assert TOKEN not in log.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
