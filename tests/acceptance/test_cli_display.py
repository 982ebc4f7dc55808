"""Stored and user-controlled text through the installed CLI: printed as written, never
read as rich markup, with control characters escaped so no line can be forged.

The records are written the way any producer or older version could have written them:
a store record (claimed and failed through the store) and a DLQ record with hostile
``idem.*`` headers. Here the output text is the outcome under test.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import pytest

from kafka_idem.admin import audit
from kafka_idem.store import Delivery, Store, connect
from tests.acceptance.conftest import Result, kafka_idem, produce_with_headers
from tests.conftest import DB, Topics

KEY = "t1:charge:o[/]\nFORGED KEY \x1b[31m"
KEY_SHOWN = "t1:charge:o[/]\\nFORGED KEY \\x1b[31m"
LINK = "[link=https://evil.example]click here[/link]"
MESSAGE = f"{LINK} [/] \x1b[2J\nFORGED ERROR"
ERROR_CLASS = "E[/]"
ACTOR = "[bold]mallory[/]"
REASON = "[/]\nFORGED REASON"
OSC8 = b"\x1b]8;;https://evil.example\x1b\\x\x1b]8;;\x1b\\"  # a terminal hyperlink


@dataclass
class Hostile:
    db: DB
    source: str
    dlq: str


@pytest.fixture
def hostile(db: DB, topics: Topics) -> Hostile:
    source = topics(partitions=1)
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="tests")
    conn = connect(db.dsn)
    with conn.transaction():
        claim = store.claim(conn, key=KEY, request_hash="v1:x",
                            delivery=Delivery(source, 0, 0, "charge"), lease_seconds=60,
                            max_attempts=5, max_elapsed_seconds=3600)
        assert claim.token is not None
        store.fail(conn, key=KEY, token=claim.token, status="failed", kind="permanent",
                   error_class=ERROR_CLASS, error_message=MESSAGE)
        audit.record(conn, store, actor=ACTOR, action="rerun", key=KEY, reason=REASON,
                     previous_status="failed", previous_error=MESSAGE)
    conn.close()
    now = dt.datetime.now(dt.UTC).isoformat()
    headers = [
        ("trace[/]\n", OSC8),
        ("idem.original.topic", source.encode()), ("idem.original.partition", b"0"),
        ("idem.original.offset", b"0"), ("idem.key", KEY.encode()),
        ("idem.error.kind", b"permanent"), ("idem.error.class", LINK.encode()),
        ("idem.error.message", MESSAGE.encode()), ("idem.attempts", b"1"),
        ("idem.first_failure_at", now.encode()), ("idem.last_failure_at", now.encode()),
        ("idem.consumer_group", b"g[/]"), ("idem.handler", b"charge[/]"),
    ]
    produce_with_headers(f"{source}.dlq", [(b"o\x1b[9", b"value", headers)])
    return Hostile(db, source, f"{source}.dlq")


def assert_plain(r: Result) -> str:
    """The command worked, printed no escape sequence and forged no line."""
    assert r.code == 0, (r.out, r.err)
    out = r.out + r.err
    assert "MarkupError" not in out and "Traceback" not in out
    assert "\x1b" not in out and "\r" not in out
    forged = [ln for ln in out.splitlines() if ln.strip(" │┃|").startswith("FORGED")]
    assert forged == [], forged
    return r.out


def test_inspect_shows_the_key_error_and_audit_trail_as_written(hostile: Hostile) -> None:
    out = assert_plain(kafka_idem("inspect", KEY, db=hostile.db))
    assert KEY_SHOWN in out
    assert LINK in out and "[/] \\x1b[2J\\nFORGED ERROR" in out
    assert ERROR_CLASS in out
    assert ACTOR in out and "[/]\\nFORGED REASON" in out


def test_dlq_list_shows_headers_as_written(hostile: Hostile) -> None:
    out = assert_plain(kafka_idem("dlq", "list", "--dlq", hostile.dlq, db=hostile.db))
    assert KEY_SHOWN in out
    assert LINK in out  # the error class column
    assert f"{LINK} [/] \\x1b[2J" in out  # the message (cut at 60 characters)
    assert "charge[/]" in out


def test_dlq_show_shows_every_header_as_written(hostile: Hostile) -> None:
    out = assert_plain(kafka_idem("dlq", "show", "--dlq", hostile.dlq, "--partition", "0",
                                  "--offset", "0", db=hostile.db))
    assert "kafka key:  o\\x1b[9" in out
    assert "trace[/]\\n" in out and "\\x1b]8;;https://evil.example\\x1b\\x" in out
    assert KEY_SHOWN in out and LINK in out and "g[/]" in out


def test_dlq_replay_dry_run_shows_keys_as_written(hostile: Hostile) -> None:
    out = assert_plain(kafka_idem("dlq", "replay", "--dlq", hostile.dlq, "--dry-run",
                                  "--include-permanent", "--namespace", "tests",
                                  "--no-progress", db=hostile.db))
    assert f"key={KEY_SHOWN}" in out


def test_a_refusal_about_a_hostile_key_is_one_line(hostile: Hostile) -> None:
    r = kafka_idem("rerun", "nope[/]\nFORGED \x1b[31m", "--reason", "x", db=hostile.db)
    assert r.code == 1
    assert "\x1b" not in r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refused: no record with this key")
    assert "nope[/] FORGED \\x1b[31m" in lines[0]
