"""The scenario matrix of :meth:`Harness.check`: what the framework survives, run
against the user's handler, each scenario from a clean database.

Every scenario runs the message through the framework's own path (the batch path and
the per-message path of local mode, or the leased path), and afterwards compares
the app's tables, the events in the outbox (and the remote fakes' effects) with the
*reference*: the same message delivered once on the reference path (per-message in
local mode). The faults are the kit's only addition, each at the point where it matters:

* a crash (the process dies) right after the handler returned, inside its open
  transaction: in local mode nothing of the unit commits; in leased mode the claim
  had committed, so the redelivery finds the dead owner's lease live (busy) until it
  expires (the kit's clock), then takes it over (``attempts + 1``, reconcile first);
* "committed, then crashed before the offset commit": the database commit done, the
  process gone, the same record (same offset) delivered again to a new process;
* concurrency: N processes (threads, one connection each) take the same record at
  once; the first to claim it holds it until the others wait on it;
* a failure injected after the handler ran: ``Retryable`` every time (the retry
  budget runs out) or ``UnknownOutcome`` once (leased: the answer was lost);
* a lease that expires while the handler runs, and a second owner that takes over.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kafka_idem.consume.outcome import TP, Deferred, Ended, Finished, Reason, Result
from kafka_idem.consume.paths.batch_path import Fallback, HandlerRaised, run_batch
from kafka_idem.errors import Retryable, UnknownOutcome
from kafka_idem.testing.case import (
    Case,
    Effects,
    settings_for,
    show,
    sig,
    step,
    told,
)
from kafka_idem.testing.events import EmittedEvent, compare_events
from kafka_idem.testing.hooks import Call, Crash, Plan
from kafka_idem.testing.report import ScenarioResult
from kafka_idem.testing.sandbox import Path, Sandbox
from kafka_idem.testing.tables import State, compare, steady_result

SCENARIOS: dict[str, str] = {
    "once": "delivered once",
    "twice": "delivered twice (a producer's retry: the same bytes at the next offset)",
    "crash_before_commit": "the process died after the handler ran, before the database "
                           "commit; redelivered",
    "crash_before_offset_commit": "committed, then the process died before the offset "
                                  "commit; the same record redelivered",
    "concurrent": "the same record taken by several processes at once",
    "conflict": "the same key with a different payload",
    "retries_exhausted": "every attempt fails after the handler ran, until the retry "
                         "budget is used up",
    "unknown_outcome": "the answer was lost after the handler ran (UnknownOutcome); retried",
    "lease_takeover": "the lease expired while the handler ran; another owner took over",
    "batch": "a batch on the batch path against the same batch on the per-message path",
}
"""The scenarios :meth:`Harness.check` runs, by name, with what each one does."""
LEASED_ONLY = ("unknown_outcome", "lease_takeover")
WAIT = 30.0  # seconds a scenario waits for a thread of its own before it gives up


def once(case: Case, path: Path, out: ScenarioResult) -> None:
    with case.harness.scratch(**settings_for(path)) as sb:
        d = sb.drive(sb.processor(), case.msg, path)
        out.said(f"delivered: {told(d)}")
        case.expect(out, "the delivery", sig(d), case.first)
        case.same_state(out, sb, what=f"the reference ({case.paths[0]} path)")
        case.same_events(out, sb, what=f"the reference ({case.paths[0]} path)")
        case.same_effects(out)


def twice(case: Case, path: Path, out: ScenarioResult) -> None:
    with case.harness.scratch(**settings_for(path)) as sb:
        proc = sb.processor()
        d1 = sb.drive(proc, case.msg, path)
        d2 = sb.drive(proc, case.msg.moved(offset=case.msg.offset() + 1), path)
        out.said(f"first: {told(d1)}; again: {told(d2)}")
        case.expect(out, "the first delivery", sig(d1), case.first)
        case.expect(out, "the second delivery", sig(d2), case.again)
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def _crash(case: Case, sb: Sandbox, path: Path, out: ScenarioResult) -> bool:
    """Run the message until the handler returns, then let the process die there. A
    handler whose first attempts fail (``Retryable``: a remote side busy) is retried,
    as the runner would, until an attempt returns; False if none did."""
    died = threading.Event()

    def crash(_call: Call) -> None:
        died.set()
        raise Crash

    proc = sb.processor()
    with case.harness.hooks.using(Plan(after=crash, times=1)), contextlib.suppress(Crash):
        sb.run_until(proc, case.msg, path, died.is_set,
                     lambda r: out.said(f"a try before the crash: {step(r)}"))
    proc.close()  # the dead process's connection goes with it
    return died.is_set()


def crash_before_commit(case: Case, path: Path, out: ScenarioResult) -> None:
    with case.harness.scratch(**settings_for(path)) as sb:
        if not _crash(case, sb, path, out):
            out.wrong("the handler never returned, so the crash did not happen")
            return
        out.said("the handler ran; the process died before its transaction committed")
        proc = sb.processor()
        d = sb.drive(proc, case.msg, path)
        if path == "leased" and d.outcome == "deferred":
            out.said(f"redelivered: {told(d)} (the dead owner's lease is still live)")
            expired = sb.expire_leases()
            out.said(f"time passed beyond the lease of {', '.join(expired) or 'no key'}")
            d = sb.drive(proc, case.msg, path)
        out.said(f"redelivered: {told(d)}")
        case.expect(out, "the redelivery", sig(d), case.first)
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def crash_before_offset_commit(case: Case, path: Path, out: ScenarioResult) -> None:
    with case.harness.scratch(**settings_for(path)) as sb:
        first = sb.processor()
        d1 = sb.drive(first, case.msg, path)
        first.close()
        out.said(f"delivered: {told(d1)}; the process died before committing the offset")
        d2 = sb.drive(sb.processor(), case.msg, path)
        out.said(f"the same record redelivered to a new process: {told(d2)}")
        case.expect(out, "the first delivery", sig(d1), case.first)
        case.expect(out, "the redelivery", sig(d2), case.again)
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def concurrent(case: Case, path: Path, out: ScenarioResult) -> None:
    n = case.harness.concurrency
    with case.harness.scratch(**settings_for(path)) as sb:
        procs = [sb.processor() for _ in range(n)]
        # each process's server pids (its sync connection, its async one), connected
        # before the race
        backends = [p.backends() for p in procs]
        done = [threading.Event() for _ in procs]
        barrier = threading.Barrier(n, timeout=WAIT)
        firsts: dict[int, Result | BaseException] = {}
        raced = threading.Event()

        def hold(call: Call) -> None:
            """The one that claimed it holds the key until every other one waits on it
            (a lock in local mode) or has finished its try (busy, leased)."""
            mine = call.tx.info.backend_pid
            others = [i for i, pids in enumerate(backends) if mine not in pids]
            theirs = sorted(pid for i in others for pid in backends[i])
            deadline = time.monotonic() + WAIT / 3
            with sb.connect() as conn:
                while time.monotonic() < deadline:
                    rows = conn.execute(
                        "SELECT pid, unnest(pg_blocking_pids(pid)) FROM unnest(%s::int[]) AS pid",
                        (theirs,)).fetchall()
                    blocked = _waiting_on(mine, rows)
                    if all(backends[i] & blocked or done[i].is_set() for i in others):
                        raced.set()
                        return
                    threading.Event().wait(0.002)

        def race(proc: Any, i: int) -> None:
            try:
                barrier.wait()
                firsts[i] = sb.run(proc, case.msg, path)
            except BaseException as exc:
                firsts[i] = exc
            finally:
                done[i].set()

        with case.harness.hooks.using(Plan(after=hold, times=1)):
            threads = [threading.Thread(target=race, args=(p, i), daemon=True)
                       for i, p in enumerate(procs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT * 2)
        errors = [r for r in firsts.values() if isinstance(r, BaseException)]
        if errors or len(firsts) < n:
            out.wrong(f"a process failed: {errors[0]!r}" if errors
                      else "a process did not finish")
            return
        first_tries = Counter(step(r) for r in firsts.values() if not isinstance(r, BaseException))
        out.said(f"{n} processes at once: " + ", ".join(f"{k} x{v}" for k, v in
                                                        sorted(first_tries.items()))
                 + ("" if raced.is_set() or not case.succeeded else
                    " (the others did not arrive while the first held the key)"))
        finals = []
        for i, proc in enumerate(procs):
            res = firsts[i]
            assert not isinstance(res, BaseException)
            if isinstance(res, Finished):
                finals.append(sig(sb.delivered(proc, case.msg, [res], sb.letters.send(
                    {(case.msg.topic(), case.msg.partition()): [res]}))))
            else:
                finals.append(sig(sb.drive(proc, case.msg, path)))
        out.said("finally: " + ", ".join(f"{show(s)} x{c}" for s, c in sorted(
            Counter(finals).items())))
        want = Counter([case.first] + [case.again] * (n - 1))
        if Counter(finals) != want:
            out.wrong("the outcomes were " + ", ".join(
                f"{show(s)} x{c}" for s, c in sorted(Counter(finals).items()))
                + "; expected " + ", ".join(f"{show(s)} x{c}" for s, c in sorted(want.items())))
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def _waiting_on(holder: int, edges: list[tuple[int, int]]) -> set[int]:
    """The backends waiting on ``holder``, directly or behind another waiter: on a row
    that exists, the second waiter queues on the first one's tuple lock, and
    ``pg_blocking_pids`` names that waiter, not the holder. ``edges``: (pid, blocker)."""
    waiting: set[int] = set()
    grew = True
    while grew:
        grew = False
        for pid, blocker in edges:
            if pid not in waiting and (blocker == holder or blocker in waiting):
                waiting.add(pid)
                grew = True
    return waiting


def conflict(case: Case, path: Path, out: ScenarioResult) -> None:
    if case.conflict is None:
        out.skipped = ("no payload with the same key and another request hash could be "
                       "made from this one: pass conflict=")
        return
    with case.harness.scratch(**settings_for(path)) as sb:
        proc = sb.processor()
        d1 = sb.drive(proc, case.msg, path)
        d2 = sb.drive(proc, case.conflict, path)
        out.said(f"first: {told(d1)}; the same key with another payload: {told(d2)}")
        case.expect(out, "the first delivery", sig(d1), case.first)
        case.expect(out, "the other payload", sig(d2), ("conflict", "payload_conflict"))
        if d1.record != d2.record:
            changed = sorted(k for k in (d1.record or {}) if k != "db_now"
                             and (d1.record or {}).get(k) != (d2.record or {}).get(k))
            if changed:
                out.wrong(f"the conflict changed the key's record: {', '.join(changed)}")
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def retries_exhausted(case: Case, path: Path, out: ScenarioResult) -> None:
    def fail(call: Call) -> None:
        raise Retryable(f"the test kit fails attempt {call.attempt or '(bulk)'} after the "
                        "handler ran")

    policy = case.harness.base.retry_policy(case.handler)
    failing = Plan(after=fail, times=None)
    with case.harness.scratch(**settings_for(path)) as sb, case.harness.hooks.using(failing):
        d = sb.drive(sb.processor(), case.msg, path)
        out.said(f"the handler ran {case.harness.hooks.count()} time(s), each attempt "
                 f"failed: {told(d)}")
        case.expect(out, "the last attempt", sig(d), ("dead_lettered", "exhausted"))
        if d.attempts != policy.max_attempts:
            out.wrong(f"{d.attempts} attempts were counted, the retry budget is "
                      f"{policy.max_attempts}")
        case.same_state(out, sb, case.harness.clean, what="the clean database (no effect)")
        case.same_events(out, sb, [], what="the clean database (no event)")
        case.same_effects(out, at_most=True)


def unknown_outcome(case: Case, path: Path, out: ScenarioResult) -> None:
    def lose(_call: Call) -> None:
        raise UnknownOutcome("the test kit lost the answer after the handler ran")

    with case.harness.scratch(**settings_for(path)) as sb:
        with case.harness.hooks.using(Plan(after=lose, times=1)):
            d = sb.drive(sb.processor(), case.msg, path)
        reconciled = case.harness.hooks.count("reconcile")
        out.said(f"the answer was lost, retried: {told(d)}"
                 + (f"; reconcile ran {reconciled} time(s)" if reconciled else ""))
        case.expect(out, "the retry", sig(d), case.first)
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def lease_takeover(case: Case, path: Path, out: ScenarioResult) -> None:
    with case.harness.scratch(**settings_for(path)) as sb:
        owner, other = sb.processor(), sb.processor()
        other_pids = other.backends()
        arrived = threading.Event()  # the other owner took the key over (it runs user code)
        results: list[Result | BaseException] = []
        threads: list[threading.Thread] = []

        def take_over(call: Call) -> None:
            expired = sb.expire_leases(call.keys[0])
            out.said(f"the first owner's handler ran; then its lease expired "
                     f"({', '.join(expired) or 'no live lease'})")

            def second() -> None:
                try:
                    results.append(sb.run(other, case.msg, path))
                except BaseException as exc:
                    results.append(exc)
                finally:
                    arrived.set()

            threads.append(threading.Thread(target=second, daemon=True))
            threads[0].start()
            if not arrived.wait(WAIT):
                out.wrong("the second owner did not take the key over in time")

        def entered(call: Call) -> None:
            if call.tx.info.backend_pid in other_pids:
                arrived.set()

        with case.harness.hooks.using(Plan(after=take_over, times=1, entered=entered)):
            first = sb.run_until(  # a handler whose first attempts fail is retried first
                owner, case.msg, path, lambda: bool(threads),
                lambda r: out.said(f"a try before the lease expired: {step(r)}"))
            for t in threads:
                t.join(WAIT)
        if not results or isinstance(results[0], BaseException):
            out.wrong(f"the second owner failed: {results[0]!r}" if results
                      else "the second owner did not finish")
            return
        calls = Counter(c.kind for c in case.harness.hooks.calls)
        out.said(f"the first owner's completion: {step(first)}; the second owner "
                 f"({', '.join(f'{k} x{v}' for k, v in sorted(calls.items()))} in all): "
                 f"{step(results[0])}")
        if isinstance(first, Finished):
            out.wrong(f"the first owner finished ({step(first)}) although its lease had "
                      "been taken over")
        second = results[0]
        if not isinstance(second, Finished):
            d = sb.drive(other, case.msg, path)
            out.said(f"the second owner again: {told(d)}")
        again = sb.drive(owner, case.msg, path)
        out.said(f"the first owner's message again: {told(again)}")
        case.expect(out, "the first owner's redelivery", sig(again), case.again)
        case.same_state(out, sb)
        case.same_events(out, sb)
        case.same_effects(out)


def batch(case: Case, path: Path, out: ScenarioResult) -> None:
    msgs = case.batch
    tp: TP = (case.msg.topic(), case.msg.partition())
    h = case.harness
    outcomes: dict[str, list[str]] = {}
    states: dict[str, State] = {}
    records: dict[str, dict[str, Any]] = {}
    effects: dict[str, Effects] = {}
    events: dict[str, list[EmittedEvent]] = {}
    outcomes_of: dict[str, list[Result]] = {}
    for side in ("per-message", "batch"):
        for remote in h.remotes.values():
            remote.reset()
        h.hooks.forget()
        with h.scratch(**settings_for(side)) as sb:
            proc = sb.processor()
            try:
                results = (run_batch(proc, [(tp, msgs)]) if side == "batch"
                           else proc.run_local_safe([(tp, msgs)]))[tp]
            except HandlerRaised as exc:
                if _failed_there_too(case, exc, msgs, outcomes_of["per-message"]):
                    out.skipped = (
                        f"the handler raised on its first attempt ({exc.__cause__!r}), "
                        "as it did on the per-message path: the batch path leaves such a "
                        "batch to the per-message path, which is the one a retry runs on")
                    return
                out.wrong(f"the batch path left this batch to the per-message path ({exc}) "
                          "though on the per-message path that message's handler call "
                          "returned, or failed with a code defect")
                return
            except Fallback as exc:
                out.wrong(f"the batch path left this batch to the per-message path ({exc}): "
                          "on it the batch path and the bulk handler are never used")
                return
            outcomes_of[side] = results
            letters = iter(sb.letters.send({tp: results}))
            outcomes[side] = [show((step(r), next(letters).kind if isinstance(r, Finished)
                                    and r.letter is not None else None)) for r in results]
            states[side] = sb.state(case.tables)
            events[side] = sb.events()
            keys = sorted({r.key for r in results if isinstance(r, Finished) and r.key})
            records[side] = {k: _summary(sb.record(k), case.result_drift) for k in keys}
            effects[side] = case.effects()
            if side == "batch":
                bulk = h.hooks.count("bulk")
                out.said(f"{len(msgs)} messages in one batch: {', '.join(outcomes[side])}"
                         + (f" (the bulk handler ran {bulk} time(s))" if bulk else ""))
    if outcomes["batch"] != outcomes["per-message"]:
        out.wrong(f"outcomes differ: per-message path {outcomes['per-message']}, "
                  f"batch path {outcomes['batch']}")
    for diff in compare(states["per-message"], states["batch"]):
        out.wrong("\n".join(diff.lines(expected="the per-message path")))
    for problem in compare_events(events["per-message"], events["batch"], case.compared,
                                  what="the per-message path"):
        out.wrong(problem)
    for key in sorted(set(records["batch"]) | set(records["per-message"])):
        a, b = records["per-message"].get(key), records["batch"].get(key)
        if a != b:
            out.wrong(f"record {key!r}: per-message path {a}, batch path {b}")
    case.same_effects(out, expected=effects["per-message"], what="the per-message path")


def _failed_there_too(case: Case, exc: HandlerRaised, msgs: list[Any],
                     per_message: list[Result]) -> bool:
    """The message the batch path's handler failed on failed on the per-message path
    too (a retry due, or dead-lettered permanent), and not as a code defect: the
    batch path has nothing to be compared on there."""
    at = [i for i, m in enumerate(msgs)
          if (m.topic(), m.partition()) == exc.tp and m.offset() == exc.offset]
    if not at or exc.__cause__ is None or case.handler.code_defect(exc.__cause__):
        return False
    r = per_message[at[0]]
    return ((isinstance(r, Deferred) and r.reason == Reason.RETRY)
            or (isinstance(r, Finished) and r.outcome == Ended.DEAD_LETTERED
                and r.letter is not None and r.letter.kind == "permanent"))


def _summary(rec: dict[str, Any] | None, drift: frozenset[str]) -> dict[str, Any] | None:
    if rec is None:
        return None
    out = {k: rec[k] for k in ("status", "error_kind", "error_class", "attempts")}
    return {**out, "result_json": steady_result(rec["result_json"], drift)}


RUN: dict[str, Callable[[Case, Path, ScenarioResult], None]] = {
    "once": once, "twice": twice, "crash_before_commit": crash_before_commit,
    "crash_before_offset_commit": crash_before_offset_commit, "concurrent": concurrent,
    "conflict": conflict, "retries_exhausted": retries_exhausted,
    "unknown_outcome": unknown_outcome, "lease_takeover": lease_takeover, "batch": batch,
}
