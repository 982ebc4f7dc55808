"""The console's write flows end to end against the real broker and database: keys fail
(permanently, or exhausted after their retries), the cause is fixed, the operator
re-drives or re-runs them through the console (dry run, its counts, the confirmation
with a reason), and the app's consumer then runs them: the records succeed once each,
the audit trail names the operator and the reason.

One world per module; each test works on keys of its own (its own handler or kind),
so the filters of one never select another's.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from tests.acceptance.conftest import headers_of, read_all
from tests.integration.console_support import (
    OPERATOR,
    World,
    audit_rows,
    console,
    finished,
    get,
    job_of,
    order,
    order_key,
    pick,
    post,
    state,
    status_of,
    world,
)

A = [f"a{i}" for i in range(6)]  # order, permanent until fixed: re-driven by filter
C = [f"c{i}" for i in range(4)]  # order, exhausted: bulk re-run by filter
B = [f"b{i}" for i in range(4)]  # refund, permanent: re-driven by hand-picked positions
D = [f"d{i}" for i in range(3)]  # refund, permanent: re-run by key
E = [f"e{i}" for i in range(2)]  # refund, exhausted: bulk re-run by filter (with C)


def refund_key(o: str) -> str:
    return f"t2:refund:{o}"


@pytest.fixture(scope="module")
def w(admin: AdminClient, template_db: str) -> Iterator[World]:
    with world(admin, template_db) as w:
        w.produce(
            orders=[(o.encode(), order("t1", o, "check", note=o)) for o in A]
            + [(o.encode(), order("t1", o, "wait")) for o in C]
            + [(b"ok1", order("t1", "ok1"))],
            refunds=[(o.encode(), order("t2", o, "check", note=o)) for o in B + D]
            + [(o.encode(), order("t2", o, "wait")) for o in E])
        w.run(dead_letters=len(A + C + B + D + E))
        yield w


@pytest.fixture(scope="module")
def client(w: World) -> Iterator[Any]:
    with console(w.app) as c:
        yield c


def succeeded_once(w: World, keys: list[str]) -> None:
    """The app's consumer ran the re-sent messages: each key succeeded, one ledger row."""
    def done() -> bool:
        return all(status_of(w.db, k) == "succeeded" for k in keys)

    w.run(until=done)
    counts = {r["idempotency_key"]: r["n"] for r in w.db.rows(
        "SELECT idempotency_key, count(*) AS n FROM payments.ledger GROUP BY 1")}
    assert {k: counts.get(k) for k in keys} == dict.fromkeys(keys, 1)


def reruns_of(w: World, keys: list[str]) -> list[dict[str, Any]]:
    return [r for r in audit_rows(w.db, "rerun") if r["idempotency_key"] in keys]


