"""The first hour with an app of one's own, through the CLI as a subprocess, from a
folder of its own (not this repository's examples): each wall a new user met.

* topics: ``run`` says once which topics are missing and the command that creates
  them (no librdkafka ``UNKNOWN_TOPIC_OR_PART`` lines); ``topics create`` makes them,
  idempotently, with its documented exit codes; the first processed message shows at
  INFO, a burst does not flood;
* a wrong ``schema=`` stops ``run`` before it joins the group: exit 2, one line naming
  the handler and the setting;
* a configuration error while processing: an ERROR line with its text, a metric, the
  partition held (nothing charged) until the fix and a restart;
* static membership: the member joins with its ``group.instance.id``; a second member
  with the same id ends the first with exit 2 naming the setting; a SIGKILLed member
  restarted with its id gets its partitions back and processes them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from tests.acceptance.conftest import KAFKA_IDEM, Result
from tests.conftest import BOOTSTRAP, DB, Topics, committed, wait_for

APP = '''\
import os

from pydantic import BaseModel

from kafka_idem import App, ConfigError, Context

TOPIC = os.environ["INVENTORY_TOPIC"]


class Reserve(BaseModel):
    shop: str
    order_id: str
    sku: str
    qty: int


app = App("inventory")


@app.handler(topic=TOPIC, model=Reserve, key="{{shop}}:reserve:{{order_id}}",
             hash_fields=("sku", "qty"){options})
def reserve(msg: Reserve, ctx: Context) -> dict:
    if os.environ.get("INVENTORY_BROKEN") and not os.environ.get("INVENTORY_API_URL"):
        raise ConfigError("INVENTORY_API_URL is not set", setting="inventory_api_url")
    return {{"reserved": msg.qty}}
'''

PRODUCE = '''\
import sys

from app import TOPIC, app

with app.producer() as producer:
    for n in range(int(sys.argv[1]), int(sys.argv[2])):
        producer.send(TOPIC, {"shop": "s1", "order_id": f"o-{n}", "sku": "k-9", "qty": 2})
'''


class Folder:
    """A user's project folder: app.py, produce.py, and the CLI run from there."""

    def __init__(self, path: Path, db: DB, *, options: str = "") -> None:
        self.path = path
        self.topic = f"inv-{uuid.uuid4().hex[:10]}"
        self.group = f"g-{uuid.uuid4().hex[:10]}"
        (path / "app.py").write_text(APP.format(options=options))
        (path / "produce.py").write_text(PRODUCE)
        self.env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
                    "KAFKA_IDEM_DATABASE_URL": db.dsn, "KAFKA_IDEM_GROUP_ID": self.group,
                    "INVENTORY_TOPIC": self.topic, "COLUMNS": "200"}
        self.env.pop("PYTHONPATH", None)  # the folder's own app, not this repository's
        self.members: list[subprocess.Popen[bytes]] = []

    def cli(self, *args: str, timeout: float = 60, **env: str) -> Result:
        proc = subprocess.run([*KAFKA_IDEM, *args], cwd=self.path, env={**self.env, **env},
                              capture_output=True, text=True, timeout=timeout)
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def produce(self, start: int, stop: int) -> None:
        subprocess.run([sys.executable, "produce.py", str(start), str(stop)], cwd=self.path,
                       env=self.env, check=True, timeout=60)

    def start(self, *args: str, log: str = "member", **env: str) -> subprocess.Popen[bytes]:
        out = (self.path / f"{log}.log").open("ab")
        proc = subprocess.Popen([*KAFKA_IDEM, "run", "app:app", *args], cwd=self.path,
                                env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT)
        self.members.append(proc)
        return proc

    def log(self, name: str = "member") -> str:
        path = self.path / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, text: str, name: str = "member", timeout: float = 60) -> str:
        return str(wait_for(lambda: text in (got := self.log(name)) and got,
                            what=f"{text!r} in {name}.log", timeout=timeout))

    def stop_all(self) -> None:
        for p in self.members:
            if p.poll() is None:
                p.terminate()
        for p in self.members:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def folder(tmp_path: Path, db: DB, topics: Topics) -> Iterator[Folder]:
    f = Folder(tmp_path, db)
    topics.created += [f.topic, f"{f.topic}.dlq"]  # whoever creates them, they go
    yield f
    f.stop_all()


def succeeded(db: DB) -> set[str]:
    rows = db.rows("SELECT idempotency_key FROM kafka_idem.task_idempotency "
                   "WHERE status = 'succeeded'")
    return {r["idempotency_key"] for r in rows}


# --- topics -------------------------------------------------------------------------------


