"""The console's pages (GET: they read, never write)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from kafka_idem import replay
from kafka_idem.admin import operations as admin
from kafka_idem.admin import pauses
from kafka_idem.console import security
from kafka_idem.console.forms import (
    BadInput,
    decode_cursor,
    exact,
    int_param,
    opt,
    selection,
    selection_fields,
    status_param,
    time_param,
)
from kafka_idem.console.state import Console
from kafka_idem.deadletters.signing import MEANING, verify
from kafka_idem.errors import KafkaIdemError
from kafka_idem.observe.text import plain, to_json

PAGE = 50
# The records page's filters the bulk re-run's form takes, by the name it takes them
# under (an exact key it does not: a key's own page has its Re-run button).
RERUN_FIELDS = {"namespace": "namespace", "handler": "handler", "error_kind": "kind",
                "prefix": "key_prefix", "since": "since", "until": "until"}


def overview(console: Console, request: Request) -> Response:
    snap = console.sampler.get()
    context: dict[str, Any] = dict(
        snap=snap, progress=console.index.progress(), jobs=console.jobs.recent(5),
        refresh=console.options.refresh_seconds, paused=paused_now(console))
    if request.query_params.get("fragment"):
        return console.render(request, "_overview.html", **context)
    return console.render(request, "overview.html", title="Overview", **context)


def paused_now(console: Console) -> dict[str, pauses.Pause] | None:
    """The app's paused handlers now (``None``: the store did not answer; the page says
    so rather than show them running)."""
    try:
        with console.conn() as conn:
            return pauses.current(conn, console.store.scoped(console.app.namespace))
    except KafkaIdemError:
        return None


def records(console: Console, request: Request) -> Response:
    q = request.query_params
    key, prefix = exact(q, "key"), exact(q, "prefix")
    namespace, handler, status = opt(q, "namespace"), opt(q, "handler"), status_param(q)
    kind = opt(q, "error_kind")
    if kind is not None and kind not in ("exhausted", "permanent"):
        raise BadInput("error_kind must be exhausted or permanent")
    since, until = time_param(q, "since"), time_param(q, "until")
    statuses = [status] if status else list(admin.STATUSES)
    rows: list[dict[str, Any]]
    next_cursor: Any = None
    with console.conn() as conn:
        spaces = [namespace] if namespace is not None else console.store.namespaces(conn)
        if key is not None:
            rows = [r for r in console.store.find(conn, key, spaces)
                    if r["status"] in statuses and handler in (None, r["handler"])
                    and kind in (None, r["error_kind"])]
        elif prefix is not None:
            rows = console.store.browse_prefix(
                conn, prefix=prefix, namespaces=spaces, statuses=statuses, handler=handler,
                since=since, until=until, after=_pair(_cursor(q, 2)), limit=PAGE + 1,
                ranged=console.ranged, error_kind=kind)
            if len(rows) > PAGE:
                rows = rows[:PAGE]
                next_cursor = [rows[-1]["namespace"], rows[-1]["idempotency_key"]]
        else:
            after = _cursor(q, 3)
            cursor = None
            if after is not None:
                try:
                    cursor = (dt.datetime.fromisoformat(after[0]), after[1], after[2])
                except ValueError:
                    raise BadInput("the page link is damaged (cursor)") from None
            rows = console.store.browse(
                conn, statuses=statuses, namespace=namespace, handler=handler, since=since,
                until=until, after=cursor, limit=PAGE + 1, error_kind=kind)
            if len(rows) > PAGE:
                rows = rows[:PAGE]
                last = rows[-1]
                next_cursor = [last["updated_at"], last["namespace"], last["idempotency_key"]]
    filters = {k: v for k, v in q.items() if k != "after" and v}
    rerun_query = urlencode([(RERUN_FIELDS[k], v) for k, v in filters.items()
                             if k in RERUN_FIELDS])
    return console.render(request, "records.html", title="Records", rows=rows,
                          filters=filters, next_cursor=next_cursor,
                          bulk_ok=status == "failed", rerun_query=rerun_query)


def _pair(cursor: tuple[str, ...] | None) -> tuple[str, str] | None:
    return None if cursor is None else (cursor[0], cursor[1])


def _cursor(q: Any, size: int) -> tuple[str, ...] | None:
    """The ``after`` cursor of a records link: ``size`` texts, or a bad link."""
    after = decode_cursor(q.get("after"))
    if after is None:
        return None
    if not (isinstance(after, list) and len(after) == size
            and all(isinstance(x, str) and "\x00" not in x for x in after)):
        raise BadInput("the page link is damaged (cursor)")
    return tuple(after)


def record(console: Console, request: Request) -> Response:
    q = request.query_params
    key = exact(q, "key")
    if key is None:
        raise BadInput("key: which record? (/record?ns=NAMESPACE&key=KEY)")
    ns = q.get("ns")
    with console.conn() as conn:
        try:
            found = admin.inspect(conn, console.store, key, ns)
        except admin.Refused:  # a namespace with no records
            found = []
        stranded = {}
        for rec in found:
            if rec["status"] == "retryable_failed":
                stranded[rec["namespace"]] = admin.stranded_by(
                    conn, console.store.scoped(rec["namespace"]), key)
    if not found:
        return console.render(request, "error.html", 404, title="No such record",
                              message=f"no record with key {key!r}"
                              + (f" in namespace {ns!r}" if ns is not None else ""))
    letters = {rec["namespace"]: console.index.of_key(key, rec["namespace"])
               for rec in found}
    return console.render(request, "record.html", title=f"Record {plain(key)}", key=key,
                          records=found, fields=admin.RECORD_FIELDS, letters=letters,
                          stranded=stranded,
                          as_json={r["namespace"]: to_json(admin.record_json(key, r))
                                   for r in found})


def dlq(console: Console, request: Request) -> Response:
    q = request.query_params
    if not opt(q, "topic"):
        return console.render(request, "dlq_topics.html", title="Dead letters",
                              progress=console.index.progress())
    topic = console.dlq_topic(q)
    sel = selection(q)
    before = decode_cursor(q.get("before"))
    if before is not None and not (isinstance(before, list) and len(before) == 3 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in before)):
        raise BadInput("the page link is damaged (cursor)")
    page_ = console.index.page(topic, sel, before=(before[0], before[1], before[2])
                               if before else None, limit=PAGE)
    keys = console.settings.signing_keys
    filters = {k: v for k, v in q.items() if k not in ("before", "topic") and v}
    return console.render(request, "dlq.html", title=f"Dead letters: {plain(topic)}",
                          topic=topic, page=page_, filters=filters,
                          progress=console.index.progress(), signing=bool(keys),
                          next_cursor=list(page_.next_before) if page_.next_before else None)


def letter(console: Console, request: Request) -> Response:
    q = request.query_params
    topic = console.dlq_topic(q)
    partition, offset = int_param(q, "partition"), int_param(q, "offset")
    if partition is None or offset is None:
        raise BadInput("partition and offset: which record?")
    if partition not in console.index.partitions(topic):
        return console.render(request, "error.html", 404, title="No such record",
                              message=f"{topic} has no partition {partition}")
    with console.reader.lock:
        rec = console.reader.read(topic, partition, offset)
    if rec is None:
        return console.render(request, "error.html", 404, title="No such record",
                              message=f"no record at {topic}[{partition}]@{offset}")
    shown = replay.payload_view(rec, console.app)
    signature = verify(console.settings.signing_keys, rec.headers, rec.key, rec.value)
    trust = None
    states: list[dict[str, Any]] = []
    with console.conn() as conn:
        try:
            boundary = replay.Boundary.of(console.settings, topic, app=console.app)
            trust = boundary.verdict(rec, boundary.states(conn, console.store, [rec]).get(
                rec.idempotency_key or ""))
        except KafkaIdemError as exc:
            trust = str(exc)
        if rec.idempotency_key is not None:
            states = admin.inspect(conn, console.store, rec.idempotency_key,
                                   None) if rec.namespace is None else [
                r for r in admin.inspect(conn, console.store, rec.idempotency_key, None)
                if r["namespace"] == rec.namespace]
    return console.render(
        request, "letter.html", title=f"Dead letter {plain(topic)}[{partition}]@{offset}",
        rec=rec, topic=topic, payload=shown,
        payload_json=(json.dumps(shown["value"], indent=2, sort_keys=True, default=str,
                                 ensure_ascii=False)
                      if "value" in shown else None),
        headers=[(name, replay.display_bytes(value)) for name, value in rec.headers],
        kafka_key=replay.display_bytes(rec.key), signature=signature,
        signature_meaning=MEANING[signature], trust=trust,
        trust_meaning=replay.REASONS.get(trust or ""), states=states,
        size=None if rec.value is None else len(rec.value))


def redrive_form(console: Console, request: Request) -> Response:
    q = request.query_params
    topic = console.dlq_topic(q)
    sel = selection(q)
    return console.render(request, "redrive.html", title="Re-drive dead letters",
                          topic=topic, fields=selection_fields(sel))


def rerun_form(console: Console, request: Request) -> Response:
    q = request.query_params
    fields = {k: v for k, v in q.items() if v and k in (
        "kind", "handler", "since", "until", "key_prefix", "limit", "namespace")}
    return console.render(request, "rerun.html", title="Re-run failed records",
                          fields=fields)


def jobs(console: Console, request: Request) -> Response:
    return console.render(request, "jobs.html", title="Jobs", jobs=console.jobs.recent(100))


def job_page(console: Console, request: Request) -> Response:
    job = console.jobs.get(request.path_params["job_id"])
    if job is None:
        return console.render(request, "error.html", 404, title="No such job",
                              message="no such job (jobs live until the console restarts)")
    audit_rows: list[dict[str, Any]] = []
    if job.state != "running" and job.kind in ("redrive", "rerun", "rerun-keys"):
        with console.conn() as conn:
            audit_rows = console.store.audit_of(conn, job.audit_after, runs=job.runs,
                                                via=job.via)
    name = "_job.html" if request.query_params.get("fragment") else "job.html"
    return console.render(request, name, title=job.title, job=job, audit=audit_rows)


def login_page(console: Console, request: Request) -> Response:
    if console.guard.token is None:
        return RedirectResponse("/", status_code=303)
    return console.render(request, "login.html", title="Log in", error=None,
                          next=security.safe_next(request.query_params.get("next")))


def healthz(console: Console, request: Request) -> Response:
    if request.query_params.get("ready") and not console.index.ready:
        return PlainTextResponse("indexing the dead-letter topics", status_code=503)
    return PlainTextResponse("ok")

