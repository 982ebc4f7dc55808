"""`kafka-idem verify` and `kafka-idem dlq replay` on a cluster whose ACLs grant names
by prefix: refused without ``--prefix``, passing with it.

    .venv/bin/python scripts/acl_check.py [--port 49592] [--keep-broker]

Starts a broker of its own (scripts/kafka.sh on ``--port``, its controller on port+1,
a SASL/PLAIN listener on port+2, in .local-acl/), with the StandardAuthorizer,
``allow.everyone.if.no.acl.found=false`` and one user, ``team``, allowed everything on
topics, groups and transactional ids that start with ``team-a.`` (and nothing else).
Then, as ``team`` through the SASL listener, with a fresh database on
KAFKA_IDEM_DATABASE_URL's server:

1. ``verify --scenario 3`` without a prefix fails (its topics are not ``team-a.*``);
2. ``verify --scenario 3 --prefix team-a.`` passes;
3. ``dlq replay`` of a dead letter in ``team-a.pay-<id>.dlq`` without a prefix fails (the
   replay's group and transactional id are ``kafka-idem-replay.*``);
4. the same with ``--prefix team-a.`` republishes it to ``team-a.pay-<id>``.

Exit 0 when all four hold. Too slow for the test suite (a broker start); the suite
checks the names on the shared broker (tests/acceptance/test_cli_prefix.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
KAFKA_IDEM = [str(Path(sys.executable).parent / "kafka-idem")]
PREFIX = "team-a."
USER, PASSWORD = "team", "team-secret"


def broker_config(port: int) -> str:
    sasl, plain, controller = f"127.0.0.1:{port + 2}", f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
    jaas = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'user_{USER}="{PASSWORD}";')
    return "\n".join([
        f"listeners=PLAINTEXT://{plain},CONTROLLER://{controller},SASL_PLAINTEXT://{sasl}",
        # SASL first: scripts/kafka.sh reads the PLAINTEXT port from the first line
        f"advertised.listeners=SASL_PLAINTEXT://{sasl},PLAINTEXT://{plain}",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,"
        "SASL_PLAINTEXT:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms=PLAIN",
        f"listener.name.sasl_plaintext.plain.sasl.jaas.config={jaas}",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        # the broker itself and this script's admin client (PLAINTEXT: ANONYMOUS)
        "super.users=User:ANONYMOUS",
        "allow.everyone.if.no.acl.found=false",
    ]) + "\n"


def kafka_sh(action: str, port: int, local: Path, extra: Path) -> None:
    env = {**os.environ, "KAFKA_IDEM_KAFKA_PORT": str(port), "KAFKA_IDEM_LOCAL_DIR": str(local),
           "KAFKA_IDEM_KAFKA_EXTRA_CONFIG": str(extra)}
    subprocess.run(["bash", str(ROOT / "scripts" / "kafka.sh"), action], env=env, check=True,
                   stdout=subprocess.DEVNULL)


def grant(admin: AdminClient) -> None:
    bindings = [AclBinding(kind, PREFIX, ResourcePatternType.PREFIXED, f"User:{USER}", "*",
                           AclOperation.ALL, AclPermissionType.ALLOW)
                for kind in (ResourceType.TOPIC, ResourceType.GROUP,
                             ResourceType.TRANSACTIONAL_ID)]
    for fut in admin.create_acls(bindings).values():
        fut.result(timeout=30)


def run(args: list[str], env: dict[str, str],
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*KAFKA_IDEM, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"$ kafka-idem {' '.join(args)}  -> exit {proc.returncode}")
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    for line in tail:
        print(f"    {line[:160]}")
    return proc


def dead_letter(super_boot: str, dlq: str, source: str) -> None:
    now = dt.datetime.now(dt.UTC).isoformat().encode()
    headers = [("idem.original.topic", source.encode()), ("idem.original.partition", b"0"),
               ("idem.original.offset", b"0"), ("idem.error.kind", b"undecodable"),
               ("idem.error.class", b"InvalidPayload"), ("idem.error.message", b"not JSON"),
               ("idem.attempts", b"0"), ("idem.first_failure_at", now),
               ("idem.last_failure_at", now), ("idem.consumer_group", b"payments"),
               ("idem.handler", b"charge")]
    p = Producer({"bootstrap.servers": super_boot, "log_level": 0})
    p.produce(dlq, key=b"k1", value=b"not json", headers=headers)
    assert p.flush(30) == 0


def count(super_boot: str, topic: str) -> int:
    c = Consumer({"bootstrap.servers": super_boot, "group.id": "acl-check-probe",
                  "log_level": 0})
    try:
        return int(c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])
    finally:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=49592)
    ap.add_argument("--keep-broker", action="store_true")
    opts = ap.parse_args()
    local = ROOT / ".local-acl"
    local.mkdir(exist_ok=True)
    extra = local / "acl.properties"
    extra.write_text(broker_config(opts.port))
    admin_dsn = os.environ.get("KAFKA_IDEM_DATABASE_URL",
                               "postgresql://kafka_idem@127.0.0.1:55432/kafka_idem")
    dbname = f"kafka_idem_acl_{uuid.uuid4().hex[:8]}"
    super_boot = f"127.0.0.1:{opts.port}"
    kafka_sh("start", opts.port, local, extra)
    results: dict[str, bool] = {}
    try:
        admin = AdminClient({"bootstrap.servers": super_boot, "log_level": 0})
        grant(admin)
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        dsn = psycopg.conninfo.make_conninfo(admin_dsn, dbname=dbname)
        env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": f"127.0.0.1:{opts.port + 2}",
               "KAFKA_IDEM_DATABASE_URL": dsn, "KAFKA_IDEM_ACTOR": "acl-check",
               "KAFKA_IDEM_KAFKA": json.dumps({
                   "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                   "sasl.username": USER, "sasl.password": PASSWORD})}
        env.pop("KAFKA_IDEM_NAME_PREFIX", None)
        assert run(["migrate"], env).returncode == 0

        refused = run(["verify", "--scenario", "3"], env)
        results["verify without --prefix is refused"] = (
            refused.returncode != 0 and "AUTHORIZATION" in (refused.stdout + refused.stderr))
        passed = run(["verify", "--scenario", "3", "--prefix", PREFIX], env)
        results["verify --prefix team-a. passes"] = passed.returncode == 0

        source = f"{PREFIX}pay-{uuid.uuid4().hex[:8]}"
        dlq = f"{source}.dlq"
        for f in admin.create_topics([NewTopic(t, 1, 1) for t in (source, dlq)]).values():
            f.result(timeout=30)
        time.sleep(1)
        dead_letter(super_boot, dlq, source)
        no = run(["dlq", "replay", "--dlq", dlq, "--no-progress"], env)
        results["dlq replay without --prefix is refused"] = (
            no.returncode == 3 and "AUTHORIZATION" in no.stderr and count(super_boot, source) == 0)
        yes = run(["dlq", "replay", "--dlq", dlq, "--no-progress", "--prefix", PREFIX], env)
        results["dlq replay --prefix team-a. republishes"] = (
            # the record, then the transaction's commit marker
            yes.returncode == 0 and count(super_boot, source) == 2)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(dbname)))
        if not opts.keep_broker:
            kafka_sh("stop", opts.port, local, extra)
    for what, ok in results.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    return 0 if len(results) == 4 and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
