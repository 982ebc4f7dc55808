"""The console's pure parts: the DLQ index's order and pages, the session and CSRF
tokens, the parsing of filters (no broker, no database: tests/integration and
tests/console run the console itself)."""

from __future__ import annotations

import datetime as dt
import random
import time

import pytest

from kafka_idem.console import forms, security
from kafka_idem.console.dlq_index import DlqIndex, TopicIndex, order_of
from kafka_idem.replay import DlqRecord, Selection
from kafka_idem.settings import load_settings

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def letter(partition: int, offset: int, seconds: float, *, key: str | None = None,
           kind: str = "exhausted") -> DlqRecord:
    at = T0 + dt.timedelta(seconds=seconds)
    return DlqRecord(dlq_topic="t.dlq", partition=partition, offset=offset, timestamp=at,
                     key=None, value=None, headers=(), idempotency_key=key, kind=kind,
                     last_failure_at=at)


def index_of(records: list[DlqRecord]) -> DlqIndex:
    index = DlqIndex(load_settings(), ["t.dlq"])
    for rec in records:
        index.topics["t.dlq"].add(rec, 10)
    return index


def walk(index: DlqIndex, sel: Selection, limit: int) -> list[DlqRecord]:
    seen: list[DlqRecord] = []
    before = None
    while True:
        page = index.page("t.dlq", sel, before=before, limit=limit)
        seen += page.rows
        if page.next_before is None:
            return seen
        before = page.next_before


def test_pages_walk_every_record_once_newest_first_whatever_the_read_order() -> None:
    # three partitions read one after the other (as a catch-up does), times interleaved
    records = [letter(p, o, o * 3 + p, key=f"k{(o * 3 + p) % 7}") for p in range(3)
               for o in range(40)]
    index = index_of(records)
    got = walk(index, Selection(), limit=7)
    assert [order_of(r) for r in got] == sorted((order_of(r) for r in records), reverse=True)
    assert len({(r.partition, r.offset) for r in got}) == len(records)


def test_filtered_pages_and_the_key_lookup_match_the_selection() -> None:
    rng = random.Random(7)
    records = [letter(rng.randrange(4), o, rng.random() * 1000, key=f"k{o % 5}",
                      kind=rng.choice(["exhausted", "permanent"])) for o in range(300)]
    index = index_of(records)
    for sel in (Selection(kind="permanent"), Selection(key="k3"),
                Selection(key="k3", kind="exhausted"), Selection(partition=2, from_offset=100)):
        expected = sorted((r for r in records if sel.matches(r)), key=order_of, reverse=True)
        assert walk(index, sel, limit=9) == expected, sel
    assert [r.offset for r in index.of_key("k3")] == sorted(
        (r.offset for r in records if r.idempotency_key == "k3"),
        key=lambda o: order_of(records[o]))


def test_records_added_after_a_sort_keep_the_order() -> None:
    idx = TopicIndex("t.dlq")
    for s in (5, 1, 3):
        idx.add(letter(0, int(s), s), 1)
    idx.sorted()
    idx.add(letter(1, 0, 2), 1)  # older than the last: out of order again
    idx.add(letter(1, 1, 9), 1)
    idx.sorted()
    assert idx.order == sorted(idx.order)
    assert [r.offset for r in idx.letters] == [1, 0, 3, 5, 1]  # (partition 1's 0 at 2 s)
    assert idx.by_key()[""] == list(range(5))


def test_recent_by_kind_counts_by_last_failure_as_the_since_filter_does() -> None:
    now = dt.datetime.now(dt.UTC)
    old = DlqRecord(dlq_topic="t.dlq", partition=0, offset=0, timestamp=now, key=None,
                    value=None, headers=(), kind="permanent",
                    last_failure_at=now - dt.timedelta(hours=2))  # written late: by failure
    new = DlqRecord(dlq_topic="t.dlq", partition=0, offset=1, timestamp=now, key=None,
                    value=None, headers=(), kind="exhausted", last_failure_at=now)
    bare = DlqRecord(dlq_topic="t.dlq", partition=0, offset=2, timestamp=now, key=None,
                     value=None, headers=())  # no idem headers: no failure time
    index = index_of([old, new, bare])
    assert index.recent_by_kind(3600) == {"t.dlq": {"exhausted": 1}}
    assert index.recent_by_kind(86400) == {"t.dlq": {"exhausted": 1, "permanent": 1}}
    hour = now - dt.timedelta(hours=1)
    assert [r.offset for r in index.page("t.dlq", Selection(since=hour)).rows] == [1]