def test_run_names_the_missing_topics_once_and_topics_create_makes_them(
    folder: Folder, db: DB,
) -> None:
    member = folder.start()
    warning = folder.wait_log("do not exist")
    assert (f"WARNING kafka_idem.consume.runner: topics {folder.topic}, {folder.topic}.dlq do not "
            "exist; create them with: kafka-idem topics create app:app") in warning

    dry = folder.cli("topics", "create", "app:app", "--dry-run")
    assert (dry.code, dry.out.splitlines()) == (0, [
        f"would create  {folder.topic} (source, the broker's default partitions)",
        f"would create  {folder.topic}.dlq (dead-letter topic, as many partitions as its "
        "source, retention 30 days)",
        "would create 2 topic(s); 0 existed already"]), dry.err
    made = folder.cli("topics", "create", "app:app", "--partitions", "2")
    assert (made.code, made.out.splitlines()) == (0, [
        f"created       {folder.topic} (source, 2 partitions)",
        f"created       {folder.topic}.dlq (dead-letter topic, 2 partitions, retention 30 days)",
        "created 2 topic(s); 0 existed already"]), made.err
    again = folder.cli("topics", "create", "app:app")
    assert (again.code, again.out.splitlines()[-1]) == (0, "created 0 topic(s); 2 existed already")

    folder.wait_log(f"topic {folder.topic} exists now")
    folder.produce(0, 1)
    first = folder.wait_log("processed 1 message(s)")
    assert f"processed 1 message(s): {folder.topic}: succeeded 1 action=progress" in first
    folder.produce(1, 41)
    wait_for(lambda: len(succeeded(db)) == 41, what="41 reservations")
    member.send_signal(signal.SIGTERM)
    assert member.wait(timeout=30) == 0
    log = folder.log()
    lines = [ln for ln in log.splitlines() if "action=progress" in ln]
    assert 2 <= len(lines) <= 4, lines  # the first at once, then per interval: not 41 lines
    assert sum(int(re.search(r"processed (\d+)", ln)[1]) for ln in lines) == 41  # type: ignore[index]
    assert log.count("do not exist") == 1
    assert "UNKNOWN_TOPIC_OR_PART" not in log and "Subscribed topic not available" not in log


def test_topics_create_exit_codes_follow_the_cli_reference(folder: Folder) -> None:
    refused = folder.cli("topics", "create", "app:app", "--replication-factor", "3")
    assert refused.code == 2
    assert refused.err.startswith(f"error: Kafka refused to create topic '{folder.topic}': ")
    assert refused.err.rstrip().endswith("(setting=replication_factor)")
    assert len(refused.err.splitlines()) == 1
    bad = folder.cli("topics", "create", "app:app", "--partitions", "0")
    assert bad.code == 2 and "--partitions" in bad.err
    down = folder.cli("topics", "create", "app:app", KAFKA_IDEM_BOOTSTRAP_SERVERS="127.0.0.1:9")
    assert down.code == 3
    assert down.err.splitlines()[-1].startswith("error: Kafka did not answer a metadata request")
    assert down.err.splitlines()[-1].endswith(
        "(the brokers are KAFKA_IDEM_BOOTSTRAP_SERVERS, or --bootstrap-servers)")


# --- start-up validation ---------------------------------------------------------------------


SCHEMAS = {"Reserve": {"shop": "string", "order_id": "string", "sku": "string", "qty": "int"},
           "Cancel": {"shop": "string", "order_id": "string"}}


@pytest.mark.parametrize(("options", "wanted"), [
    (', schema="inventory.Nope"',
     "error: handler 'reserve': schema 'inventory.Nope' is not among the Avro schemas of "
     "'schemas' (KAFKA_IDEM_SCHEMAS_DIR; found: inventory.Cancel, inventory.Reserve) "
     "(setting=schema)"),
    (', schema="inventory.Cancel"',
     "error: handler 'reserve': schema 'inventory.Cancel' does not fit the handler: it has no "
     "field ['sku', 'qty'], which Reserve requires (setting=schema)"),
])
def test_a_wrong_schema_stops_run_before_it_joins_the_group(
    tmp_path: Path, db: DB, admin: AdminClient, topics: Topics, options: str, wanted: str,
) -> None:
    folder = Folder(tmp_path, db, options=options)
    topics.create([folder.topic, f"{folder.topic}.dlq"])
    (tmp_path / "schemas").mkdir()
    for name, fields in SCHEMAS.items():
        record = {"type": "record", "name": name, "namespace": "inventory",
                  "fields": [{"name": f, "type": t} for f, t in fields.items()]}
        (tmp_path / "schemas" / f"{name.lower()}.avsc").write_text(json.dumps(record))
    got = folder.cli("run", "app:app", timeout=60)
    assert (got.code, got.err.splitlines()) == (2, [wanted])
    described = admin.describe_consumer_groups([folder.group])[folder.group].result(timeout=30)
    assert described.members == []  # never joined
    assert committed(folder.group, folder.topic) == {0: -1001}


