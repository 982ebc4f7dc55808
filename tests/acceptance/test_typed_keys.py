"""Keys without a model keep their values' types apart, through ``kafka-idem run``
against the real broker and database.

Found by a trial of the DLQ's trust: with ``model=None`` the payload is the JSON's
dict, and ``{"tenant": 7}`` and ``{"tenant": "7"}`` built one key, so the second
intent was answered as a duplicate of the first. A key field must now hold a
string: the number is dead-lettered (permanent, ``InvalidKey`` naming the field), the
string takes effect once.
"""

from __future__ import annotations

import json

from tests.acceptance.conftest import headers_of, read_all
from tests.conftest import (
    DB,
    Members,
    Topics,
    caught_up,
    committed,
    member_env,
    produce,
    wait_for,
)


def test_a_number_and_its_text_in_a_key_field_are_two_intents_never_one_key(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = topics(partitions=1)
    produce(topic, [(None, json.dumps({"tenant": 7, "order": "a"}).encode()),
                    (None, json.dumps({"tenant": "7", "order": "a"}).encode())])
    members.start("tests.apps.rawkeys:app", member_env(db, topic, RAWKEYS_TOPIC=topic),
                  group=group)
    wait_for(lambda: caught_up(group, topic) and len(read_all(f"{topic}.dlq")) == 1,
             timeout=90, what="both messages handled")
    [letter] = read_all(f"{topic}.dlq")
    h = headers_of(letter)
    assert (h["idem.error.kind"], h["idem.error.class"], h["idem.original.offset"]) == (
        "permanent", "InvalidKey", "0")
    assert h["idem.error.message"].startswith("key field 'tenant' holds a JSON number, not "
                                              "a string"), h["idem.error.message"]
    assert "idem.key" not in h
    assert [(r["idempotency_key"], r["status"]) for r in db.records()] == [
        ("7:raw:a", "succeeded")]
    assert [(r["tenant_id"], r["idempotency_key"]) for r in db.ledger()] == [("7", "7:raw:a")]
    assert committed(group, topic) == {0: 2}