def test_redrive_by_filter_after_the_dry_run_with_a_reason(w: World, client: Any) -> None:
    keys = [order_key(o) for o in A]
    w.fix(*A)
    form = get(client, f"/redrive?topic={quote(w.dlq)}&kind=permanent&handler=order")
    assert form.inputs("topic") == [w.dlq]
    before = state(w.db)
    dry = job_of(post(client, "/redrive/dry-run", {
        "topic": w.dlq, "kind": "permanent", "handler": "order", "include_permanent": "on"}))
    page = finished(client, dry)
    assert page.text("job-state") == "done"
    assert page.text("job-sent") == str(len(A))
    assert "would send" in page.text("job-summary")
    assert page.text("confirm").strip() == f"Re-drive {len(A)} record(s)"
    assert "; also keys that failed permanently)</h1>" in page.html  # its title says so
    group = page.text("confirm-group")  # the confirmation's own
    assert group.startswith("kafka-idem-replay.") and not page.has("job-groups")
    assert state(w.db) == before  # a dry run writes nothing

    run = job_of(post(client, "/redrive/run", {"dry_run": dry, "reason": "INC-1: fixed"}))
    page = finished(client, run)
    assert (page.text("job-state"), page.text("job-sent")) == ("done", str(len(A)))
    assert page.text("job-groups") == f"replay group(s): {group}"
    assert {status_of(w.db, k) for k in keys} == {"retryable_failed"}
    rows = reruns_of(w, keys)
    assert sorted(r["idempotency_key"] for r in rows) == sorted(keys)
    assert {(r["actor"], r["reason"], r["previous_status"]) for r in rows} == {
        (OPERATOR, "INC-1: fixed", "failed")}
    [replay_row] = audit_rows(w.db, "replay")  # the replay's own row, with the reason typed
    assert (replay_row["actor"], replay_row["reason"]) == (OPERATOR, "INC-1: fixed")
    assert replay_row["counts"]["sent"] == len(A)
    assert replay_row["selection"]["kind"] == "permanent"
    assert replay_row["selection"]["group"] == group  # the group the dry run named
    # the same dry run confirmed again: the same replay, past its records, sends nothing
    twice = finished(client, job_of(post(client, "/redrive/run", {
        "dry_run": dry, "reason": "INC-1: again"})))
    assert (twice.text("job-sent"), twice.text("job-groups")) == ("0", f"replay group(s): {group}")
    # the job's page shows the audit rows it wrote
    audit_table = page.text("job-audit")
    assert audit_table.count(OPERATOR) == len(A) + 1 and "INC-1: fixed" in audit_table
    # each record was sent back to its source topic once
    back = [m for m in read_all(w.orders) if "idem.replay.at" in headers_of(m)]
    assert sorted(m.key() for m in back) == sorted(o.encode() for o in A)

    succeeded_once(w, keys)
    assert {status_of(w.db, order_key(o)) for o in C} == {"failed"}  # not selected
    assert {status_of(w.db, refund_key(o)) for o in B + D} == {"failed"}
    # The same filter's dry run again (another replay group: the filter's) reads those
    # records again; what keeps it from sending them twice is their keys' state.
    again = finished(client, job_of(post(client, "/redrive/dry-run", {
        "topic": w.dlq, "kind": "permanent", "handler": "order", "include_permanent": "on"})))
    assert again.text("job-sent") == "0" and not again.has("confirm-form")
    assert "".join(again.text("by-kind").split()) == f"kindskippedsucceededpermanent{len(A)}"


def test_redrive_of_hand_picked_records(w: World, client: Any) -> None:
    positions = {m.key(): (m.partition(), m.offset()) for m in read_all(w.dlq)}
    chosen = [B[0], B[2]]
    page = get(client, f"/dlq?topic={quote(w.dlq)}&handler=refund")
    assert {f"{p}:{o}" for p, o in (positions[x.encode()] for x in chosen)} <= set(
        page.inputs("pick"))
    w.fix(*B)
    dry = job_of(post(client, "/redrive/dry-run", [
        ("topic", w.dlq), ("include_permanent", "on"),
        *(("pick", "{}:{}".format(*positions[o.encode()])) for o in chosen)]))
    page = finished(client, dry)
    assert page.text("job-sent") == "2"
    run = job_of(post(client, "/redrive/run", {"dry_run": dry, "reason": "picked"}))
    page = finished(client, run)
    assert page.text("job-sent") == "2"
    keys = [refund_key(o) for o in chosen]
    assert sorted(r["idempotency_key"] for r in reruns_of(w, keys)) == sorted(keys)
    assert {r["actor"] for r in reruns_of(w, keys)} == {OPERATOR}
    succeeded_once(w, keys)
    assert {status_of(w.db, refund_key(o)) for o in (B[1], B[3])} == {"failed"}