def test_a_session_cookie_names_its_operator_until_it_expires_or_is_changed() -> None:
    guard = security.Guard(token="a-token-of-16-chars!", read_only=False, actor="ops")
    cookie = guard.session_cookie("Zoë <admin>")
    assert guard.session_operator(cookie) == "Zoë <admin>"
    name, expires, sig = cookie.split(".")
    assert guard.session_operator(f"{name}.{int(expires) + 99}.{sig}") is None  # extended
    assert guard.session_operator(f"{name[:-2]}AA.{expires}.{sig}") is None  # renamed
    other = security.Guard(token="a-token-of-16-chars!", read_only=False, actor="ops")
    assert other.session_operator(cookie) is None  # another process's key
    assert guard.session_operator("") is None and guard.session_operator("a.b") is None
    past = f"{name}.{int(time.time()) - 1}"
    assert guard.session_operator(f"{past}.{guard._sign(past)}") is None


def test_tokens_and_csrf_tokens_are_checked() -> None:
    guard = security.Guard(token="a-token-of-16-chars!", read_only=False, actor="ops")
    assert guard.check_token("a-token-of-16-chars!")
    assert not guard.check_token("a-token-of-16-chars")
    assert not guard.check_token("\udcff")  # not UTF-8 text: refused, not an error
    assert not security.Guard(token=None, read_only=False, actor="x").check_token("")
    token = guard.csrf_token("cookie-1")
    assert guard.csrf_ok("cookie-1", token)
    assert not guard.csrf_ok("cookie-2", token)
    assert not guard.csrf_ok(None, token) and not guard.csrf_ok("cookie-1", None)


@pytest.mark.parametrize(("target", "safe"), [
    ("/records?status=failed", "/records?status=failed"), (None, "/"), ("", "/"),
    ("//evil.example/x", "/"), ("https://evil.example", "/"), ("/\\evil.example", "/"),
    ("records", "/")])
def test_after_the_login_only_a_path_of_this_site(target: str | None, safe: str) -> None:
    assert security.safe_next(target) == safe


def test_operator_names_and_loopback_addresses() -> None:
    assert security.clean_operator("  ann\n\x1b[31m ") == "ann[31m"
    assert len(security.clean_operator("x" * 100)) == 64
    assert all(map(security.is_loopback, ["127.0.0.1", "127.1.2.3", "localhost", "::1",
                                          "[::1]", "LOCALHOST"]))
    assert not any(map(security.is_loopback, [
        "0.0.0.0", "10.0.0.1", "example.com", "", "127.evil.example", "127.0.0.1.evil.example",
        "127.0.0.1evil.example", "localhost.evil.example", "[::1].evil"]))
    hosts = {"127.0.0.1:8088": "127.0.0.1", "[::1]:8088": "[::1]", "localhost": "localhost",
             "127.0.0.1:8088.evil.example": "127.0.0.1:8088.evil.example"}
    for header, name in hosts.items():
        assert security.host_name(header) == name


def test_bad_filters_say_which_field() -> None:
    with pytest.raises(forms.BadInput, match="since"):
        forms.time_param({"since": "yesterday"}, "since")
    with pytest.raises(forms.BadInput, match="partition"):
        forms.int_param({"partition": "-1"}, "partition")
    with pytest.raises(forms.BadInput, match="kind"):
        forms.selection({"kind": "bogus"})
    with pytest.raises(forms.BadInput, match="from_offset"):
        forms.selection({"from_offset": "9", "to_offset": "3"})
    with pytest.raises(forms.BadInput, match="at least one filter"):
        forms.filter_of({"limit": "5"})
    with pytest.raises(forms.BadInput, match="cursor"):
        forms.decode_cursor("%%%")
    assert forms.time_param({"since": "2026-12-01T10:00"}, "since") == dt.datetime(
        2026, 12, 1, 10, tzinfo=dt.UTC)
    value = ["ns", "k:<é>"]
    assert forms.decode_cursor(forms.encode_cursor(value)) == value
