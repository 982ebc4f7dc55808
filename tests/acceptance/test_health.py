"""``/livez``, ``/readyz`` and the gauges that are 0 when all is well, on real
``kafka-idem run`` processes: a handler is held (it waits while a file exists), so the
member is caught mid-work and each signal must show it, then let go.

* leased mode (the handler on a worker thread, the claim committed): the loop stays
  live; the record is ``processing`` (gauge 1), long-running after 1 s (gauge 1); the
  member is not ready (its partition is behind); a claim left by a member that died
  (planted in the store with a lease that expires) shows as an expired lease;
* local mode (the batch runs in the loop thread): the loop makes no progress, so
  ``/livez`` fails while ``/metrics`` still answers, which is what the old health
  check scraped.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from consumers.payments import encode_charge
from kafka_idem.store import Delivery, Store, connect
from tests.conftest import DB, Members, Topics, caught_up, member_env, produce, wait_for
from tests.integration.test_metrics import free_port, parse, scrape, value

VARIANTS = "tests.apps.variants:app"


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def answers(port: int, path: str, code: int) -> dict[str, Any] | None:
    try:
        got, body = probe(port, path)
    except OSError:
        return None
    return body if got == code else None


def gauges(port: int) -> dict[str, float]:
    fs = parse(scrape(port))
    return {"processing": value(fs, "kafka_idem_records", status="processing"),
            "expired": value(fs, "kafka_idem_expired_leases"),
            "long_running": value(fs, "kafka_idem_long_running_records")}


def test_a_held_leased_handler_shows_in_readiness_and_the_gauges_and_the_loop_stays_live(
    db: DB, topics: Topics, members: Members, group: str, tmp_path: Path
) -> None:
    topic = topics(partitions=1)
    block = tmp_path / "hold"
    block.touch()
    port = free_port()
    env = member_env(db, topic, PAYMENTS_MODE="leased", BLOCK_FILE=str(block),
                     BLOCK_ORDERS="o1", KAFKA_IDEM_LONG_RUNNING_SECONDS="1",
                     KAFKA_IDEM_METRICS_SAMPLE_SECONDS="0.2", KAFKA_IDEM_LIVENESS_SECONDS="3",
                     KAFKA_IDEM_READINESS_MAX_LAG="0", KAFKA_IDEM_LEASE_SECONDS="5")
    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port)))
    ready = wait_for(lambda: answers(port, "/readyz", 200), timeout=60,
                     what="the member to be ready on an empty topic")
    assert ready["assigned"] == 1 and ready["max_lag"] == 0, ready

    produce(topic, [(b"o1", encode_charge("t1", "o1", "1.00")),
                    (b"o2", encode_charge("t1", "o2", "1.00"))])
    held = wait_for(lambda: (g := gauges(port))["processing"] == 1 and g["long_running"] == 1
                    and g, timeout=30, what="the held record as processing and long-running")
    assert held["expired"] == 0  # the heartbeat keeps the held lease alive
    assert db.record("t1:charge:o1")["status"] == "processing"  # type: ignore[index]
    behind = wait_for(lambda: answers(port, "/readyz", 503), timeout=20,
                      what="/readyz to say the partition is behind")
    assert "behind" in behind["reason"] and behind["max_lag"] == 2, behind
    live_code, live = probe(port, "/livez")
    assert live_code == 200 and live["last_round_seconds_ago"] < 3, live

    # A member that died mid-handler leaves a claim whose lease runs out.
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="variants")
    conn = connect(db.dsn)
    with conn.transaction():
        store.claim(conn, key="t9:charge:orphan", request_hash="v1:x",
                    delivery=Delivery(topic, 0, 99, "charge"), lease_seconds=0.2,
                    max_attempts=5, max_elapsed_seconds=3600)
    conn.close()
    wait_for(lambda: gauges(port)["expired"] == 1, timeout=20,
             what="the expired lease gauge to count the orphaned claim")

    block.unlink()  # let the handler go on
    wait_for(lambda: caught_up(group, topic), timeout=30, what="the group to catch up")
    done = wait_for(lambda: answers(port, "/readyz", 200), timeout=20,
                    what="/readyz once caught up")
    assert done["max_lag"] == 0
    wait_for(lambda: gauges(port) == {"processing": 1, "expired": 1, "long_running": 1},
             timeout=20, what="only the orphan left processing")
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o2": 1}


def test_a_loop_stuck_in_a_local_batch_fails_livez_while_metrics_still_answers(
    db: DB, topics: Topics, members: Members, group: str, tmp_path: Path
) -> None:
    topic = topics(partitions=1)
    block = tmp_path / "hold"
    block.touch()
    port = free_port()
    env = member_env(db, topic, BLOCK_FILE=str(block), BLOCK_ORDERS="*",
                     KAFKA_IDEM_LIVENESS_SECONDS="1.5")
    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port)))
    wait_for(lambda: answers(port, "/livez", 200), timeout=60, what="/livez")
    produce(topic, [(b"o1", encode_charge("t1", "o1", "1.00"))])
    stuck = wait_for(lambda: answers(port, "/livez", 503), timeout=30,
                     what="/livez to fail while the loop is held")
    assert "no progress" in stuck["reason"], stuck
    assert value(parse(scrape(port)), "kafka_idem_records", status="failed") == 0  # answers
    assert answers(port, "/readyz", 503) is not None  # not live: not ready either
    block.unlink()
    wait_for(lambda: answers(port, "/livez", 200), timeout=30, what="/livez again")
    wait_for(lambda: caught_up(group, topic), timeout=30, what="the group to catch up")
    assert db.ledger_counts() == {"t1:charge:o1": 1}

    # A member that takes over an idle partition (everything committed, nothing new):
    # ready without a message (its fetcher reaching the end says it is caught up).
    members.stop_all()
    port = free_port()
    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port)))
    ready = wait_for(lambda: answers(port, "/readyz", 200), timeout=60,
                     what="the new member to be ready on the idle partition")
    assert ready["assigned"] == 1 and ready["max_lag"] == 0, ready


def test_the_metrics_port_answers_404_elsewhere(db: DB, topics: Topics, members: Members,
                                                 group: str) -> None:
    topic = topics(partitions=1)
    port = free_port()
    members.start(VARIANTS, member_env(db, topic), group=group,
                  args=("--metrics-port", str(port)))
    wait_for(lambda: answers(port, "/livez", 200), timeout=60, what="/livez")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
    except urllib.error.HTTPError as err:
        assert err.code == 404
    else:
        raise AssertionError("/nope answered 200")
