"""One measurement, in a process of its own: ``python -m bench.worker SPEC.json OUT.json``.

A fresh process per measurement keeps the figures apart: its CPU time is the
consumer's alone (no other path's threads), its peak RSS is this path's, and
nothing patched for one path leaks into the next. ``bench/__main__.py`` writes
the spec, starts the worker and reads its result.

Phases:

* ``throughput``: drain a pre-produced topic. The clock (and the CPU
  snapshot) starts at the first fetched batch, after the group join, and stops
  at the commit that brings the group's committed offsets to the topic's end.
  Then the effects are checked (exactly once).
* ``latency``: join the group on an empty topic, start the paced producer
  (``bench.workload paced``, its own process) and record, for every message,
  the moment its effect was committed minus its Kafka CreateTime.
  "Committed" means: the PostgreSQL commit of the batch (batch path), of the
  message's handler transaction (leased, naive), or the synchronous offset
  commit (raw, which has no other effect).
* ``rss``: like ``throughput`` on a long topic, sampling the process's RSS
  every ``rss_every`` messages.

With ``events`` in the spec (the ``batch_emit`` path) the payments app emits its
``ChargeCompleted`` per charge and the Runner runs its relay, as ``kafka-idem run``
does: ``throughput`` then also waits for the outbox to drain and checks the event
topic (one event per intent), and ``latency`` also records commit-to-readable per
event (:class:`bench.outbox.EventClock`). Worker kind ``relay``:
:func:`bench.outbox.relay_throughput`.
"""

from __future__ import annotations

import cProfile
import functools
import io
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from bench import cli, dbwork, outbox, procstat, roundtrips
from bench import gateway as bench_gateway
from bench.effects import TABLE, check_effects, ledger_state
from bench.naive import NaiveConsumer
from bench.workload import Plan, tenants_of
from consumers import gateway as gateway_example
from consumers import payments
from kafka_idem.consume.outcome import Finished
from kafka_idem.consume.paths.async_leased_path import AsyncLeasedPath
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.consume.runner import Runner
from kafka_idem.settings import Settings, load_settings


