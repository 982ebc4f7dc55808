"""What signing dead letters costs: ``python -m bench.deadletters``.

In one run, a real member (the payments example, ``consumers.payments.build_app``,
local mode, its bulk handler, no events: the main bench's batch row) dead-letters a
backlog of ``--messages`` charge requests that *all* fail permanently (amount 0:
``Permanent("amount must be positive, got 0")``), once without signing keys and once
with ``dlq_signing_keys`` set (``KAFKA_IDEM_DLQ_SIGNING_KEYS``, a fresh random key),
alternating the two ``--pairs`` times (A B, B A, A B: a drift over the run does not
count against the one that always runs second) so that the machine's noise shows.
Every run gets a fresh 4-partition topic and DLQ topic, a fresh consumer group and a
fresh store schema (in a database of the bench's own), and its member a process of its
own (``python -m bench.deadletters --worker``: a ``Runner`` driven as the main bench's
``bench/worker.py`` drives it, logging as ``kafka-idem run`` does, to a file).

Per run: dead letters/s from the member's first fetched batch to the commit that
brings the group's committed offsets to the topic's end (the main bench's clock); CPU
microseconds per dead letter of the member process, of PostgreSQL (our database's
backends and the server's own processes) and of the broker, over the same window
(``bench/procstat.py``), and the CPU of everything else on the machine in cores (other
users' tests make noise); and where the member's loop spends its wall time per dead
letter: in its batches (``Processor.run_local``: decode, claims, one failure record per
message, the commit in PostgreSQL) and in ``DeadLetterer.send`` (signing, the produce and
the wait until the DLQ acknowledged every record); the rest is consuming, offset commits,
the log lines. Per configuration: min / median / max; and the ratio
signed / unsigned (of the medians, and per pair).

Then, as context, the HMAC alone: :func:`kafka_idem.deadletters.signing.sign` (what the member's
``Signer`` runs per record) over a real dead letter of the first run (its headers,
key and value), and over the same headers with a 10 KiB value; and ``verify``.

Checked after every run, exit status 1 otherwise: the DLQ holds exactly one dead letter
per message (by source partition and offset, and by idempotency key), of kind
``permanent``; the store holds one ``failed`` record per key; in the signed runs every
dead letter's ``idem.signature`` verifies with the key, and in the unsigned runs none
has one. Nothing asserts on timing.

    python -m bench.deadletters                 # 4 pairs of 30,000 messages (~2 minutes)
    python -m bench.deadletters --quick         # 2 pairs of 3,000 (~15 s)
    python -m bench.deadletters --messages 50000 --pairs 6 --results /tmp/dl.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql
from rich.console import Console
from rich.table import Table

from bench import procstat
from bench.workload import CURRENCIES, Intent, create_topic, end_offsets, produce_backlog
from consumers import payments
from kafka_idem.admin.migrate import migrate
from kafka_idem.deadletters import signing
from kafka_idem.settings import Settings, load_settings
from tools.kafka_state import KafkaRecord, read_topic

ROOT = Path(__file__).resolve().parent.parent
TABLE = "task_idempotency"
PARTITIONS = 4
KEYS_VAR = "KAFKA_IDEM_DLQ_SIGNING_KEYS"
UNSIGNED, SIGNED = "unsigned", "signed"
console = Console(stderr=True)


# --- the member (``--worker SPEC OUT``, a process of its own) -----------------------------


def worker(spec_file: str, out_file: str) -> int:
    """Drain ``spec["topic"]`` with the payments app: every message is dead-lettered."""
    from bench.worker import Recorder, TimedConsumer, _reached
    from kafka_idem.consume.paths.processor import Processor
    from kafka_idem.consume.runner import Runner
    from kafka_idem.deadletters.dead_letter import DeadLetterer
    from kafka_idem.observe import logs

    spec = json.loads(Path(spec_file).read_text())
    s = load_settings()
    logs.configure(s.log_format, s.log_level)  # as `kafka-idem run`: a line per dead letter
    out: dict[str, Any] = {"ok": False, "pid": os.getpid()}
    app = payments.build_app(
        topic=spec["topic"], mode="local", events=False, name="bench-deadletters",
        group_id=spec["group"], schema_name=spec["schema"], table=TABLE,
        batch_size=spec["batch_size"], bootstrap_servers=s.bootstrap_servers,
        database_url=spec["dsn"], kafka=s.kafka)
    out["signed"] = bool(app.settings.signing_keys)  # from KAFKA_IDEM_DLQ_SIGNING_KEYS
    ends = {int(p): int(o) for p, o in spec["ends"].items()}
    pids = procstat.Pids(procstat.database_of(spec["dsn"]))
    window: dict[str, procstat.Watch] = {}

    # Where the loop's wall time goes (one batch at a time, all on the loop's thread): the
    # batch in PostgreSQL (decode, claims, one failure record per message, COMMIT), and the
    # dead letters' produce until every one is acknowledged (signing included).
    rec = Recorder()
    Processor.run_local = rec.timed("batch", Processor.run_local)  # type: ignore[method-assign]
    DeadLetterer.send = rec.timed("dlq_send", DeadLetterer.send)  # type: ignore[method-assign]

    def on_first() -> None:
        window["watch"] = procstat.Watch(pids).start()
        rec.phases.clear()

    runner = Runner(app)
    started = time.perf_counter()
    runner.start()
    assert runner.consumer is not None
    timed = TimedConsumer(runner.consumer, on_first)
    runner.consumer = timed  # type: ignore[assignment]
    tps = [TopicPartition(spec["topic"], p) for p in sorted(ends)]
    done = False
    last_check = 0.0
    try:
        while not done and time.perf_counter() - started < spec["timeout"]:
            runner.step()
            now = time.perf_counter()
            # our own commits first, the broker's committed offsets as the verdict
            if _reached(timed.stored, ends) or now - last_check >= 1.0:
                last_check = now
                try:
                    stored = timed.inner.committed(tps, timeout=10)
                except KafkaException:
                    continue
                done = _reached({tp.partition: tp.offset for tp in stored}, ends)
        watch = window.get("watch")
        out["cpu"] = watch.stop() if watch is not None else None
        out["cpu_threads"] = watch.threads if watch is not None else {}
    finally:
        end = timed.last_commit
        runner.close()
    out["phases"] = {k: {"wall_s": v[0], "cpu_s": v[1], "calls": v[2]}
                     for k, v in rec.phases.items()}
    out["dead_lettered"] = _counted(runner, "dead_lettered")
    out["dlq_failures"] = sum(sample.value for m in runner.metrics.dlq_failures.collect()
                              for sample in m.samples if sample.name.endswith("_total"))
    if not done or timed.first_batch is None:
        out["check"] = f"timed out after {spec['timeout']:.0f}s; committed {timed.stored}"
    else:
        out.update(ok=True, seconds=end - timed.first_batch,
                   join_seconds=timed.first_batch - started)
    Path(out_file).write_text(json.dumps(out, default=str))
    return 0


def _counted(runner: Any, outcome: str) -> float:
    return float(sum(sample.value for metric in runner.metrics.messages.collect()
                     for sample in metric.samples
                     if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome))


# --- the orchestrator ---------------------------------------------------------------------


def intents(tag: str, n: int) -> list[Intent]:
    """``n`` charge requests that all fail permanently (amount 0), 50 tenants."""
    return [Intent(f"bench-{tag}-t{i % 50:02d}", f"bench-{tag}-o{i:07d}", Decimal(0),
                   CURRENCIES[i % len(CURRENCIES)]) for i in range(n)]


def run_member(spec: dict[str, Any], work: Path, key: str | None) -> dict[str, Any]:
    """One member process over the spec's topic; its result (``ok`` False if it failed)."""
    name = f"run{spec['run']}-{spec['config']}"
    spec_file, out_file = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != KEYS_VAR}
    env.pop("PAYMENTS_EVENTS", None)
    if key is not None:
        env[KEYS_VAR] = key
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    load_before = os.getloadavg()[0]
    with (work / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.deadletters", "--worker", str(spec_file),
             str(out_file)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=spec["timeout"] + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        out: dict[str, Any] = json.loads(out_file.read_text())
    except (OSError, ValueError) as exc:
        out = {"ok": False, "check": f"member failed (exit {proc.returncode}): {exc}; "
                                     f"log {work / f'{name}.log'}"}
    out["loadavg_before"] = load_before
    return out


def check(s: Settings, spec: dict[str, Any], ends: dict[int, int], keys: tuple[bytes, ...],
          signed: bool) -> tuple[bool, str, list[KafkaRecord]]:
    """One dead letter per message on the DLQ, verified when signed; one failed record
    per key in the store."""
    n = sum(ends.values())
    records, _ = read_topic(s.bootstrap_servers, spec["dlq"], kafka=s.kafka, timeout=120)
    heads = [r.header_map() for r in records]
    where = Counter((h.get("idem.original.partition"), h.get("idem.original.offset"))
                    for h in heads)
    expected = {(str(p), str(o)) for p, end in ends.items() for o in range(end)}
    by_key = Counter(h.get("idem.key") for h in heads)
    kinds = Counter(h.get("idem.error.kind") for h in heads)
    verdicts = Counter(signing.verify(keys, r.headers, r.key, r.value) for r in records)
    with psycopg.connect(spec["dsn"]) as conn:
        query = sql.SQL("SELECT status, count(*) FROM {} GROUP BY 1").format(
            sql.Identifier(spec["schema"], TABLE))
        statuses: dict[str, int] = dict(conn.execute(query).fetchall())
    want_verdict = "valid" if signed else "unsigned"
    problems = []
    if len(records) != n or set(where) != expected or max(where.values(), default=0) != 1:
        twice = sum(1 for c in where.values() if c > 1)
        problems.append(f"{len(records):,} dead letters for {n:,} messages "
                        f"({len(expected - set(where)):,} missing, {twice:,} twice)")
    if len(by_key) != n or max(by_key.values(), default=0) != 1:
        problems.append(f"{len(by_key):,} distinct idem.key for {n:,} messages")
    if kinds != Counter({"permanent": n}):
        problems.append(f"kinds {dict(kinds)}")
    if verdicts != Counter({want_verdict: n}):
        problems.append(f"signatures {dict(verdicts)}, expected {want_verdict} for all")
    if statuses != {"failed": n}:
        problems.append(f"store records {statuses}, expected {n:,} failed")
    if problems:
        return False, "; ".join(problems), records
    return True, (f"ok: {n:,} letters, 1 per message, {n:,} {want_verdict}; "
                  f"{n:,} failed records"), records


def disturbed(log: Path) -> str:
    """What the member's log says went wrong in the run, if it lost its partitions (a
    message read again after its dead letter was acknowledged but before its offset was
    committed gets its dead letter again: the DLQ is at least once, by design)."""
    text = log.read_text(errors="replace")
    said = [what for what, marker in (("partitions lost", "action=lost"),
                                      ("the broker was down", "_ALL_BROKERS_DOWN"),
                                      ("a commit failed", "commit failed"))
            if marker in text]
    return f" (the member's log: {', '.join(said)}; {log})" if said else f" ({log})"


def micro(record: KafkaRecord, key: bytes, calls: int) -> dict[str, float]:
    """Microseconds per call, best of 5: sign() over a real dead letter (and its canonical
    form alone), over the same with a 10 KiB value, and verify() over the real one."""
    headers = [(k, v) for k, v in record.headers if k != signing.SIGNATURE]
    big = os.urandom(10 * 1024)
    signed = [*headers, (signing.SIGNATURE, signing.sign(key, headers, record.key,
                                                          record.value).encode())]

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(time.perf_counter() - t0)
        return min(times) / calls * 1e6

    return {
        "headers": len(headers),
        "header_bytes": sum(len(k) + len(v) for k, v in headers),
        "value_bytes": len(record.value or b""),
        "sign_us": best(lambda: signing.sign(key, headers, record.key, record.value)),
        "canonical_us": best(lambda: signing.canonical(headers, record.key, record.value)),
        "sign_10k_us": best(lambda: signing.sign(key, headers, record.key, big)),
        "verify_us": best(lambda: signing.verify((key,), signed, record.key, record.value)),
    }


def _us(v: float | None, n: int) -> float | None:
    return v / n * 1e6 if v is not None and n else None


def _f(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: min / median / max rate and median CPU per dead letter; ratios."""
    out: dict[str, Any] = {}
    for config in (UNSIGNED, SIGNED):
        mine = [r for r in runs if r["config"] == config and r.get("rate")]
        rates = [r["rate"] for r in mine]
        out[config] = {
            "runs": len(mine),
            "rate_min": min(rates, default=None), "rate_max": max(rates, default=None),
            "rate_median": statistics.median(rates) if rates else None,
            **{f"{part}_us_median": statistics.median(vals) if (vals := [
                r[f"{part}_us"] for r in mine if r.get(f"{part}_us") is not None]) else None
               for part in ("consumer", "postgres", "broker", "batch", "dlq_send")},
        }
    a, b = out[UNSIGNED]["rate_median"], out[SIGNED]["rate_median"]
    out["ratio_of_medians"] = b / a if a and b else None
    pairs: list[float] = []
    for k in sorted({r["pair"] for r in runs}):
        rate: dict[str, float] = {r["config"]: r["rate"] for r in runs
                                  if r["pair"] == k and r.get("rate")}
        if UNSIGNED in rate and SIGNED in rate:
            pairs.append(rate[SIGNED] / rate[UNSIGNED])
    out["pair_ratios"] = pairs
    ca, cb = out[UNSIGNED]["consumer_us_median"], out[SIGNED]["consumer_us_median"]
    out["consumer_us_delta"] = cb - ca if ca is not None and cb is not None else None
    return out


def render(runs: list[dict[str, Any]], summary: dict[str, Any], mb: dict[str, float] | None,
           n: int) -> list[Table]:
    t = Table(title=f"Dead-lettering {n:,} messages per run (all fail permanently)")
    for col in ("run", "config", "dead letters/s", "seconds", "join s",
                "wall µs/letter: batch", "DLQ send", "CPU µs/letter: member", "PostgreSQL",
                "broker", "others' cores", "load before", "check"):
        t.add_column(col, justify="left" if col in ("config", "check") else "right")
    for r in runs:
        cpu = r.get("cpu") or {}
        # everything else on the machine over the window (other users, other tests), in cores
        others = cpu["other"] / cpu["wall"] if cpu.get("other") is not None else None
        t.add_row(f"{r['run']} (pair {r['pair']})", r["config"], _f(r.get("rate")),
                  _f(r.get("seconds"), "{:.2f}"),
                  _f(r.get("join_seconds"), "{:.2f}"), _f(r.get("batch_us"), "{:.0f}"),
                  _f(r.get("dlq_send_us"), "{:.0f}"), _f(r.get("consumer_us"), "{:.0f}"),
                  _f(r.get("postgres_us"), "{:.0f}"), _f(r.get("broker_us"), "{:.0f}"),
                  _f(others, "{:.2f}"), _f(r.get("loadavg_before"), "{:.2f}"),
                  str(r.get("check", "")))
    s = Table(title="Per configuration (medians of the runs but min/s and max/s)")
    for col in ("config", "runs", "min/s", "median/s", "max/s", "wall µs/letter: batch",
                "DLQ send", "CPU µs/letter: member", "PostgreSQL", "broker"):
        s.add_column(col, justify="left" if col == "config" else "right")
    for config in (UNSIGNED, SIGNED):
        c = summary[config]
        s.add_row(config, str(c["runs"]), _f(c["rate_min"]), _f(c["rate_median"]),
                  _f(c["rate_max"]), _f(c["batch_us_median"], "{:.0f}"),
                  _f(c["dlq_send_us_median"], "{:.0f}"), _f(c["consumer_us_median"], "{:.0f}"),
                  _f(c["postgres_us_median"], "{:.0f}"), _f(c["broker_us_median"], "{:.0f}"))
    ratio = summary["ratio_of_medians"]
    pairs = ", ".join(f"{p:.3f}" for p in summary["pair_ratios"])
    s.caption = (f"signed / unsigned: {_f(ratio, '{:.3f}')} (medians); per pair {pairs or '-'}; "
                 f"member CPU {_f(summary['consumer_us_delta'], '{:+.1f}')} µs per letter")
    tables = [t, s]
    if mb is not None:
        m = Table(title=f"The HMAC alone (best of 5; a real dead letter: {mb['headers']:.0f} "
                        f"idem.* headers, {mb['header_bytes']:.0f} B, value "
                        f"{mb['value_bytes']:.0f} B)")
        for col in ("call", "µs per record"):
            m.add_column(col, justify="left" if col == "call" else "right")
        m.add_row("sign(), the dead letter", f"{mb['sign_us']:.2f}")
        m.add_row("  of which canonical(): the bytes signed", f"{mb['canonical_us']:.2f}")
        m.add_row("sign(), same headers, 10 KiB value", f"{mb['sign_10k_us']:.2f}")
        m.add_row("verify(), the dead letter, one key", f"{mb['verify_us']:.2f}")
        tables.append(m)
    return tables


def cleanup(s: Settings, admin: AdminClient, topics: list[str], groups: list[str],
            dbname: str | None) -> list[str]:
    problems = []
    for what, futures in (("topic", admin.delete_topics(topics) if topics else {}),
                          ("group", admin.delete_consumer_groups(groups) if groups else {})):
        for name, fut in futures.items():
            try:
                fut.result(30)
            except KafkaException as exc:
                code = exc.args[0].code() if exc.args else None
                if code not in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.GROUP_ID_NOT_FOUND):
                    problems.append(f"{what} {name}: {exc}")
    if dbname is not None:
        try:
            with psycopg.connect(s.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(dbname)))
        except psycopg.Error as exc:
            problems.append(f"database {dbname}: {exc}")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.deadletters",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="2 pairs of 3,000 messages")
    p.add_argument("--messages", type=int, help="messages per run [30000; quick 3000]")
    p.add_argument("--pairs", type=int, help="unsigned/signed pairs, alternating [4; quick 2]")
    p.add_argument("--batch-size", type=int, default=500, help="the member's batch_size [500]")
    p.add_argument("--micro-calls", type=int, help="calls per round of the HMAC timing "
                   "[20000; quick 5000]")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run [600]")
    p.add_argument("--keep", action="store_true", help="keep topics, groups and the database")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.messages = args.messages or (3_000 if args.quick else 30_000)
    args.pairs = args.pairs or (2 if args.quick else 4)
    args.micro_calls = args.micro_calls or (5_000 if args.quick else 20_000)
    if args.messages < 1 or args.pairs < 1:
        p.error("need --messages >= 1 and --pairs >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    s = load_settings()
    run_id = uuid.uuid4().hex[:8]
    key = secrets.token_hex(32)  # as `openssl rand -hex 32`
    keys = (key.encode(),)
    admin = AdminClient(s.admin_config())
    work = Path(tempfile.mkdtemp(prefix=f"bench-dl-{run_id}-"))
    dbname = f"bench_dl_{run_id}"
    topics: list[str] = []
    groups: list[str] = []
    runs: list[dict[str, Any]] = []
    sample: KafkaRecord | None = None
    n = args.messages
    load_start = os.getloadavg()
    console.print(f"bench.deadletters {run_id}: {args.pairs} pair(s) of {n:,} messages, "
                  f"{os.cpu_count()} cores, load average {load_start[0]:.2f}; work files in "
                  f"{work}")
    try:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        dsn = psycopg.conninfo.make_conninfo(s.dsn, dbname=dbname)
        messages = intents(run_id, n)
        # A B, B A, A B...: a drift over the run (it happens: each run is a little slower
        # than the one before on a busy machine) does not count against the one that is
        # always second.
        order = [(k, c) for k in range(args.pairs)
                 for c in ((UNSIGNED, SIGNED) if k % 2 == 0 else (SIGNED, UNSIGNED))]
        for i, (pair, config) in enumerate(order, 1):
            topic = f"bench.{run_id}.dl{i}"
            for name in (topic, f"{topic}.dlq"):
                create_topic(admin, name, PARTITIONS)
                topics.append(name)
            t0 = time.perf_counter()
            produce_backlog(s, topic, messages)
            ends = end_offsets(s, topic, PARTITIONS)
            if sum(ends.values()) != n:
                raise SystemExit(f"bench: {topic} holds {sum(ends.values())} messages, not {n}")
            schema = f"bench_dl_{run_id}_{i}"
            migrate(dsn, schema, TABLE)
            group = f"bench-{run_id}-dl{i}"
            groups.append(group)
            spec = {"run": i, "config": config, "topic": topic, "dlq": f"{topic}.dlq",
                    "group": group, "schema": schema, "dsn": dsn, "ends": ends,
                    "batch_size": args.batch_size, "timeout": args.timeout}
            console.print(f"run {i} ({config}): produced {n:,} to {topic} in "
                          f"{time.perf_counter() - t0:.1f}s; dead-lettering ...")
            out = run_member(spec, work, key if config == SIGNED else None)
            row: dict[str, Any] = {"run": i, "pair": pair + 1, "config": config, **out}
            if out.get("ok") and out.get("signed") != (config == SIGNED):
                row["ok"], row["check"] = False, f"the member's signing was {out.get('signed')}"
            elif out.get("ok"):
                row["ok"], row["check"], records = check(s, spec, ends, keys, config == SIGNED)
                if not row["ok"]:
                    row["check"] += disturbed(work / f"run{i}-{config}.log")
                if sample is None and config == UNSIGNED and records:
                    sample = records[0]
            if row.get("ok") and row.get("seconds"):
                row["rate"] = n / row["seconds"]
                cpu = row.get("cpu") or {}
                for part in ("consumer", "postgres", "broker"):
                    row[f"{part}_us"] = _us(cpu.get(part), n)
                for phase in ("batch", "dlq_send"):
                    row[f"{phase}_us"] = _us((row.get("phases") or {}).get(
                        phase, {}).get("wall_s"), n)
            console.print(f"  {_f(row.get('rate'))} dead letters/s; member "
                          f"{_f(row.get('consumer_us'), '{:.0f}')} µs CPU per letter; "
                          f"{row.get('check')}")
            runs.append(row)
    finally:
        if args.keep:
            console.print(f"kept topics {topics}, groups {groups}, database {dbname}")
        else:
            for problem in cleanup(s, admin, topics, groups, dbname):
                console.print(f"[yellow]clean-up: {problem}")
    mb = micro(sample, keys[0], args.micro_calls) if sample is not None else None
    summary = summarize(runs)
    out_console = Console(width=max(Console().width, 180))
    for table in render(runs, summary, mb, n):
        out_console.print(table)
    if mb is not None and summary[UNSIGNED]["rate_median"]:
        per_letter = 1e6 / summary[UNSIGNED]["rate_median"]
        out_console.print(
            f"sign() is {mb['sign_us']:.1f} µs of the {per_letter:,.0f} µs of wall time per "
            f"dead letter unsigned ({mb['sign_us'] / per_letter:.1%}), and of the "
            f"{_f(summary[UNSIGNED]['consumer_us_median'], '{:.0f}')} µs of member CPU")
    load_end = os.getloadavg()
    out_console.print(f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at "
                      f"the end; {os.cpu_count()} cores")
    if args.results is not None:
        args.results.write_text(json.dumps({
            "run_id": run_id, "messages": n, "pairs": args.pairs,
            "batch_size": args.batch_size, "cores": os.cpu_count(),
            "loadavg_start": load_start, "loadavg_end": load_end, "runs": runs,
            "summary": summary, "micro": mb}, indent=2, default=str))
        console.print(f"results written to {args.results}")
    ok = len(runs) == 2 * args.pairs and all(r.get("ok") for r in runs)
    if ok:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"[red]a check failed: see the table; member logs in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