def test_bulk_rerun_by_filter(w: World, client: Any) -> None:
    """Exhausted keys of both handlers: the refund handler's dead letters are on the
    orders' DLQ (its dlq_topic), where the console finds them through the app."""
    keys = [order_key(o) for o in C] + [refund_key(o) for o in E]
    w.fix(*C, *E)
    link = get(client, "/records?status=failed&handler=order").href("bulk-rerun")
    assert link is not None and link.startswith("/rerun?handler=order")
    assert "<option selected>order</option>" in get(client, link).html
    before = state(w.db)
    dry = job_of(post(client, "/rerun/dry-run", {"kind": "exhausted", "handler": "order"}))
    page = finished(client, dry)
    assert page.text("job-sent") == str(len(C))
    assert f"selected {len(C)} failed key(s)" in page.text("job-summary")
    dry = job_of(post(client, "/rerun/dry-run", {"kind": "exhausted"}))
    page = finished(client, dry)
    assert f"selected {len(keys)} failed key(s)" in page.text("job-summary")
    assert page.text("job-sent") == str(len(keys)), page.html  # each one's dead letter found
    assert state(w.db) == before
    run = job_of(post(client, "/rerun/run", {"dry_run": dry, "reason": "INC-3"}))
    page = finished(client, run)
    assert (page.text("job-state"), page.text("job-sent")) == ("done", str(len(keys)))
    rows = reruns_of(w, keys)
    assert sorted(r["idempotency_key"] for r in rows) == sorted(keys)
    assert {(r["actor"], r["reason"]) for r in rows} == {(OPERATOR, "INC-3")}
    assert {status_of(w.db, k) for k in keys} == {"retryable_failed"}
    succeeded_once(w, keys)


def test_rerun_of_chosen_keys_refuses_the_ones_that_are_not_failed(
        w: World, client: Any) -> None:
    w.fix(*D)
    one = refund_key(D[0])
    # without a reason: the confirmation, with each key's state now
    r = post(client, "/rerun/keys", {"pick": pick("consoled", one)})
    assert r.status_code == 200
    assert "failed" in r.text and "Re-run 1 key(s)" in r.text
    page = finished(client, job_of(post(client, "/rerun/keys", {
        "pick": pick("consoled", one), "reason": "one"})))
    assert page.text("job-summary").split() == ["re-ran", "1,", "refused", "0"]
    assert [(r["actor"], r["reason"]) for r in reruns_of(w, [one])] == [(OPERATOR, "one")]

    several = [refund_key(D[1]), order_key("ok1"), refund_key(D[2])]
    before_ok = w.db.record(order_key("ok1"))
    page = finished(client, job_of(post(client, "/rerun/keys", [
        *(("pick", pick("consoled", k)) for k in several), ("reason", "several")])))
    assert page.text("job-summary").split() == ["re-ran", "2,", "refused", "1"]
    results = page.text("results")
    assert results.count("re-run: republished") == 2 and results.count("refused:") == 1
    assert status_of(w.db, order_key("ok1")) == "succeeded"
    assert w.db.rows("SELECT * FROM kafka_idem.task_idempotency WHERE idempotency_key = %s",
                     (order_key("ok1"),)) == [before_ok]
    assert reruns_of(w, [order_key("ok1")]) == []
    assert {status_of(w.db, k) for k in (several[0], several[2])} == {"retryable_failed"}
    assert sorted(r["idempotency_key"] for r in reruns_of(w, several)) == sorted(
        [several[0], several[2]])
    succeeded_once(w, [refund_key(o) for o in D])


