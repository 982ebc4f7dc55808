"""How the installed ``kafka-idem`` fails: one line ``error: ...`` on stderr with a
documented exit code (2 usage or configuration, 3 a service unreachable or refusing),
the traceback only with ``--debug``, and never a password."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.acceptance.conftest import KAFKA_IDEM, Result, kafka_idem
from tests.conftest import ADMIN_DSN, BOOTSTRAP, DB, ROOT, Topics

SECRET = "Hunter2-not-for-logs"
# The suite's own PostgreSQL (its port may be moved: KAFKA_IDEM_PG_PORT)
PG = conninfo_to_dict(ADMIN_DSN)


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def one_error_line(r: Result) -> str:
    assert "Traceback" not in r.err, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("error: "), r.err
    return lines[0]


def no_secret(r: Result) -> None:
    assert SECRET not in r.out and SECRET not in r.err, (r.out, r.err)


# --- the database down ---------------------------------------------------------------------


@pytest.mark.parametrize("args", [("migrate",), ("migrate", "--app", "consumers.payments:app"),
                                  ("status",), ("inspect", "t1:charge:o1"),
                                  ("purge", "--older-than", "30d")])
def test_the_database_down_is_one_line_and_exit_3(args: tuple[str, ...]) -> None:
    url = f"postgresql://app:{SECRET}@127.0.0.1:{closed_port()}/kafka_idem"
    r = kafka_idem("--database-url", url, *args)
    assert r.code == 3, (r.out, r.err)
    line = one_error_line(r)
    assert line.startswith("error: database unreachable: ") and "Connection refused" in line
    assert line.endswith("(the database is KAFKA_IDEM_DATABASE_URL, or --database-url)")
    no_secret(r)


def test_debug_adds_the_traceback_still_without_the_password() -> None:
    url = f"postgresql://app:{SECRET}@127.0.0.1:{closed_port()}/kafka_idem"
    r = kafka_idem("--debug", "--database-url", url, "migrate")
    assert r.code == 3
    assert "Traceback (most recent call last)" in r.err
    assert r.err.strip().splitlines()[-1].startswith("error: database unreachable: ")
    no_secret(r)


# --- configuration errors ------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    f"postgresql//app:{SECRET}@127.0.0.1:55432/kafka_idem",  # libpq echoes the whole URL
    f"postgresql://app:{SECRET} 2@127.0.0.1:55432/kafka_idem",  # libpq echoes the password
    f"postgresql://app:{SECRET}%@127.0.0.1:55432/kafka_idem",  # libpq echoes the password
    f"host=127.0.0.1 port=55432 password='{SECRET}",  # unterminated quote
    f"postgresql://app@127.0.0.1:55432/kafka_idem?password={SECRET}&bogus=1",
])
@pytest.mark.parametrize("args", [("status",), ("inspect", "k"), ("migrate",),
                                  ("run", "consumers.payments:app"),
                                  ("rerun", "k", "--reason", "r"), ("verify",)])
def test_a_malformed_database_url_never_shows_its_password(
    url: str, args: tuple[str, ...]
) -> None:
    r = kafka_idem("--database-url", url, *args)
    assert r.code == 2, (r.out, r.err)
    line = one_error_line(r)
    assert "invalid setting database_url (KAFKA_IDEM_DATABASE_URL)" in line
    no_secret(r)


@pytest.mark.parametrize("url", [
    f"postgresql:/app:{SECRET}@127.0.0.1/kafka_idem",  # libpq reads it as one conninfo word
    f"postgres:app:{SECRET}@127.0.0.1/kafka_idem",
    SECRET,
])
@pytest.mark.parametrize("debug", [(), ("--debug",)])
def test_a_url_that_is_not_one_never_shows_its_password(
    url: str, debug: tuple[str, ...]
) -> None:
    r = kafka_idem(*debug, "--database-url", url, "status")
    assert r.code == 2, (r.out, r.err)
    assert "invalid setting database_url" in r.err
    no_secret(r)


def test_a_raw_at_sign_in_the_password_never_shows_a_piece_of_it() -> None:
    # libpq splits at the first '@': the rest of the password becomes the "host" it
    # then fails to resolve, and quotes.
    url = f"postgresql://app:{SECRET}@tail-of-secret@127.0.0.1:{closed_port()}/kafka_idem"
    r = kafka_idem("--database-url", url, "status")
    assert r.code == 3, (r.out, r.err)
    one_error_line(r)
    no_secret(r)
    assert "tail-of-secret" not in r.out + r.err


def test_a_malformed_database_url_in_the_environment_never_shows_its_password() -> None:
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": f"postgresql//app:{SECRET}@127.0.0.1:55432/kafka_idem"}
    proc = subprocess.run([*KAFKA_IDEM, "status"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    r = Result(proc.returncode, proc.stdout, proc.stderr)
    assert r.code == 2, (r.out, r.err)
    assert "invalid setting database_url (KAFKA_IDEM_DATABASE_URL)" in one_error_line(r)
    no_secret(r)


def test_invalid_json_in_kafka_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, db: DB
) -> None:
    monkeypatch.setenv("KAFKA_IDEM_KAFKA", f'{{"sasl.password": "{SECRET}", oops}}')
    r = kafka_idem("status", db=db)
    assert r.code == 2, (r.out, r.err)
    line = one_error_line(r)
    assert "invalid setting kafka (KAFKA_IDEM_KAFKA): not valid JSON" in line
    no_secret(r)


def test_a_bad_setting_in_the_environment_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, db: DB
) -> None:
    monkeypatch.setenv("KAFKA_IDEM_SCHEMA_NAME", "kafka_idem\n")
    r = kafka_idem("status", db=db)
    assert r.code == 2
    assert "invalid setting schema_name (KAFKA_IDEM_SCHEMA_NAME)" in one_error_line(r)


# --- a port in use -------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_metrics_port_in_use_is_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, db: DB, topics: Topics, taken_port: int
) -> None:
    monkeypatch.setenv("PAYMENTS_TOPIC", topics(partitions=1))
    r = kafka_idem("run", "consumers.payments:app", "--metrics-port", str(taken_port),
                   "--max-seconds", "30", db=db)
    assert r.code == 3, (r.out, r.err)
    line = one_error_line(r)
    assert f"cannot serve /metrics on 127.0.0.1:{taken_port}" in line
    assert "KAFKA_IDEM_METRICS_PORT" in line


def test_a_console_port_in_use_is_one_line_and_exit_3(db: DB, taken_port: int) -> None:
    """An operational error (as --help and cli-conventions say), not a usage error."""
    r = kafka_idem("console", "tests.apps.consoled:app", "--port", str(taken_port), db=db,
                   env={"CONSOLED_ORDERS": "cli-errors-orders",
                        "CONSOLED_REFUNDS": "cli-errors-refunds"}, timeout=60)
    assert r.code == 3, (r.code, r.out, r.err)
    line = one_error_line(r)
    assert line.startswith(f"error: cannot listen on 127.0.0.1:{taken_port}: "), line
    assert line.endswith("; choose another --port or --addr"), line


# --- variables that are not settings -------------------------------------------------------

MISSPELT = ("KAFKA_IDEM_BATCH_SIZ is not a setting (did you mean KAFKA_IDEM_BATCH_SIZE?); "
            "it is ignored")


def warnings_of(r: Result) -> list[str]:
    return [ln for ln in r.err.splitlines() if "is not a setting" in ln]


def test_a_misspelt_variable_is_one_warning_before_a_config_error(db: DB) -> None:
    r = kafka_idem("status", db=db, env={"KAFKA_IDEM_BATCH_SIZ": "5",
                                         "KAFKA_IDEM_MAX_ATTEMPTS": "0"})
    assert r.code == 2, (r.out, r.err)
    (warning, error) = r.err.strip().splitlines()
    assert warning.endswith(f"WARNING kafka_idem.settings.environment: {MISSPELT} "
                            "action=config_unknown kind=KAFKA_IDEM_BATCH_SIZ")
    assert error.startswith("error: invalid setting max_attempts (KAFKA_IDEM_MAX_ATTEMPTS)")


def test_a_misspelt_variable_is_said_once_by_run_in_the_log_format_chosen(
    monkeypatch: pytest.MonkeyPatch, db: DB, topics: Topics, taken_port: int
) -> None:
    """``run`` loads the settings twice (the CLI's, then the app's): one warning."""
    monkeypatch.setenv("PAYMENTS_TOPIC", topics(partitions=1))
    r = kafka_idem("--log-format", "json", "run", "consumers.payments:app", "--metrics-port",
                   str(taken_port), "--max-seconds", "30", db=db,
                   env={"KAFKA_IDEM_BATCH_SIZ": "5", "KAFKA_IDEM_ROOT": "/somewhere"})
    assert r.code == 3, (r.out, r.err)
    (warning,) = warnings_of(r)
    data = json.loads(warning)
    assert (data["level"], data["message"], data["action"], data["kind"]) == (
        "WARNING", MISSPELT, "config_unknown", "KAFKA_IDEM_BATCH_SIZ")
    assert r.err.strip().splitlines()[-1].startswith("error: cannot serve /metrics")


# --- reports ---------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    f"postgresql://{PG['user']}@{PG['host']}:{PG['port']}/{PG['dbname']}?password={SECRET}",
    f"host={PG['host']} port={PG['port']} user={PG['user']} dbname={PG['dbname']} "
    f"password='{SECRET}'",
])
def test_verify_json_and_text_never_show_the_password(url: str, tmp_path: Path) -> None:
    # The local server trusts 127.0.0.1, so the password is accepted and ignored.
    path = tmp_path / "report.json"
    r = kafka_idem("--database-url", url, "verify", "--scenario", "3", "--json", str(path),
                   timeout=300)
    assert r.code == 0, (r.out, r.err)
    no_secret(r)
    text = path.read_text()
    assert SECRET not in text
    assert "**********" in json.loads(text)["database"]


# --- a stop while the member starts ---------------------------------------------------------


SLOW_APP = '''
import pathlib, time
pathlib.Path({marker!r}).write_text("importing")
time.sleep({sleep})
from consumers.payments import app
'''


@pytest.mark.parametrize("signals", [1, 2], ids=["sigterm", "sigterm-twice"])
def test_a_sigterm_while_the_app_loads_stops_the_member_cleanly(
    tmp_path: Path, db: DB, signals: int
) -> None:
    """A member told to stop while its app module still imports (a rolling deploy
    cancelling a pod that just started) exits 0 before it starts, saying so; a second
    SIGTERM stops a hanging import at once (128 + 15)."""
    import signal
    import time

    marker = tmp_path / "importing"
    (tmp_path / "slow_app.py").write_text(
        SLOW_APP.format(marker=str(marker), sleep=3 if signals == 1 else 60))
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": db.dsn,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.Popen([*KAFKA_IDEM, "run", "slow_app:app"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate(timeout=30)
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if signals == 1:
        assert proc.returncode == 0, err
        assert "stopping before the consumer started (SIGTERM)" in out + err
        assert "action=started" not in out + err  # the consumer never started
    else:
        assert proc.returncode == 128 + signal.SIGTERM, err