class Recorder:
    """Counts messages whose effect is committed; optionally their latency; RSS samples."""

    def __init__(self) -> None:
        self.count = 0
        self.latencies: list[tuple[float, float]] | None = None  # (CreateTime, latency) ms
        self.commit_at: dict[bytes, float] | None = None  # Kafka key -> effect committed (s)
        self.profiling = False
        # name -> [wall seconds, thread CPU seconds, calls], summed over the threads
        self.phases: dict[str, list[float]] = {}
        self.rss_every = 0
        self.rss: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.lock = threading.Lock()  # effects and phases come from several worker threads

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its wall and thread CPU time added to ``phases[name]``."""
        phases = self.phases

        def run(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - w, time.thread_time() - c
                with self.lock:
                    p = phases.setdefault(name, [0.0, 0.0, 0])
                    p[0] += wall
                    p[1] += cpu
                    p[2] += 1

        return run

    def effect(self, msgs: list[Any]) -> None:
        if not msgs:
            return
        with self.lock:
            self._effect(msgs)

    def _effect(self, msgs: list[Any]) -> None:
        if self.latencies is not None:
            now_ms = time.time() * 1000.0
            for m in msgs:
                kind, ts = m.timestamp()
                if kind:
                    self.latencies.append((ts, now_ms - ts))
                if self.commit_at is not None:
                    self.commit_at[m.key() or b""] = now_ms / 1000.0
        before = self.count
        self.count += len(msgs)
        if self.rss_every and self.count // self.rss_every > before // self.rss_every:
            rss, hwm = procstat.rss_mb()
            self.rss.append({"messages": self.count, "rss_mb": rss, "peak_mb": hwm,
                             "seconds": time.perf_counter() - self.started})


class TimedConsumer:
    """Stands in for a consumer: notes the first fetched batch (and calls ``on_first``)
    and the offsets each commit stored (``stored``: not ``committed``, the consumer
    method the framework calls), then delegates everything."""

    def __init__(self, inner: Consumer, on_first: Callable[[], None]) -> None:
        self.inner = inner
        self.on_first: Callable[[], None] | None = on_first
        self.first_batch: float | None = None
        self.stored: dict[int, int] = {}
        self.last_commit = 0.0

    def _first(self) -> None:
        if self.first_batch is None:
            self.first_batch = time.perf_counter()
            if self.on_first is not None:
                self.on_first()

    def consume(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.inner.consume(*args, **kwargs)
        if batch:
            self._first()
        return batch

    def poll(self, *args: Any, **kwargs: Any) -> Any:
        msg = self.inner.poll(*args, **kwargs)
        if msg is not None:
            self._first()
        return msg

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner.commit(*args, **kwargs)
        for tp in kwargs.get("offsets") or []:
            self.stored[tp.partition] = max(self.stored.get(tp.partition, -1), tp.offset)
        if (msg := kwargs.get("message")) is not None:
            p = msg.partition()
            self.stored[p] = max(self.stored.get(p, -1), msg.offset() + 1)
        self.last_commit = time.perf_counter()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --- the paths, all with start / step / close and a TimedConsumer ------------------------


class RawLoop:
    """confluent-kafka alone: ``consume(500)`` and a synchronous commit of the batch."""

    def __init__(self, s: Settings, spec: dict[str, Any], rec: Recorder, wait: float) -> None:
        self.s, self.spec, self.rec, self.wait = s, spec, rec, wait
        self.timed: TimedConsumer | None = None
        self.outcomes: dict[str, float] = {}

    def start(self, on_first: Callable[[], None]) -> None:
        consumer = Consumer(self.s.consumer_config(self.spec["group"]))
        consumer.subscribe([self.spec["topic"]])
        self.timed = TimedConsumer(consumer, on_first)

    def step(self) -> None:
        assert self.timed is not None
        # As the framework's loop takes a batch (kafka_idem/consume/runner.py): what is
        # there now, else wait for one message and take what came with it. A blocking
        # consume(500, timeout) returns after 500 messages *or* the timeout, so at a
        # rate under 500 per timeout every message would wait for the batch to fill:
        # the raw row's latency was 50-100 ms of its own wait until 2026-12-06.
        size = self.spec["batch_size"]
        batch = self.timed.consume(num_messages=size, timeout=0.0)
        if not batch:
            batch = self.timed.consume(num_messages=1, timeout=self.wait)
            if batch:
                batch += self.timed.consume(num_messages=size - 1, timeout=0.0)
        good = [m for m in batch if m.error() is None]
        nxt: dict[int, int] = {}
        for m in good:
            nxt[m.partition()] = m.offset() + 1
        if nxt:
            self.timed.commit(
                offsets=[TopicPartition(self.spec["topic"], p, o) for p, o in nxt.items()],
                asynchronous=False,
            )
            self.rec.effect(good)

    def close(self) -> None:
        if self.timed is not None:
            self.timed.inner.close()


class NaiveLoop:
    def __init__(self, s: Settings, spec: dict[str, Any], rec: Recorder) -> None:
        self.naive = NaiveConsumer(
            s, topic=spec["topic"], group=spec["group"], schema=spec["schema"], table=TABLE,
            on_effect=lambda m: rec.effect([m]),
        )
        self.timed: TimedConsumer | None = None

    @property
    def outcomes(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.naive.outcomes.items()},
                **{f"seconds_{k}": v for k, v in self.naive.seconds.items()}}

    def start(self, on_first: Callable[[], None]) -> None:
        self.naive.start()
        self.timed = TimedConsumer(self.naive.consumer, on_first)
        self.naive.consumer = self.timed

    def step(self) -> None:
        self.naive.step()

    def close(self) -> None:
        self.naive.close()


class FrameworkLoop:
    """kafka_idem's Runner with the payments app; effects recorded as the Processor
    returns (its transaction has committed by then)."""

    def __init__(self, s: Settings, spec: dict[str, Any], rec: Recorder) -> None:
        self.rec = rec
        mode = spec["mode"]
        common = dict(
            topic=spec["topic"], name=f"bench-{spec['path']}",
            group_id=spec["group"], schema_name=spec["schema"], table=TABLE,
            batch_size=spec["batch_size"], bootstrap_servers=s.bootstrap_servers,
            **({"local_workers": spec["local_workers"]} if spec.get("local_workers") else {}),
            database_url=s.dsn, kafka={**s.kafka, **spec.get("kafka", {})},
        )
        if spec["kind"] == "gateway":
            build_gateway = gateway_example.build_app
            if spec.get("orm"):  # the same charge recorded through ctx.session
                from bench import orm_gateway

                build_gateway = orm_gateway.build_app
            app = build_gateway(gateway_url=spec["gateway_url"], timeout=10.0,
                                **bench_gateway.app_settings(spec["path"]), **common)
        else:
            # events: the app as shipped (a ChargeCompleted per charge, the Runner's relay
            # publishing them); else without them, as every row before the outbox measured
            build = payments.build_app
            if spec.get("orm"):  # the same charge through ctx.session (bench/orm.py)
                from bench import orm

                build = functools.partial(orm.build_app, core=bool(spec.get("orm_core")))
            app = build(mode=mode, events=bool(spec.get("events")),
                        name_prefix=f"{spec['group']}.", **common)
            if spec.get("events"):
                outbox.make_topics(app, s, partitions=4)
        if not spec.get("bulk", True):
            app.handlers[spec["topic"]].bulk = None
        self.app = app
        self.runner = Runner(app)
        self.timed: TimedConsumer | None = None
        self.profiles: list[cProfile.Profile] = []
        self.loop_profile: cProfile.Profile | None = None  # an async def handler's loop
        # Processing runs on worker threads (leased partitions, local batches), which
        # pyinstrument does not see: with --profile, each worker thread gets a cProfile
        # of its Processor calls. Effects are recorded as the Processor returns (its
        # transaction has committed by then).
        local = threading.local()
        profiles = self.profiles if spec.get("profile") else None

        def profiled(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                prof = None
                if profiles is not None and rec.profiling:
                    prof = getattr(local, "prof", None)
                    if prof is None:
                        prof = local.prof = cProfile.Profile(time.thread_time)
                        profiles.append(prof)
                    prof.enable()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if prof is not None:
                        prof.disable()
            return run

        if mode == "leased":
            original = profiled(Processor.run_leased)

            def run_leased(proc: Processor, msg: Any, **kw: Any) -> Any:
                res = original(proc, msg, **kw)
                if isinstance(res, Finished):
                    rec.effect([msg])
                return res

            Processor.run_leased = run_leased  # type: ignore[method-assign,assignment]
            original_async = AsyncLeasedPath.run
            loop_prof: list[cProfile.Profile] = []  # the event loop thread's, once

            async def run_async(path: AsyncLeasedPath, msg: Any, *args: Any) -> Any:
                pumped = self.runner.units.keyed._loop is not None and \
                    self.runner.units.keyed._loop.pumped  # the loop thread's: pyinstrument's
                if profiles is not None and rec.profiling and not loop_prof and not pumped:
                    # every coroutine shares the loop's thread: profile all of it
                    loop_prof.append(cProfile.Profile(time.thread_time))
                    profiles.append(loop_prof[0])
                    loop_prof[0].enable()
                    self.loop_profile = loop_prof[0]
                res = await original_async(path, msg, *args)
                if isinstance(res, Finished):
                    rec.effect([msg])
                return res

            AsyncLeasedPath.run = run_async  # type: ignore[method-assign,assignment]
        else:
            # Where a batch's time goes: wall and thread CPU per step of the batch path
            # (wall - CPU = waiting, mostly for PostgreSQL); the rest of run_batch is
            # the COMMIT and bookkeeping. The phases keep the names the reports read.
            from kafka_idem.consume.paths import batch_path
            from kafka_idem.consume.paths.batch_path import BatchPath

            for phase, method in (("run_batch", "run"), ("_read", "_read"),
                                  ("_run_handlers", "_run_handlers")):
                setattr(BatchPath, method, rec.timed(f"batch.{phase}",
                                                     getattr(BatchPath, method)))
            # decoding is a function of the module (the Citus worker groups share it)
            batch_path.prepare_items = rec.timed(
                "batch._prepare", batch_path.prepare_items)
            self.runner._commit_pending = rec.timed(  # type: ignore[method-assign]
                "runner._commit_pending", self.runner._commit_pending)
            self.runner._apply = rec.timed(  # type: ignore[method-assign]
                "runner._apply", self.runner._apply)
            self.runner._ingest = rec.timed(  # type: ignore[method-assign]
                "runner._ingest", self.runner._ingest)
            original_local = profiled(Processor.run_local)

            def run_local(proc: Processor, parts: Any, ahead: Any = None) -> Any:
                out = original_local(proc, parts, ahead)
                done = []
                for tp, msgs in parts:
                    for msg, res in zip(msgs, out.get(tp, []), strict=False):
                        if isinstance(res, Finished):
                            done.append(msg)
                rec.effect(done)
                return out

            Processor.run_local = rec.timed(  # type: ignore[method-assign]
                "processor.run_local", run_local)

    def stop_profile(self) -> None:
        """Stop the event loop thread's profile, on that thread (when one runs)."""
        aio = self.runner.units.keyed._loop
        prof = self.loop_profile
        if aio is None or prof is None:
            return
        done = threading.Event()

        def stop() -> None:
            prof.disable()
            done.set()

        aio.loop.call_soon_threadsafe(stop)
        done.wait(5.0)

    @property
    def outcomes(self) -> dict[str, float]:
        return {
            outcome: sum(
                sample.value
                for metric in self.runner.metrics.messages.collect()
                for sample in metric.samples
                if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome
            )
            for outcome in ("succeeded", "replayed", "busy", "conflict", "retried",
                            "dead_lettered")
        }

    def start(self, on_first: Callable[[], None]) -> None:
        self.runner.start()
        assert self.runner.consumer is not None
        self.timed = TimedConsumer(self.runner.consumer, on_first)
        self.timed.consume = self.rec.timed("consumer.consume",  # type: ignore[method-assign]
                                            self.timed.consume)
        self.runner.consumer = self.timed  # type: ignore[assignment]
        self._step = self.rec.timed("runner.step", self.runner.step)

    def step(self) -> None:
        self._step()

    def close(self) -> None:
        self.runner.close()