def test_the_confirmation_needs_a_reason_and_a_dry_run_that_exists(
        w: World, client: Any) -> None:
    before = state(w.db)
    redrive = job_of(post(client, "/redrive/dry-run", {
        "topic": w.dlq, "kind": "permanent", "handler": "refund", "include_permanent": "on"}))
    rerun = job_of(post(client, "/rerun/dry-run", {"kind": "permanent", "handler": "refund"}))
    finished(client, redrive)
    finished(client, rerun)
    jobs = jobs_now(client)
    refused = [
        ("/redrive/run", {"dry_run": redrive}),
        ("/redrive/run", {"dry_run": redrive, "reason": "   "}),
        ("/redrive/run", {"dry_run": "999-deadbeef", "reason": "why"}),
        ("/redrive/run", {"reason": "why"}),
        ("/redrive/run", {"dry_run": rerun, "reason": "why"}),  # another kind of dry run
        ("/rerun/run", {"dry_run": rerun}),
        ("/rerun/run", {"dry_run": rerun, "reason": ""}),
        ("/rerun/run", {"dry_run": "999-deadbeef", "reason": "why"}),
        ("/rerun/run", {"dry_run": redrive, "reason": "why"}),
        ("/rerun/keys", {"reason": "why"}),  # nothing picked
        ("/rerun/keys", {"pick": "not-a-pick", "reason": "why"}),
        ("/redrive/dry-run", {"topic": "not-its-dlq"}),
        ("/redrive/dry-run", {"topic": w.dlq, "pick": "1-2"}),
        ("/rerun/dry-run", {}),  # no filter: not every failed record at once
        ("/rerun/dry-run", {"limit": "5"}),
    ]
    for path, form in refused:
        r = post(client, path, form)
        assert r.status_code == 400, (path, form, r.status_code)
    assert jobs_now(client) == jobs  # none started by the refused ones
    assert state(w.db) == before  # nor by the dry runs
    assert client.get("/jobs/no-such-job").status_code == 404


def jobs_now(client: Any) -> int:
    return get(client, "/jobs").html.count('href="/jobs/')


def test_letters_of_one_key_picked_together_rerun_the_key_once(w: World, client: Any) -> None:
    before = len(read_all(w.dlq))
    w.produce(refunds=[(b"f0", order("t2", "f0", "check")), (b"f0", order("t2", "f0", "check"))])
    w.run(dead_letters=before + 2)
    letters = [m for m in read_all(w.dlq) if m.key() == b"f0"]
    assert len(letters) == 2  # failed, then dead-lettered again
    w.fix("f0")
    dry = job_of(post(client, "/redrive/dry-run", [
        ("topic", w.dlq), ("include_permanent", "on"), ("by", "picks"),
        *(("pick", f"{m.partition()}:{m.offset()}") for m in letters)]))
    assert finished(client, dry).text("job-sent") == "1"  # one replay: the key's latest
    run = job_of(post(client, "/redrive/run", {"dry_run": dry, "reason": "twice"}))
    assert finished(client, run).text("job-sent") == "1"
    assert len(reruns_of(w, [refund_key("f0")])) == 1
    succeeded_once(w, [refund_key("f0")])


def test_a_confirmation_acts_on_what_its_dry_run_showed_only(w: World, client: Any) -> None:
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    before = len(read_all(w.dlq))
    w.produce(refunds=[(b"g0", order("t2", "g0", "check"))])
    w.run(dead_letters=before + 1)
    w.fix("g0", "g1")
    dry = job_of(post(client, "/redrive/dry-run", {
        "topic": w.dlq, "handler": "refund", "kind": "permanent", "include_permanent": "on",
        "since": since.isoformat()}))
    assert finished(client, dry).text("job-sent") == "1"
    # another key fails after the dry run, inside the same filter: not in this run
    with psycopg.connect(w.db.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM consoled.fixed WHERE order_id = 'g1'")
    w.produce(refunds=[(b"g1", order("t2", "g1", "check"))])
    w.run(dead_letters=before + 2)
    run = job_of(post(client, "/redrive/run", {"dry_run": dry, "reason": "only g0"}))
    assert finished(client, run).text("job-sent") == "1"
    assert [r["idempotency_key"] for r in reruns_of(w, [refund_key("g0"), refund_key("g1")])] \
        == [refund_key("g0")]
    assert status_of(w.db, refund_key("g1")) == "failed"
    succeeded_once(w, [refund_key("g0")])


def test_an_empty_pick_is_refused_not_widened_to_every_record(w: World, client: Any) -> None:
    jobs = jobs_now(client)
    r = post(client, "/redrive/dry-run", {"topic": w.dlq, "by": "picks"})
    assert r.status_code == 400 and "tick at least one record" in r.text
    assert jobs_now(client) == jobs
