"""The outbox from the command line: ``topics create`` makes the event and control
topics, ``run --no-relay`` leaves the events in the outbox (``status`` shows them),
``kafka-idem relay`` publishes them and stops cleanly on SIGTERM, ``run`` publishes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import psycopg
from confluent_kafka.admin import AdminClient, ConfigResource

from consumers.payments import encode_charge
from kafka_idem import App
from tests.acceptance.test_cli_admin import kafka_idem
from tests.conftest import (
    BOOTSTRAP,
    DB,
    ROOT,
    Members,
    Topics,
    caught_up,
    member_env,
    produce,
    wait_for,
)
from tests.integration.outbox_support import outbox_rows, read_committed, write_events

APP = "tests.apps.outbox:app"


def test_topics_create_relay_status_and_run(
    db: DB, topics: Topics, members: Members, group: str, admin: AdminClient
) -> None:
    tag = uuid.uuid4().hex[:8]
    source, events, prefix = f"t-{tag}", f"ev-{tag}", f"p{tag}-"
    control = f"{prefix}kafka-idem-outbox.outbox"
    topics.created += [source, f"{source}.dlq", events, control]  # deleted at the end
    env = member_env(db, source, OUTBOX_EVENTS=events, KAFKA_IDEM_NAME_PREFIX=prefix,
                     KAFKA_IDEM_OUTBOX_SHARDS="3")
    made = subprocess.run([sys.executable, "-m", "kafka_idem.cli", "topics", "create", APP],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert f"created       {control} (outbox control topic, 3 partitions" in made.stdout
    assert f"created       {events} (declared, 2 partitions" in made.stdout
    config = admin.describe_configs([ConfigResource("topic", control)])
    described = next(iter(config.values())).result(timeout=30)
    assert described["cleanup.policy"].value == "compact"

    produce(source, [(o.encode(), encode_charge("t1", o, "1.00")) for o in ("o1", "o2", "o3")])
    members.start(APP, env, group=group, args=("--no-relay",))
    wait_for(lambda: caught_up(group, source), what="the charges")
    assert len(outbox_rows(db)) == 3 and read_committed(events) == []
    status = kafka_idem(db, "status", "--json")
    assert status.returncode == 0, status.stderr
    outbox = json.loads(status.stdout)["outbox"]
    assert outbox["outbox"]["pending"] == 3 and outbox["outbox"]["oldest_age_seconds"] >= 0

    log = open(members.tmp / "relay.log", "wb")  # noqa: SIM115
    relay = subprocess.Popen([sys.executable, "-m", "kafka_idem.cli", "relay", APP], cwd=ROOT,
                             env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: not outbox_rows(db) and len(read_committed(events)) == 3,
                 what="the relay to publish")
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(timeout=60)
    assert code == 0
    assert "outbox relay stopped" in (members.tmp / "relay.log").read_text()

    members.stop_all()
    members.start(APP, env, group=group)  # run publishes by default
    produce(source, [(b"o4", encode_charge("t1", "o4", "1.00"))])
    wait_for(lambda: not outbox_rows(db) and len(read_committed(events)) == 4,
             what="run's relay to publish")
    assert sorted(m.key() for m in read_committed(events)) == [b"o1", b"o2", b"o3", b"o4"]


def test_a_relay_killed_mid_flight_is_taken_over_without_loss_or_duplicate(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    source, events, prefix = f"t-{tag}", f"ev-{tag}", f"p{tag}-"
    control = f"{prefix}kafka-idem-outbox.outbox"
    topics.create([events], partitions=2)
    topics.create([control], partitions=4)
    env = member_env(db, source, OUTBOX_EVENTS=events, KAFKA_IDEM_NAME_PREFIX=prefix,
                     KAFKA_IDEM_OUTBOX_BATCH="200")
    writer = App("outbox", database_url=db.dsn, bootstrap_servers=BOOTSTRAP)
    writer.event_topic(events)
    total = 20_000
    with psycopg.connect(db.dsn) as conn:
        for b in range(total // 1000):
            write_events(conn, writer, events, [(f"k{j % 50}", {"b": b, "j": j})
                                                for j in range(1000)], n=b)

    def relay(n: int) -> subprocess.Popen[bytes]:
        log = open(members.tmp / f"relay-{n}.log", "wb")  # noqa: SIM115
        return subprocess.Popen([sys.executable, "-m", "kafka_idem.cli", "relay", APP],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    first = relay(0)
    try:
        wait_for(lambda: len(outbox_rows(db)) <= total - 2000, what="the first relay under way")
    finally:
        first.kill()  # SIGKILL, wherever it is: mid-transaction, or between commit and delete
        first.wait(30)
    second = relay(1)
    try:
        wait_for(lambda: not outbox_rows(db), timeout=120, what="the second relay to drain")
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    got = read_committed(events, timeout=60)
    ids = [dict(m.headers())["idem.outbox.id"] for m in got]
    assert len(ids) == total and len(set(ids)) == total
    for key in {m.key() for m in got}:  # one key's events in the order they were written
        seq = [json.loads(m.value())["b"] for m in got if m.key() == key]
        assert seq == sorted(seq)
