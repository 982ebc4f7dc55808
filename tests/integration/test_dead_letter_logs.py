"""The log line of every dead letter says why, against the real broker and database.

An operator reading the log must learn what failed without opening the DLQ: the
line says ``dead-lettering (KIND): CLASS: MESSAGE`` and carries ``kind``,
``error_class`` and ``error_message`` as fields (the error as the letter's
``idem.error.*`` headers carry it), next to topic, partition, offset and key. It
never quotes the payload. Checked on each path that writes these lines: the batch
path (local mode's default), the per-message path and leased mode."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import Context, Permanent, Retryable, RetryPolicy
from tests.conftest import DB, InProcess, Topics, caught_up, headers, produce, wait_for
from tests.integration.support import HANDLER, charge_app, dlq_records

ACTIONS = ("rejected", "failed", "exhausted", "dead_lettered", "conflict")
JUNK = b"\xff\xfesecret-card-4111"  # no payload: undecodable bytes


def decide(msg: payments.ChargeRequested, ctx: Context) -> Any:
    if msg.order_id == "o1":
        raise Permanent("card declined")
    if msg.order_id == "o2":
        raise Retryable(f"bank busy (attempt {ctx.attempt})")
    return payments.charge(msg, ctx)


def letter_lines(caplog: pytest.LogCaptureFixture) -> dict[int, logging.LogRecord]:
    """The dead-letter log records, by source offset (one each)."""
    out: dict[int, logging.LogRecord] = {}
    for r in caplog.records:
        if getattr(r, "action", None) in ACTIONS:
            offset = r.offset  # type: ignore[attr-defined]
            assert offset not in out, f"two dead-letter lines for offset {offset}"
            out[offset] = r
    return out


def fields(r: logging.LogRecord) -> dict[str, Any]:
    names = ("action", "kind", "error_class", "error_message", "topic", "partition",
             "offset", "key", "handler")
    return {n: getattr(r, n, None) for n in names}


@pytest.mark.parametrize(("mode", "batch_path"), [
    ("local", True), ("local", False), ("leased", False),
])
def test_every_dead_letter_line_carries_the_error_kind_class_and_message(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture,
    mode: str, batch_path: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem")
    topic = topics(partitions=1)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00")),   # 0: permanent
                    (b"o2", encode_charge("t1", "o2", "20.00")),   # 1: exhausted
                    (b"junk", JUNK),                               # 2: undecodable
                    (b"o3", encode_charge("t1", "o3", "30.00"))])  # 3: succeeds
    app = charge_app(db, topic, group, decide, mode=mode, batch_path=batch_path,
                     retry=RetryPolicy(base=0.05, cap=0.1, max_attempts=2))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the first four messages")
        produce(topic, [(b"o3", encode_charge("t1", "o3", "31.00"))])  # 4: conflict
        wait_for(lambda: caught_up(group, topic), what="the conflict")

    lines = letter_lines(caplog)
    assert sorted(lines) == [0, 1, 2, 4]
    letters = {int(headers(m)["idem.original.offset"]): headers(m) for m in dlq_records(topic)}
    assert sorted(letters) == [0, 1, 2, 4]
    where = {"topic": topic, "partition": 0, "handler": HANDLER}
    exhausted = letters[1]["idem.error.message"]
    assert exhausted.endswith("; last error: bank busy (attempt 2)")  # why, then the error
    conflict = letters[4]["idem.error.message"]
    assert conflict.startswith("key 't1:charge:o3' was first used with a different payload")
    undecodable = letters[2]["idem.error.message"]
    want = {
        0: ("failed", "permanent", "Permanent", "card declined", "t1:charge:o1"),
        1: ("exhausted", "exhausted", "Retryable", exhausted, "t1:charge:o2"),
        2: ("rejected", "undecodable", "Undecodable", undecodable, None),
        4: ("conflict", "payload_conflict", "PayloadConflict", conflict, "t1:charge:o3"),
    }
    for offset, (action, kind, cls, message, key) in want.items():
        r = lines[offset]
        assert r.levelno == logging.WARNING
        assert r.getMessage() == f"dead-lettering ({kind}): {cls}: {message}"
        assert fields(r) == {"action": action, "kind": kind, "error_class": cls,
                             "error_message": message, "offset": offset, "key": key, **where}
        # the same error as the dead letter's headers
        h = letters[offset]
        assert (h["idem.error.kind"], h["idem.error.class"], h["idem.error.message"]) == (
            kind, cls, message)
    for r in caplog.records:  # never a payload value
        text = r.getMessage()
        assert "secret-card" not in text and "31.00" not in text and "20.00" not in text


def test_a_long_error_is_logged_as_bounded_as_the_dead_letter_carries_it(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kafka_idem")
    topic = topics(partitions=1)

    def huge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        raise Permanent("fraud check: " + "ü" * 20_000)

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    app = charge_app(db, topic, group, huge)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the dead letter")
    (r,) = letter_lines(caplog).values()
    (letter,) = dlq_records(topic)
    message = headers(letter)["idem.error.message"]
    assert message.endswith("...") and len(message.encode()) <= app.settings.error_message_max
    assert r.error_message == message  # type: ignore[attr-defined]
    assert r.getMessage() == f"dead-lettering (permanent): Permanent: {message}"


def test_the_batch_paths_own_decisions_log_the_per_message_paths_actions(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch that decides everything itself (no handler raised, so no fallback):
    undecodable bytes are ``rejected`` and a re-send of a key that already failed is
    ``dead_lettered``, as the per-message path says them (log filters and alerts
    on ``action`` see one vocabulary, whichever path ran)."""
    caplog.set_level(logging.INFO, logger="kafka_idem")
    topic = topics(partitions=1)
    app = charge_app(db, topic, group, decide, mode="local", batch_path=True)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])  # 0: fails permanently
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the first failure")
        caplog.clear()
        produce(topic, [(b"junk", JUNK),                                # 1: undecodable
                        (b"o1", encode_charge("t1", "o1", "10.00")),    # 2: failed before
                        (b"o5", encode_charge("t1", "o5", "5.00"))])    # 3: succeeds
        wait_for(lambda: caught_up(group, topic), what="the batch")
    lines = letter_lines(caplog)
    assert sorted(lines) == [1, 2]
    assert (lines[1].action, lines[1].kind) == ("rejected", "undecodable")  # type: ignore[attr-defined]
    assert (lines[2].action, lines[2].kind, lines[2].key) == (  # type: ignore[attr-defined]
        "dead_lettered", "permanent", "t1:charge:o1")
    assert db.ledger_counts() == {"t1:charge:o5": 1}