Loop = RawLoop | NaiveLoop | FrameworkLoop


def make_loop(s: Settings, spec: dict[str, Any], rec: Recorder) -> Loop:
    if spec["kind"] == "raw":
        return RawLoop(s, spec, rec, wait=1.0 if spec["phase"] != "latency" else 0.1)
    if spec["kind"] == "naive":
        return NaiveLoop(s, spec, rec)
    return FrameworkLoop(s, spec, rec)


# --- phases ---------------------------------------------------------------------------------


def _reached(done: dict[int, int], ends: dict[int, int]) -> bool:
    return all(done.get(p, -1) >= end for p, end in ends.items())


def drain(s: Settings, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """throughput / rss: drain the topic; clock and CPU from the first batch to the end."""
    ends = {int(p): int(o) for p, o in spec["ends"].items()}
    total = sum(ends.values())
    plan = Plan.from_json(spec["plan"])
    rec = Recorder()
    rec.rss_every = int(spec.get("rss_every") or 0)
    pids = procstat.Pids(procstat.database_of(s.dsn))
    window: dict[str, Any] = {}
    profiler: Any = None
    check = spec["kind"] != "raw"
    if spec["kind"] == "gateway":
        mark = bench_gateway.mark(s.dsn, spec["gateway_url"])
    elif "mark" in spec:  # one of several members: the mark was taken before any started
        mark = int(spec["mark"])
        before = {(t, c): Decimal(b) for t, c, b in spec["before"]}
    elif check:
        mark, before = ledger_state(s.dsn, tenants_of(plan.tag))

    # the WAL written inside the clock (bench/dbwork.py), read outside the round-trip count
    wal = dbwork.WalMarks(s.dsn) if spec.get("wal") else None

    def on_first() -> None:
        nonlocal profiler
        if wal is not None:
            wal.mark("first")
        window["a"] = procstat.Watch(pids).start()
        rec.started = time.perf_counter()
        rec.phases.clear()  # from the first batch on, like the clock
        if spec.get("profile"):
            from pyinstrument import Profiler

            rec.profiling = True
            profiler = Profiler(interval=0.0005)
            profiler.start()

    loop = make_loop(s, spec, rec)
    if "barrier" in spec:
        _barrier(spec["barrier"], spec["member"])
    tps = [TopicPartition(spec["topic"], p) for p in ends]
    counting = spec.get("round_trips", False)
    if counting:
        roundtrips.install()
    started = time.perf_counter()
    done = False
    with roundtrips.counting() if counting else _null() as counts:
        loop.start(on_first)
        timed = loop.timed
        assert timed is not None
        last_check = 0.0
        try:
            while not done:
                now = time.perf_counter()
                if now - started > spec["timeout"]:
                    break
                loop.step()
                now = time.perf_counter()
                # The broker's committed offsets are the stop condition, asked once our
                # own commits say the end was reached (and every second, in case a commit
                # went another way, e.g. in a rebalance callback).
                if _reached(timed.stored, ends) or now - last_check >= 1.0:
                    last_check = now
                    if spec["kind"] == "naive" or spec["kind"] == "raw":
                        done = _reached(timed.stored, ends)
                    else:
                        try:
                            stored = timed.inner.committed(tps, timeout=10)
                        except KafkaException:  # e.g. the coordinator moved: ask again later
                            continue
                        done = _reached({tp.partition: tp.offset for tp in stored}, ends)
            window["b"] = window["a"].stop() if "a" in window else None
            if wal is not None and "a" in window:
                wal.mark("last")
            rec.profiling = False
            if profiler is not None:
                profiler.stop()
                if isinstance(loop, FrameworkLoop):
                    loop.stop_profile()
        finally:
            end = timed.last_commit
            loop.close()
    rss, hwm = procstat.rss_mb()
    out["wal"] = wal.close() if wal is not None else None
    out["outcomes"] = loop.outcomes
    out["round_trips"] = roundtrips.summary(counts) if counts is not None else {}
    out["rss_mb"], out["peak_rss_mb"] = rss, hwm
    out["rss_samples"] = rec.rss
    out["effects_recorded"] = rec.count
    out["phases"] = {k: {"wall_s": v[0], "cpu_s": v[1], "calls": v[2]}
                     for k, v in rec.phases.items()}
    if not done or timed.first_batch is None or "a" not in window:
        out["check"] = f"timed out after {spec['timeout']:.0f}s; committed {timed.stored} " \
                       f"of {ends}"
        return
    out["seconds"] = end - timed.first_batch
    out["first_batch_at"], out["last_commit_at"] = timed.first_batch, end
    out["join_seconds"] = timed.first_batch - started
    out["cpu"] = window["b"]
    out["cpu_threads"] = window["a"].threads  # the consumer's CPU by kind of thread
    if profiler is not None:
        path = spec["profile"]
        with open(path, "w") as f:
            f.write(profiler.output_text(unicode=True, color=False, show_all=False))
            profiles = getattr(loop, "profiles", [])
            if profiles:
                f.write("\n\nworker threads (cProfile of Processor.run_leased in thread CPU "
                        "time, all threads merged; an async def handler's: its event loop "
                        "thread), by cumulative time:\n\n")
                stream = io.StringIO()
                stats = pstats.Stats(profiles[0], stream=stream)
                for extra in profiles[1:]:
                    stats.add(extra)
                stats.sort_stats("cumulative").print_stats(60)
                stats.sort_stats("tottime").print_stats(40)
                f.write(stream.getvalue())
        out["profile"] = path
    if spec.get("member", 0) > 0:  # member 0 checks the group's effects
        out["ok"], out["check"] = True, f"member {spec['member']}: {rec.count} effects"
    elif spec["kind"] == "gateway":
        out["ok"], out["check"] = bench_gateway.check(s.dsn, spec["schema"], plan, mark,
                                                      spec["gateway_url"], spec["path"])
    elif check:
        intents, _messages = plan.build()
        out["ok"], out["check"] = check_effects(s.dsn, spec["schema"], intents, mark, before)
        if spec.get("events") and isinstance(loop, FrameworkLoop):
            app = loop.app
            out["outbox_pending_at_end"] = outbox.pending(s.dsn, spec["schema"], app.namespace)
            ok, said, out["outbox_drain_seconds"] = outbox.published(
                s, app, payments.events_topic(spec["topic"]), len({i.key for i in intents}))
            out["ok"] = out["ok"] and ok
            out["check"] += (f"; {said}; {out['outbox_pending_at_end']:,} rows pending at the "
                             f"end, drained {_secs(out['outbox_drain_seconds'])} later")
    else:
        broker = {tp.partition: tp.offset for tp in _committed(s, spec["group"], tps)}
        out["ok"] = broker == ends and rec.count == total
        out["check"] = (f"{rec.count} consumed, committed = end offsets" if out["ok"]
                        else f"committed {broker} != ends {ends} ({rec.count} consumed)")


def _barrier(base: str, member: int) -> None:
    """One of several members: say it is ready, then wait for the others' go."""
    with open(f"{base}.ready{member}", "w"):
        pass
    go, deadline = f"{base}.go", time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f}s"


