"""Framework bugs the chaos run found, each reduced to a deterministic test.

1. Batch path, ``KeyError`` in ``batch._run_handlers`` (found by ``tools.chaos.run --seed 1``:
   a member crashed with exit code 1). A batch holds two messages of one key whose
   record exists and is not ``succeeded`` (here: ``failed``, the original charge was
   invalid): first a payload conflict, then a re-send of the original.
   ``batch._claim`` answers the key's *first* occurrence (conflict) and claims
   nothing for it; ``_run_handlers`` then takes the *second* occurrence as the key's
   first run and looks up ``claims[key]``: ``KeyError``, which ``run_local`` does not
   catch, so the member process dies. Every member that fetches the same batch dies
   the same way. With no other key claimed in the batch, the same hole shows as
   the ``assert item.result is not None`` in ``run_batch`` instead. Fixed in 3ddffb5.
"""

from __future__ import annotations

import pytest

from consumers.payments import build_app, encode_charge
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    headers,
    produce,
    read_topic,
    wait_for,
)


@pytest.mark.parametrize("other_key", [False, True], ids=["alone", "with-another-key"])
def test_conflict_then_resend_of_a_failed_key_in_one_batch(db: DB, topics: Topics, group: str,
                                                            other_key: bool) -> None:
    topic = topics(partitions=1)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "-5.00"))])  # invalid: failed, DLQ
    with InProcess(build_app(topic=topic, **app_settings(db, group_id=group))):
        wait_for(lambda: caught_up(group, topic), what="the invalid charge to be rejected")
    assert db.record("t1:charge:o1")["status"] == "failed"  # type: ignore[index]

    # Both fetched together by the next member: one batch.
    batch = [(b"o1", encode_charge("t1", "o1", "-6.00")),  # same key, other payload
             (b"o1", encode_charge("t1", "o1", "-5.00"))]  # a re-send of the original
    if other_key:
        batch.append((b"o2", encode_charge("t1", "o2", "3.00")))  # a new key, claimed
    produce(topic, batch)
    with InProcess(build_app(topic=topic, **app_settings(db, group_id=group))) as r:
        wait_for(lambda: r.error is not None or caught_up(group, topic), timeout=30,
                 what="the batch to be processed")
        assert r.error is None, f"the member died: {r.error!r}"

    kinds = {int(headers(m)["idem.original.offset"]): headers(m)["idem.error.kind"]
             for m in read_topic(f"{topic}.dlq")}
    assert kinds == {0: "permanent", 1: "payload_conflict", 2: "permanent"}
    assert db.ledger_counts() == ({"t1:charge:o2": 1} if other_key else {})
