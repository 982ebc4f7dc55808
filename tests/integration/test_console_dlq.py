"""The console's dead-letter pages against the real broker: the list's filters select
what ``kafka-idem dlq list --json`` selects on the same topic (both go through
``Selection.matches``), the next-page links walk every record once, newest first, one
record's page shows its headers, its payload decoded by the app's handler and its key's
state now, a position with no record is a 404, and records dead-lettered while the
console runs show up on its pages.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from tests.acceptance.conftest import headers_of, kafka_idem, read_all
from tests.conftest import BOOTSTRAP, end_offsets, wait_for
from tests.integration.console_support import (
    Page,
    World,
    console,
    get,
    order,
    order_key,
    produce_one,
    walk,
    world,
)

PERMANENT = [f"f{i:03d}" for i in range(110)]
WAITING = [f"w{i}" for i in range(4)]


@pytest.fixture(scope="module")
def w(admin: AdminClient, template_db: str) -> Iterator[World]:
    with world(admin, template_db) as w:
        w.produce(
            orders=[(o.encode(), order("t1", o, "permanent", note=f"bad {o}")) for o in PERMANENT]
            + [(o.encode(), order("t1", o, "wait")) for o in WAITING]
            + [(b"c1", order("t1", "c1")), (b"g1", b"\x00not json"), (b"g2", b"{nope")]
            + [(b"ok1", order("t1", "ok1"))],
            refunds=[(f"rf{i}".encode(), order("t2", f"rf{i}", "permanent")) for i in range(5)])
        w.run(dead_letters=len(PERMANENT) + len(WAITING) + 2 + 5)
        # the same key with another amount after it succeeded: a payload conflict
        w.produce(orders=[(b"c1", json.dumps({"tenant": "t1", "order": "c1", "amount": 2,
                                              "do": "ok"}).encode())])
        w.run(dead_letters=len(PERMANENT) + len(WAITING) + 2 + 5 + 1)
        # dead letters written by hand: from before namespaces (none), another app's
        for ns in (None, b"other"):
            produce_one(w.dlq, b"hand", b'{"tenant": "t9", "order": "h", "amount": 1}', [
                ("idem.error.kind", b"permanent"), ("idem.error.class", b"ByHand"),
                ("idem.key", b"t9:order:h"), ("idem.handler", b"order"),
                ("idem.original.topic", w.orders.encode()),
                *([("idem.namespace", ns)] if ns else [])], partition=1)
        # a dead letter written in a transaction that aborted: its offset and its
        # transaction's marker hold no record a reader sees
        producer = Producer({"bootstrap.servers": BOOTSTRAP,
                             "transactional.id": f"aborting-{uuid.uuid4().hex}"})
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(w.dlq, key=b"aborted", value=b"{}", partition=0,
                         headers=[("idem.error.kind", b"permanent")])
        assert producer.flush(30) == 0  # on the broker, then aborted
        producer.abort_transaction(30)
        yield w


@pytest.fixture(scope="module")
def letters(w: World) -> list[Any]:
    """Every record of the DLQ, read straight from the broker."""
    return read_all(w.dlq)


@pytest.fixture(scope="module")
def client(w: World, letters: list[Any]) -> Iterator[Any]:
    with console(w.app) as c:
        yield c


def listed(client: Any, w: World, **filters: Any) -> list[tuple[int, int]]:
    pages, _ = walk(client, f"/dlq?{urlencode({'topic': w.dlq, **filters})}")
    return [pos for p in pages for pos in p.letter_links()]


def cli_list(w: World, **filters: Any) -> set[tuple[int, int]]:
    args = []
    for name, value in filters.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    r = kafka_idem("dlq", "list", "--dlq", w.dlq, "--json", *args)
    if r.code == 1:  # nothing matched
        return set()
    assert r.code == 0, r.err
    return {(x["partition"], x["offset"]) for x in r.json()}


def test_the_filters_select_what_dlq_list_selects(w: World, client: Any,
                                                  letters: list[Any]) -> None:
    times = sorted(headers_of(m)["idem.last_failure_at"] for m in letters
                   if "idem.last_failure_at" in headers_of(m))
    mid, late = times[len(times) // 3], times[2 * len(times) // 3]
    cases: list[dict[str, Any]] = [
        {"kind": "permanent"}, {"kind": "exhausted"}, {"kind": "undecodable"},
        {"kind": "payload_conflict"}, {"error_class": "Retryable"}, {"error_class": "ByHand"},
        {"handler": "refund"}, {"handler": "order", "kind": "permanent"},
        {"key": order_key("f007")}, {"key": "t9:order:h"}, {"namespace": "other"},
        {"namespace": "consoled", "kind": "permanent", "handler": "order"},
        {"partition": 1, "from_offset": 3, "to_offset": 40}, {"from_offset": 50},
        {"since": mid}, {"since": mid, "until": late}, {"until": mid, "kind": "permanent"},
    ]
    with ThreadPoolExecutor(8) as pool:  # one CLI process per case, side by side
        by_cli = list(pool.map(lambda f: cli_list(w, **f), cases))
    for filters, expected in zip(cases, by_cli, strict=True):
        web = listed(client, w, **filters)
        assert len(web) == len(set(web)), filters
        assert set(web) == expected, filters
        assert expected, filters  # no vacuous case
    assert len(listed(client, w, kind="permanent")) > 100  # more than two pages of them


def test_the_next_page_links_walk_every_record_once_newest_first(
        w: World, client: Any) -> None:
    letters = read_all(w.dlq)
    pages, urls = walk(client, f"/dlq?topic={quote(w.dlq)}")
    got = [pos for p in pages for pos in p.letter_links()]
    newest_first = sorted(letters, key=lambda m: (m.timestamp()[1], m.partition(), m.offset()),
                          reverse=True)
    assert got == [(m.partition(), m.offset()) for m in newest_first]
    assert len(pages) == len(letters) // 50 + 1 >= 3
    # a filter is kept from page to page
    pages, urls = walk(client, f"/dlq?{urlencode({'topic': w.dlq, 'kind': 'permanent'})}")
    assert len(pages) == 3 and all("kind=permanent" in u for u in urls)


def letter_url(w: World, partition: int, offset: int) -> str:
    return f"/letter?{urlencode({'topic': w.dlq, 'partition': partition, 'offset': offset})}"


def letter(client: Any, w: World, m: Any) -> Page:
    return get(client, letter_url(w, m.partition(), m.offset()))


def by_key(letters: list[Any], kafka_key: bytes, kind: str | None = None) -> Any:
    found = [m for m in letters if m.key() == kafka_key
             and kind in (None, headers_of(m).get("idem.error.kind"))]
    return found[-1]


def header_table(page: Page) -> dict[str, str]:
    import html
    import re

    table = page.html[page.html.index('id="headers"'):]
    table = table[:table.index("</table>")]
    return {html.unescape(k): html.unescape(v) for k, v in re.findall(
        r"<tr><td>(.*?)</td><td class=\"value\">(.*?)</td></tr>", table)}


def test_a_letter_shows_its_headers_its_decoded_payload_and_its_keys_state(
        w: World, client: Any, letters: list[Any]) -> None:
    m = by_key(letters, b"f007")
    page = letter(client, w, m)
    assert header_table(page) == headers_of(m)  # every header, as sent
    assert json.loads(page.text("payload")) == json.loads(m.value())
    assert "decoded by handler &#39;order&#39;, json" in page.html
    assert page.text("record-status") == "failed"
    assert page.href("record-link") == f"/record?ns=consoled&key={quote(order_key('f007'))}"
    assert page.text("trust").startswith("inside the app's")  # a replay would act on it

    m = by_key(letters, b"w2")  # exhausted: its attempts, its state
    page = letter(client, w, m)
    assert header_table(page)["idem.attempts"] == "2"
    assert page.text("record-status") == "failed"
    assert "exhausted: Retryable" in page.text("state")

    m = by_key(letters, b"c1", "payload_conflict")  # the key succeeded, the twin did not
    page = letter(client, w, m)
    assert page.text("record-status") == "succeeded"
    assert json.loads(page.text("payload"))["amount"] == 2

    m = by_key(letters, b"g2")  # not JSON: as text, and why
    page = letter(client, w, m)
    assert page.text("payload") == "{nope"
    assert "does not decode" in page.text("payload-error")
    assert page.text("no-record").startswith("the dead letter names no key")

    hand = [x for x in letters if x.key() == b"hand"]
    page = letter(client, w, hand[0])  # no namespace: the key has no record anywhere
    assert page.text("no-record") == "no record of key t9:order:h in the store"


def test_a_position_without_a_record_is_a_404(w: World, client: Any) -> None:
    ends = end_offsets(w.dlq)
    present = {(m.partition(), m.offset()) for m in read_all(w.dlq)}
    # offsets inside the partitions that hold no record: the dead letters are written in
    # transactions, whose commit markers take offsets of their own
    markers = sorted({(p, o) for p in ends for o in range(ends[p])} - present)
    assert len(markers) == 2, markers
    for partition, offset in [(0, ends[0]), (1, ends[1] + 1000), (0, 10**12), (7, 0),
                              markers[0], markers[-1]]:
        r = client.get(letter_url(w, partition, offset))
        assert r.status_code == 404, (partition, offset, r.status_code)
        assert w.dlq in Page(r.text).text("error")
        if partition in ends:
            assert Page(r.text).text("error") == f"no record at {w.dlq}[{partition}]@{offset}"
    for query in ({"topic": "not-its-dlq", "partition": 0, "offset": 0},
                  {"topic": w.dlq, "partition": 0}, {"topic": w.dlq, "partition": "x",
                                                      "offset": 0}):
        assert client.get(f"/letter?{urlencode(query)}").status_code == 400, query
    for before in ("WyJ4Il0=", "WzEsIDJd", "WyJhIiwgImIiLCAiYyJd", "%%%"):
        r = client.get(f"/dlq?{urlencode({'topic': w.dlq, 'before': before})}")
        assert r.status_code == 400, before
    assert client.get(f"/dlq?{urlencode({'topic': w.dlq, 'kind': 'bogus'})}").status_code == 400


def test_records_dead_lettered_while_the_console_runs_show_up(w: World) -> None:
    with console(w.app) as c:
        before = listed(c, w)
        pos = produce_one(w.dlq, b"late", b'{"late": true}', [
            ("idem.error.kind", b"permanent"), ("idem.key", b"t1:order:late"),
            ("idem.last_failure_at", dt.datetime.now(dt.UTC).isoformat().encode())])
        wait_for(lambda: listed(c, w)[:1] == [pos], timeout=30,
                 what="the new dead letter on the first page")
        assert listed(c, w)[1:] == before
        assert listed(c, w, key="t1:order:late") == [pos]
        assert get(c, f"/dlq?topic={quote(w.dlq)}").text("letters")
