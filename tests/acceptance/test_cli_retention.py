"""Background retention through the CLI (issue 35): ``kafka-idem run`` refuses a
``retention`` shorter than a source topic's ``retention.ms`` (exit 2, one line naming the
setting) and, forced, runs and purges; ``kafka-idem status`` shows the last purge."""

from __future__ import annotations

import threading

import pytest

from kafka_idem.admin import retention
from kafka_idem.store import Store, connect
from tests.acceptance.conftest import kafka_idem
from tests.acceptance.test_cli_errors import one_error_line
from tests.conftest import DB, Topics
from tools.old_records import fill


def test_a_retention_shorter_than_the_topics_refuses_the_start(
    monkeypatch: pytest.MonkeyPatch, db: DB, topics: Topics
) -> None:
    topic = topics(partitions=1)  # kept 24 hours by the local broker
    monkeypatch.setenv("PAYMENTS_TOPIC", topic)
    fill(db.dsn, n=20, age_seconds=7200, prefix="old:", namespace="payments")
    r = kafka_idem("run", "consumers.payments:app", "--max-seconds", "30", db=db,
                   env={"KAFKA_IDEM_RETENTION": "1h", "PAYMENTS_EVENTS": "off"})
    assert r.code == 2, (r.out, r.err)
    line = one_error_line(r)
    assert line.startswith("error: retention=1h (KAFKA_IDEM_RETENTION): topic "
                           f"{topic} keeps messages for 1d (retention.ms=86400000)"), line
    assert "set retention to 1d or longer" in line
    assert "KAFKA_IDEM_RETENTION_FORCE" in line
    assert int(db.value("SELECT count(*) FROM kafka_idem.task_idempotency")) == 20


def test_status_shows_the_last_background_purge(db: DB) -> None:
    fill(db.dsn, n=1500, age_seconds=3 * 86400, prefix="old:", namespace="shop")
    with connect(db.dsn) as conn:
        removed = retention.run_once(
            conn, Store(schema="kafka_idem", table="task_idempotency", namespace="shop"),
            window="2d", member="host-1:42", force=False, stopping=threading.Event())
    assert removed == 1500
    r = kafka_idem("status", "--json", db=db)
    assert r.code == 0, r.err
    (run,) = r.json()["retention"].values()
    assert (run["member"], run["removed"], run["retention"], run["force"]) == (
        "host-1:42", 1500, "2d", False)
    text = kafka_idem("status", db=db)
    assert text.code == 0, text.err
    assert "retention: last background purge" in text.out
    row = next(ln for ln in text.out.splitlines() if ln.startswith("shop ") and "host-1:42" in ln)
    assert row.split()[-2:] == ["1500", "2d"]
