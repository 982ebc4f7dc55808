"""Dead-letter headers, built from a fake message: no broker needed."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafka_idem.deadletters.dead_letter import REQUIRED_HEADERS, DeadLetter, bounded
from kafka_idem.testing import FakeMessage

KEY = b"order-9"
VALUE = b"\xc3\x01" + b"\x11" * 8 + b"avro-body-bytes"
FIRST = dt.datetime(2024, 5, 1, 10, 0, tzinfo=dt.UTC)
LAST = dt.datetime(2024, 5, 1, 10, 5, tzinfo=dt.timezone(dt.timedelta(hours=2)))


def message(
    *, headers: list[tuple[str, bytes | None]] | None = None,
    timestamp: int | None = 1_714_557_600_000,
) -> FakeMessage:
    """The source message a DeadLetter reads (the kit's stub, no broker)."""
    return FakeMessage("payments.charge-requested", partition=3, offset=1234, key=KEY,
                       value=VALUE, headers=headers, timestamp=timestamp)


def letter(source: Any = None, **overrides: Any) -> DeadLetter:
    fields: dict[str, Any] = {
        "dlq_topic": "payments.charge-requested.dlq",
        "source": source or message(),
        "kind": "permanent",
        "error_class": "Permanent",
        "error_message": "amount must be positive, got -5",
        "attempts": 2,
        "consumer_group": "payments",
        "handler": "charge",
        "idempotency_key": "t1:charge:o9",
        "first_failure_at": FIRST,
        "last_failure_at": LAST,
    }
    return DeadLetter(**{**fields, **overrides})


def as_dict(headers: list[tuple[str, bytes]]) -> dict[str, str]:
    return {k: v.decode("utf-8") for k, v in headers}


def test_every_required_header_is_present_with_the_messages_metadata() -> None:
    headers = letter().headers(1024)
    assert all(isinstance(v, bytes) for _, v in headers)
    h = as_dict(headers)
    assert set(REQUIRED_HEADERS) <= set(h)
    assert h["idem.original.topic"] == "payments.charge-requested"
    assert h["idem.original.partition"] == "3"
    assert h["idem.original.offset"] == "1234"
    assert h["idem.original.timestamp"] == "1714557600000"
    assert h["idem.error.kind"] == "permanent"
    assert h["idem.error.class"] == "Permanent"
    assert h["idem.error.message"] == "amount must be positive, got -5"
    assert h["idem.attempts"] == "2"
    assert h["idem.consumer_group"] == "payments"
    assert h["idem.handler"] == "charge"
    assert h["idem.key"] == "t1:charge:o9"
    # Failure times are ISO 8601 in UTC.
    assert dt.datetime.fromisoformat(h["idem.first_failure_at"]) == FIRST
    assert dt.datetime.fromisoformat(h["idem.last_failure_at"]) == LAST
    assert h["idem.last_failure_at"].endswith("+00:00")
    # Each of our headers appears exactly once.
    counts = Counter(k for k, _ in headers)
    assert all(counts[name] == 1 for name in (*REQUIRED_HEADERS, "idem.key"))


def test_key_header_only_when_a_key_was_built() -> None:
    h = as_dict(letter(idempotency_key=None, kind="undecodable").headers(1024))
    assert "idem.key" not in h
    assert set(REQUIRED_HEADERS) <= set(h)


def test_missing_timestamp_is_minus_one() -> None:
    h = as_dict(letter(message(timestamp=None)).headers(1024))
    assert h["idem.original.timestamp"] == "-1"


def test_unknown_failure_times_default_to_now() -> None:
    before = dt.datetime.now(dt.UTC)
    h = as_dict(letter(first_failure_at=None, last_failure_at=None).headers(1024))
    after = dt.datetime.now(dt.UTC)
    assert before <= dt.datetime.fromisoformat(h["idem.first_failure_at"]) <= after


@pytest.mark.parametrize("char", ["a", "é", "€", "😀"])
@pytest.mark.parametrize("limit", [64, 100, 1024])
def test_error_message_is_bounded_in_utf8_bytes(char: str, limit: int) -> None:
    headers = dict(letter(error_message=char * 5000).headers(limit))
    raw = headers["idem.error.message"]
    assert len(raw) <= limit
    text = raw.decode("utf-8")  # cut on a character boundary: still valid UTF-8
    assert text.endswith("...")
    assert set(text[:-3]) == {char}
    assert len(raw) > limit - 3 - len(char.encode())  # nothing cut needlessly


@given(st.text(max_size=400), st.integers(min_value=3, max_value=300))
def test_bounded_never_exceeds_the_limit_and_keeps_short_text(text: str, limit: int) -> None:
    out = bounded(text, limit)
    assert len(out.encode("utf-8")) <= limit
    if len(text.encode("utf-8")) <= limit:
        assert out == text
    else:
        assert out.endswith("...") and text.startswith(out[:-3])


def test_error_class_is_bounded_and_the_key_never_cut() -> None:
    # Keys are bounded before they exist (key_max_bytes); a cut key could never be
    # found again by `rerun` or `dlq list --key`.
    h = dict(letter(error_class="E" * 1000, idempotency_key="k" * 2000).headers(1024))
    assert len(h["idem.error.class"]) <= 200
    assert h["idem.key"] == b"k" * 2000


def test_original_headers_travel_along_and_earlier_idem_headers_are_dropped() -> None:
    source = message(
        headers=[
            ("traceparent", b"00-abc-def-01"),
            ("content-type", b"avro"),
            ("empty", None),
            ("idem.error.kind", b"exhausted"),  # from an earlier DLQ trip
            ("idem.key", b"stale:key"),
            ("idem.original.offset", b"1"),
        ]
    )
    headers = letter(source, idempotency_key=None).headers(1024)
    assert ("traceparent", b"00-abc-def-01") in headers
    assert ("content-type", b"avro") in headers
    assert ("empty", b"") in headers
    h = as_dict(headers)
    assert h["idem.error.kind"] == "permanent"
    assert h["idem.original.offset"] == "1234"
    assert "idem.key" not in h  # the stale key is not carried over
    counts = Counter(k for k, _ in headers)
    assert counts["idem.error.kind"] == 1 and counts["idem.original.offset"] == 1


def test_key_and_value_are_not_copied_into_headers() -> None:
    headers = letter().headers(1024)
    names = {k for k, _ in headers}
    assert not names & {"key", "value", "idem.key.bytes", "idem.value"}
    values = [v for _, v in headers]
    assert VALUE not in values
    assert all(VALUE not in v for v in values)
    assert KEY not in values