def _committed(s: Settings, group: str, tps: list[TopicPartition]) -> list[TopicPartition]:
    probe = Consumer(s.consumer_config(group))
    try:
        return list(probe.committed(tps, timeout=10))
    finally:
        probe.close()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def latency(s: Settings, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Join, then produce at a fixed rate in another process; latency per message."""
    rec = Recorder()
    pids = procstat.Pids(procstat.database_of(s.dsn))
    loop = make_loop(s, spec, rec)
    loop.start(lambda: None)
    timed = loop.timed
    assert timed is not None
    fd, stats_name = tempfile.mkstemp(prefix="bench-paced-", suffix=".json")
    os.close(fd)
    producer: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.perf_counter() + 60
        while not timed.inner.assignment():
            if time.perf_counter() > deadline:
                out["check"] = "no partitions assigned within 60 s"
                return
            loop.step()
        for _ in range(5):  # let the fetchers start on the (empty) partitions
            loop.step()
        rec.latencies = []
        clock = None
        if spec.get("events"):
            rec.commit_at = {}
            clock = outbox.EventClock(s, payments.events_topic(spec["topic"]))
        watch = procstat.Watch(pids).start()
        cmd = [sys.executable, "-m", "bench.workload", "paced", "--topic", spec["topic"],
               "--plan", json.dumps(spec["plan"]), "--rate", str(spec["rate"]),
               "--out", stats_name]
        if spec["kind"] == "raw":
            cmd.append("--raw")
        producer = subprocess.Popen(cmd)
        n = int(spec["plan"]["n"])
        deadline = time.perf_counter() + spec["timeout"]
        while rec.count < n:
            if time.perf_counter() > deadline:
                break
            if producer.poll() is not None and producer.returncode != 0:
                break
            loop.step()
        cpu = watch.stop()
        producer.wait(60)
        with open(stats_name) as f:
            out["producer"] = json.load(f)
        if clock is not None and rec.commit_at is not None:
            clock.wait(len(rec.commit_at), timeout=60)
            clock.close()
            out["event_latency_ms"] = _event_latency(clock, rec.commit_at,
                                                     float(spec.get("warmup_seconds", 1.0)))
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
        loop.close()
        os.unlink(stats_name)
    pairs = rec.latencies or []
    out["cpu"] = cpu
    out["latency_n"] = len(pairs)
    if len(pairs) < n:
        out["check"] = f"only {len(pairs)} of {n} messages took effect within {spec['timeout']}s"
        return
    # The first second is warm-up (connections, first fetches): left out of the figures.
    warmup_ms = float(spec.get("warmup_seconds", 1.0)) * 1000.0
    first = min(ts for ts, _ in pairs)
    lat = sorted(v for ts, v in pairs if ts >= first + warmup_ms)
    out["latency_warmup"] = {"seconds": warmup_ms / 1000, "left_out": len(pairs) - len(lat),
                             "p99_with_warmup": sorted(v for _, v in pairs)[
                                 int(0.99 * (len(pairs) - 1))]}
    if not lat:
        out["check"] = "no message after the warm-up second: raise --latency-seconds"
        return

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))]

    # Per half second of production: is latency steady, or does a backlog build up?
    buckets: dict[int, list[float]] = {}
    for ts, v in pairs:
        buckets.setdefault(int((ts - first) // 500), []).append(v)
    out["latency_series"] = [
        {"t": k / 2, "n": len(vs), "p50": sorted(vs)[len(vs) // 2], "max": max(vs)}
        for k, vs in sorted(buckets.items())
    ]
    out["latency_ms"] = {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99),
                         "max": lat[-1], "mean": sum(lat) / len(lat)}
    out["ok"] = True
    out["check"] = (f"{len(lat)} messages at {out['producer']['rate']:,.0f}/s "
                    f"(+{len(pairs) - len(lat)} in the warm-up second)")


def _event_latency(clock: outbox.EventClock, committed: dict[bytes, float],
                   warmup: float) -> dict[str, Any]:
    """Commit-to-readable of the events, the first ``warmup`` seconds of commits left out."""
    first = min(committed.values(), default=0.0)
    lat = clock.latencies_ms({k: t for k, t in committed.items() if t >= first + warmup})
    if not lat:
        return {"n": 0, "readable": len(clock.readable), "committed": len(committed)}
    return {"n": len(lat), "readable": len(clock.readable), "committed": len(committed),
            "p50": lat[len(lat) // 2], "p90": lat[int(0.9 * (len(lat) - 1))],
            "p99": lat[int(0.99 * (len(lat) - 1))], "max": lat[-1]}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    with open(args[0]) as f:
        spec = json.load(f)
    logging.basicConfig(level=logging.INFO if spec.get("verbose") else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    s = load_settings()
    out: dict[str, Any] = {"path": spec["path"], "phase": spec["phase"], "ok": False,
                           "check": "", "pid": os.getpid()}
    try:
        if spec["phase"] == "latency":
            latency(s, spec, out)
        elif spec["kind"] == "relay":
            outbox.relay_throughput(s, spec, out)
        elif spec["kind"] == "cli":
            cli.throughput(s, spec, out)
        else:
            drain(s, spec, out)
    except Exception as exc:  # reported in the table, with the traceback on stderr
        logging.exception("bench worker failed")
        out["ok"] = False
        out["check"] = f"error: {type(exc).__name__}: {exc}"[:300]
    with open(args[1], "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