def test_a_session_timeout_the_broker_refuses_stops_run_naming_the_setting_and_bound(
    folder: Folder, topics: Topics,
) -> None:
    topics.create([folder.topic, f"{folder.topic}.dlq"])
    got = folder.cli("run", "app:app", "--max-seconds", "30", KAFKA_IDEM_SESSION_TIMEOUT_MS="1000")
    assert got.code == 2, got.err  # not a join retried forever
    assert re.fullmatch(
        r"error: the broker refused session_timeout_ms=1000 \(KAFKA_IDEM_SESSION_TIMEOUT_MS\) "
        rf"when this member joined group '{folder.group}' \(INVALID_SESSION_TIMEOUT\): it must "
        r"be within the broker's group.min.session.timeout.ms=\d+ and "
        r"group.max.session.timeout.ms=\d+ \(setting=session_timeout_ms\)",
        got.err.splitlines()[-1]), got.err
    assert "consumer error" not in got.err


def test_an_unknown_librdkafka_option_is_a_configuration_error(folder: Folder) -> None:
    got = folder.cli("run", "app:app", "--max-seconds", "5",
                     KAFKA_IDEM_KAFKA='{"linger.ms": 5, "nope.option": 1}')
    assert (got.code, got.err.splitlines()) == (2, [
        "error: invalid setting kafka (KAFKA_IDEM_KAFKA): Value error, librdkafka refuses "
        "option 'nope.option': No such configuration property: \"nope.option\""]), got.err


# --- a configuration error while processing -----------------------------------------------------


def metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


def test_a_configuration_error_while_processing_is_loud_counted_and_holds_until_fixed(
    folder: Folder, db: DB, topics: Topics,
) -> None:
    topics.create([folder.topic, f"{folder.topic}.dlq"])
    member = folder.start("--metrics-port", "0", INVENTORY_BROKEN="1")
    port = int(re.search(r"metrics endpoint started on 127\.0\.0\.1:(\d+)",  # type: ignore[union-attr]
                         folder.wait_log("metrics endpoint started"))[1])
    folder.wait_log("assigned")
    folder.produce(0, 2)
    error = folder.wait_log("configuration error at")
    assert (f"ERROR kafka_idem.consume.config_hold: handler 'reserve': configuration error at "
            f"{folder.topic}[0]@0: INVENTORY_API_URL is not set (setting=inventory_api_url); "
            "the partition waits (the message is not charged)") in error
    labels = {"topic": folder.topic, "handler": "reserve"}
    wait_for(lambda: metric(port, "kafka_idem_config_errors_total", **labels) >= 3,
             what="the error counted on each retry", timeout=30)
    assert member.poll() is None  # held, not stopped: other partitions would go on
    assert folder.log().count("configuration error at") == 1  # one line a minute at most
    assert db.records() == []  # nothing charged, nothing recorded
    member.send_signal(signal.SIGTERM)
    assert member.wait(timeout=30) == 0

    fixed = folder.start(log="fixed", INVENTORY_BROKEN="1", INVENTORY_API_URL="http://stock")
    wait_for(lambda: succeeded(db) == {"s1:reserve:o-0", "s1:reserve:o-1"},
             what="both reservations after the fix")
    fixed.send_signal(signal.SIGTERM)
    assert fixed.wait(timeout=30) == 0
    assert all(r["attempts"] == 1 for r in db.records())  # never charged while held


# --- static membership -------------------------------------------------------------------------


def members_of(admin: AdminClient, group: str) -> list[Any]:
    return list(admin.describe_consumer_groups([group])[group].result(timeout=30).members)


def test_static_membership_keeps_the_members_place_and_refuses_a_twin(
    folder: Folder, db: DB, admin: AdminClient, topics: Topics,
) -> None:
    topics.create([folder.topic, f"{folder.topic}.dlq"], partitions=2)
    first = folder.start("--instance-id", "inventory-{hostname}")
    folder.wait_log("assigned")
    wanted = f"inventory-{os.uname().nodename}"
    assert [m.group_instance_id for m in members_of(admin, folder.group)] == [wanted]

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    again = folder.start(log="again", KAFKA_IDEM_GROUP_INSTANCE_ID="inventory-{hostname}")
    folder.wait_log("assigned", name="again")
    folder.produce(0, 4)
    wait_for(lambda: len(succeeded(db)) == 4, what="the restarted member's partitions")
    assert [m.group_instance_id for m in members_of(admin, folder.group)] == [wanted]

    twin = folder.start(log="twin", KAFKA_IDEM_GROUP_INSTANCE_ID="inventory-{hostname}")
    assert again.wait(timeout=60) == 2  # the older one is replaced and says why
    assert ("error: another member of group "
            f"'{folder.group}' joined with this member's group.instance.id '{wanted}' and "
            "replaced it: every member needs its own (KAFKA_IDEM_GROUP_INSTANCE_ID, or run "
            "--instance-id) (setting=group_instance_id)") in folder.log("again")
    assert twin.poll() is None
