"""The transactional outbox (docs/OUTBOX.md): ctx.emit in every mode, the relay's
exactly-once publication, out-of-order commits, per-key order."""

from __future__ import annotations

import json

from consumers.payments import encode_charge
from tests.conftest import DB, InProcess, Topics, caught_up, headers, produce, wait_for
from tests.integration.outbox_support import RelayThread, outbox_app, wait_published


def charges(*orders: str) -> list[tuple[bytes, bytes]]:
    return [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders]


def test_local_mode_emit_is_published_once_with_the_intent_headers(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    source = app.topics[0]
    produce(source, charges("o1", "o2", "o1"))  # o1 again: a replay emits nothing
    with InProcess(app), RelayThread(app):
        wait_for(lambda: caught_up(group, source), what="the charges")
        got = wait_published(db, events, 2)
    assert sorted(m.key() for m in got) == [b"o1", b"o2"]
    first = next(m for m in got if m.key() == b"o1")
    h = headers(first)
    assert json.loads(first.value()) == {"order_id": "o1", "amount": "1.00"}
    assert h["idem.key"] == "t1:charge:o1"
    assert h["idem.namespace"] == app.namespace
    assert h["idem.source.topic"] == source
    assert (h["idem.source.partition"], h["idem.source.offset"]) == ("0", "0")
    assert h["x-test"] == "yes" and int(h["idem.outbox.id"]) > 0
