"""The console's web application: its pages and the actions behind their buttons.

Every page reads through the same functions as the CLI (:mod:`kafka_idem.admin`,
:mod:`kafka_idem.replay`, the store's queries); every action is one of the CLI's
operations, run with the operator's name in the audit trail:

========================  =======================================================
GET  /                    overview (``?fragment=1``: the part that refreshes itself)
GET  /records             records by key, prefix, namespace, handler, status, time
GET  /record              one record: every field, audit trail, dead letters
GET  /dlq                 the app's DLQ topics; ``?topic=`` its records, filtered
GET  /letter              one dead letter: headers, decoded payload, the key's state
GET  /redrive             the re-drive form (a ``dlq replay``) for a filter
POST /redrive/dry-run     the replay's dry run, as a job
POST /redrive/run         the replay itself (after its dry run), as a job
GET  /rerun               the bulk re-run form (``rerun`` with filters)
POST /rerun/dry-run       the bulk re-run's dry run, as a job
POST /rerun/run           the bulk re-run (after its dry run), as a job
POST /rerun/keys          re-run chosen keys (``rerun KEY`` for each), as a job
GET  /jobs, /jobs/{id}    the jobs, one job's progress and result
GET  /login, POST /login  the token form (when the console has a token)
GET  /healthz             200 when up (``?ready=1``: once the DLQ index caught up)
========================  =======================================================
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kafka_idem import replay
from kafka_idem.admin import operations as admin
from kafka_idem.app import App
from kafka_idem.cli.admin import AUDIT_JSON, RECORD_FIELDS
from kafka_idem.console import security
from kafka_idem.console.dlq_index import DlqIndex
from kafka_idem.console.jobs import Job, Jobs
from kafka_idem.console.overview import Sampler
from kafka_idem.deadletters.dead_letter import ERROR_KINDS
from kafka_idem.deadletters.signing import MEANING, verify
from kafka_idem.errors import KafkaIdemError
from kafka_idem.observe.redact import redact
from kafka_idem.observe.text import plain, to_json
from kafka_idem.replay.bulk import Filter, bulk_rerun
from kafka_idem.replay.reading import Reader
from kafka_idem.replay.single import rerun_key
from kafka_idem.settings import Settings
from kafka_idem.store import Store
from kafka_idem.store.connection import configure

log = logging.getLogger(__name__)

PAGE = 50
MAX_PICKS = 500


@dataclass
class Options:
    """How ``kafka-idem console`` was started."""

    addr: str = "127.0.0.1"
    port: int = 8088
    read_only: bool = False
    actor: str = "console"
    refresh_seconds: float = 5.0
    trust_unsigned: bool = False


class BadInput(KafkaIdemError):
    """A filter or form field the console cannot use (shown on the page, status 400)."""


@dataclass
class Console:
    """What the pages share: the app, its settings and store, the DLQ index, the jobs."""

    app: App
    settings: Settings
    options: Options
    guard: security.Guard
    store: Store = field(init=False)
    pool: ConnectionPool = field(init=False)
    index: DlqIndex = field(init=False)
    sampler: Sampler = field(init=False)
    reader: Reader = field(init=False)
    jobs: Jobs = field(default_factory=Jobs)
    ranged: bool = True  # key prefixes are ranges of the primary key (C collation)
    templates: Environment = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.store = Store(schema=s.schema_name, table=s.table)
        self.pool = ConnectionPool(
            s.dsn, min_size=1, max_size=4, open=False, configure=configure,
            kwargs={"autocommit": False, "application_name": "kafka_idem.console"})
        dlqs = sorted({self.app.dlq_topic(h) for h in self.app.handlers.values()})
        self.index = DlqIndex(s, dlqs)
        self.sampler = Sampler(self.app, s, self.store, self.index,
                               self.options.refresh_seconds)
        self.reader = Reader(s)
        self.templates = Environment(
            loader=PackageLoader("kafka_idem.console", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True))
        self.templates.filters["shown"] = plain
        self.templates.filters["when"] = _when
        self.templates.filters["cursor"] = _encode_cursor
        self.templates.filters["pick"] = lambda r: _encode_cursor(
            [r["namespace"], r["idempotency_key"]])
        self.templates.globals["ns_shown"] = admin.shown

    @contextmanager
    def conn(self) -> Iterator[Any]:
        with self.pool.connection() as conn:
            yield conn
            conn.rollback()

    def secrets(self) -> list[str]:
        return self.settings.secret_values()

    def start(self) -> None:
        self.pool.open(wait=True, timeout=30)
        with self.conn() as conn:
            self.ranged = self.store.collation_is_bytewise(conn)
        self.index.start()
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self.index.stop()
        with self.reader.lock:
            self.reader.close()
        self.pool.close()

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        template = self.templates.get_template(name)
        html = template.render(
            request=request, csrf=request.state.csrf, operator=request.state.operator,
            read_only=self.options.read_only, app=self.app, dlq_topics=list(self.index.topics),
            token_set=self.guard.token is not None, kinds=ERROR_KINDS,
            statuses=admin.STATUSES, handlers=sorted(h.name for h in self.app.handlers.values()),
            **context)
        return HTMLResponse(html, status_code=status)

    def actor(self, request: Request) -> str:
        return f"{request.state.operator} (console)"


# --- small helpers -----------------------------------------------------------------------
def _when(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return "" if value is None else str(value)


def _encode_cursor(value: Any) -> str:
    raw = json.dumps(value, default=lambda v: v.isoformat()).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii")


def _decode_cursor(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(base64.urlsafe_b64decode(text.encode("ascii")))
    except ValueError as exc:
        raise BadInput("the page link is damaged (cursor)") from exc


def _opt(params: Any, name: str) -> str | None:
    value = params.get(name)
    if value is None:
        return None
    value = str(value).strip()
    return value or None


def _time(params: Any, name: str) -> dt.datetime | None:
    value = _opt(params, name)
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{name}: {value!r} is not a date-time like 2026-12-01T10:00 "
                       "(UTC unless it has an offset)") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _int(params: Any, name: str) -> int | None:
    value = _opt(params, name)
    if value is None:
        return None
    if not value.isdigit():
        raise BadInput(f"{name}: {value!r} is not a number")
    return int(value)


def _status(params: Any) -> str | None:
    value = _opt(params, "status")
    if value is not None and value not in admin.STATUSES:
        raise BadInput(f"status must be one of {', '.join(admin.STATUSES)}")
    return value


SELECTION_FIELDS = ("key", "kind", "error_class", "handler", "namespace", "since", "until",
                    "partition", "from_offset", "to_offset")


def _selection(params: Any) -> replay.Selection:
    """The ``dlq list`` filters given as query or form fields."""
    kind = _opt(params, "kind")
    if kind is not None and kind not in ERROR_KINDS:
        raise BadInput(f"kind must be one of {', '.join(ERROR_KINDS)}")
    sel = dict(key=_opt(params, "key"), kind=kind, error_class=_opt(params, "error_class"),
               handler=_opt(params, "handler"), namespace=_opt(params, "namespace"),
               since=_time(params, "since"), until=_time(params, "until"),
               partition=_int(params, "partition"), from_offset=_int(params, "from_offset"),
               to_offset=_int(params, "to_offset"))
    try:
        return replay.Selection(**sel)  # type: ignore[arg-type]
    except KafkaIdemError as exc:
        raise BadInput(str(exc)) from exc


def _selection_fields(sel: replay.Selection) -> dict[str, str]:
    """A selection as the form fields that give it back."""
    out = {}
    for name, value in sel.to_json().items():
        out[name] = str(value)
    return out


def _dlq_topic(console: Console, params: Any) -> str:
    topic = _opt(params, "topic")
    if topic is None or topic not in console.index.topics:
        known = ", ".join(console.index.topics) or "none"
        raise BadInput(f"topic: {topic!r} is not a DLQ topic of app {console.app.name!r} "
                       f"(its DLQ topics: {known})")
    return topic


def _filter(params: Any) -> Filter:
    """The bulk re-run's filters (``rerun`` without KEY)."""
    kind = _opt(params, "kind")
    if kind is not None and kind not in ("exhausted", "permanent"):
        raise BadInput("kind must be exhausted or permanent")
    flt = Filter(kind=kind, handler=_opt(params, "handler"), since=_time(params, "since"),
                 until=_time(params, "until"), key_prefix=_opt(params, "key_prefix"),
                 limit=_int(params, "limit"), namespace=_opt(params, "namespace"))
    if not flt.to_json() or list(flt.to_json()) == ["limit"]:
        raise BadInput("give at least one filter (kind, handler, namespace, since, until, "
                       "key prefix) to re-run in bulk")
    return flt


def _record_json(rec: dict[str, Any]) -> dict[str, Any]:
    out = {name: rec.get(name) for name in RECORD_FIELDS}
    out["audit"] = [{name: row.get(name) for name in AUDIT_JSON} for row in rec["audit"]]
    return out


# --- pages ---------------------------------------------------------------------------------
def build(console: Console) -> Starlette:
    """The Starlette application of ``console``."""

    def page(fn: Callable[[Request], Response]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            if request.method == "POST" and getattr(request.state, "form", None) is None:
                request.state.form = await request.form()
            try:
                return await run_in_threadpool(fn, request)
            except BadInput as exc:
                return console.render(request, "error.html", 400, title="Bad input",
                                      message=str(exc))
            except admin.Refused as exc:
                return console.render(request, "error.html", 409, title="Refused",
                                      message=redact(str(exc), console.secrets()))
            except KafkaIdemError as exc:
                log.warning("console: %s", exc)
                return console.render(request, "error.html", 503, title="Not available",
                                      message=redact(f"{type(exc).__name__}: {exc}",
                                                     console.secrets()))
        return endpoint

    def form(request: Request) -> FormData:
        data: FormData = request.state.form
        return data

    def overview(request: Request) -> Response:
        snap = console.sampler.get()
        context: dict[str, Any] = dict(
            snap=snap, progress=console.index.progress(), jobs=console.jobs.recent(5),
            refresh=console.options.refresh_seconds)
        if request.query_params.get("fragment"):
            return console.render(request, "_overview.html", **context)
        return console.render(request, "overview.html", title="Overview", **context)

    def records(request: Request) -> Response:
        q = request.query_params
        key, prefix = _opt(q, "key"), _opt(q, "prefix")
        namespace, handler, status = _opt(q, "namespace"), _opt(q, "handler"), _status(q)
        since, until = _time(q, "since"), _time(q, "until")
        after = _decode_cursor(q.get("after"))
        statuses = [status] if status else list(admin.STATUSES)
        rows: list[dict[str, Any]]
        next_cursor: Any = None
        with console.conn() as conn:
            spaces = [namespace] if namespace is not None else console.store.namespaces(conn)
            if key is not None:
                rows = [r for r in console.store.find(conn, key, spaces)
                        if r["status"] in statuses and handler in (None, r["handler"])]
            elif prefix is not None:
                cursor = tuple(after) if after else None
                rows = console.store.browse_prefix(
                    conn, prefix=prefix, namespaces=spaces, statuses=statuses, handler=handler,
                    since=since, until=until, after=cursor,
                    limit=PAGE + 1, ranged=console.ranged)
                if len(rows) > PAGE:
                    rows = rows[:PAGE]
                    next_cursor = [rows[-1]["namespace"], rows[-1]["idempotency_key"]]
            else:
                cursor = None
                if after:
                    cursor = (dt.datetime.fromisoformat(after[0]), after[1], after[2])
                rows = console.store.browse(
                    conn, statuses=statuses, namespace=namespace, handler=handler, since=since,
                    until=until, after=cursor, limit=PAGE + 1)
                if len(rows) > PAGE:
                    rows = rows[:PAGE]
                    last = rows[-1]
                    next_cursor = [last["updated_at"], last["namespace"], last["idempotency_key"]]
        filters = {k: v for k, v in q.items() if k != "after" and v}
        return console.render(request, "records.html", title="Records", rows=rows,
                              filters=filters, next_cursor=next_cursor,
                              bulk_ok=status == "failed")

    def record(request: Request) -> Response:
        q = request.query_params
        key = _opt(q, "key")
        if key is None:
            raise BadInput("key: which record? (/record?ns=NAMESPACE&key=KEY)")
        ns = q.get("ns")
        with console.conn() as conn:
            found = admin.inspect(conn, console.store, key, ns)
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
                              records=found, fields=RECORD_FIELDS, letters=letters,
                              stranded=stranded,
                              as_json={r["namespace"]: to_json(_record_json(r))
                                       for r in found})

    def dlq(request: Request) -> Response:
        q = request.query_params
        if not _opt(q, "topic"):
            return console.render(request, "dlq_topics.html", title="Dead letters",
                                  progress=console.index.progress())
        topic = _dlq_topic(console, q)
        sel = _selection(q)
        before = _decode_cursor(q.get("before"))
        page_ = console.index.page(topic, sel, before=tuple(before) if before else None,
                                   limit=PAGE)
        keys = console.settings.signing_keys
        filters = {k: v for k, v in q.items() if k not in ("before", "topic") and v}
        return console.render(request, "dlq.html", title=f"Dead letters: {plain(topic)}",
                              topic=topic, page=page_, filters=filters,
                              progress=console.index.progress(), signing=bool(keys),
                              next_cursor=list(page_.next_before) if page_.next_before else None)

    def letter(request: Request) -> Response:
        q = request.query_params
        topic = _dlq_topic(console, q)
        partition, offset = _int(q, "partition"), _int(q, "offset")
        if partition is None or offset is None:
            raise BadInput("partition and offset: which record?")
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
            payload_json=(json.dumps(shown["value"], indent=2, sort_keys=True, default=str)
                          if "value" in shown else None),
            headers=[(name, replay.display_bytes(value)) for name, value in rec.headers],
            kafka_key=replay.display_bytes(rec.key), signature=signature,
            signature_meaning=MEANING[signature], trust=trust,
            trust_meaning=replay.REASONS.get(trust or ""), states=states,
            size=None if rec.value is None else len(rec.value))

    def redrive_form(request: Request) -> Response:
        q = request.query_params
        topic = _dlq_topic(console, q)
        sel = _selection(q)
        return console.render(request, "redrive.html", title="Re-drive dead letters",
                              topic=topic, fields=_selection_fields(sel))

    def picks_of(data: FormData) -> list[tuple[int, int]]:
        out = []
        for value in data.getlist("pick"):
            part, _, off = str(value).partition(":")
            if not (part.isdigit() and off.isdigit()):
                raise BadInput("a picked record is not PARTITION:OFFSET")
            out.append((int(part), int(off)))
        if len(out) > MAX_PICKS:
            raise BadInput(f"at most {MAX_PICKS} records at once")
        return out

    def selections(sel: replay.Selection, picks: list[tuple[int, int]],
                   ) -> list[replay.Selection]:
        if not picks:
            return [sel]
        return [replay.Selection(partition=p, from_offset=o, to_offset=o)
                for p, o in sorted(set(picks))]

    def run_replays(job: Job, *, dry_run: bool, reason: str | None) -> dict[str, Any]:
        p = job.params
        topic = p["topic"]
        sels = selections(_selection(p["filters"]), [tuple(x) for x in p["picks"]])
        summaries: list[replay.ReplaySummary] = []
        would: list[dict[str, Any]] = []

        def on_action(rec: replay.DlqRecord, target: str, action: str) -> None:
            if len(would) < 200:
                would.append({"partition": rec.partition, "offset": rec.offset,
                              "key": rec.idempotency_key, "kind": rec.kind, "target": target,
                              "action": action})

        for i, sel in enumerate(sels):
            def progress(done: int, total: int, sent: int, i: int = i) -> None:
                if len(sels) == 1:
                    job.report(done, total, sent)
                else:
                    job.report(i, len(sels), sum(s.sent + s.would_send for s in summaries))
            summary = replay.replay(
                console.settings, console.store, topic, sel, dry_run=dry_run,
                actor=job.actor, reason=reason, include_permanent=p["include_permanent"],
                app=console.app, trust_unsigned=console.options.trust_unsigned,
                on_action=on_action if dry_run else None, on_progress=progress)
            summaries.append(summary)
        if len(sels) > 1:
            job.report(len(sels), len(sels), sum(s.sent + s.would_send for s in summaries))
        return {"summaries": [s.to_json() for s in summaries], "totals": _totals(summaries),
                "would_send": would}

    def redrive_dry_run(request: Request) -> Response:
        data = form(request)
        topic = _dlq_topic(console, data)
        sel = _selection(data)
        picks = picks_of(data)
        fields = _selection_fields(sel)
        params = {"topic": topic, "filters": fields, "picks": picks,
                  "include_permanent": data.get("include_permanent") == "on"}
        what = (f"{len(picks)} chosen record(s)" if picks else
                ", ".join(f"{k}={v}" for k, v in fields.items()) or "every record")
        job = console.jobs.start(
            "redrive-dry-run", f"Dry run: re-drive {topic} ({what})", params,
            console.actor(request), lambda job: run_replays(job, dry_run=True, reason=None))
        return RedirectResponse(f"/jobs/{job.id}", status_code=303)

    def redrive_run(request: Request) -> Response:
        data = form(request)
        dry = console.jobs.get(str(data.get("dry_run") or ""))
        if dry is None or dry.kind != "redrive-dry-run" or dry.state != "done":
            raise BadInput("run the dry run first (its job is gone or did not finish)")
        reason = str(data.get("reason") or "").strip()
        if not reason:
            raise BadInput("reason: say why (it is kept in the audit trail)")
        with console.conn() as conn:
            last = console.store.audit_last_id(conn)
        job = console.jobs.start(
            "redrive", dry.title.replace("Dry run: r", "R", 1), dict(dry.params),
            console.actor(request),
            lambda job: run_replays(job, dry_run=False, reason=reason), audit_after=last)
        return RedirectResponse(f"/jobs/{job.id}", status_code=303)

    def rerun_form(request: Request) -> Response:
        q = request.query_params
        fields = {k: v for k, v in q.items() if v and k in (
            "kind", "handler", "since", "until", "key_prefix", "limit", "namespace")}
        return console.render(request, "rerun.html", title="Re-run failed records",
                              fields=fields)

    def run_bulk(job: Job, *, dry_run: bool, reason: str | None) -> dict[str, Any]:
        flt = _filter(job.params["filters"])
        with console.conn() as conn:
            summary = bulk_rerun(console.settings, conn, console.store, flt, dlq_topic=None,
                                 actor=job.actor, reason=reason, dry_run=dry_run,
                                 trust_unsigned=console.options.trust_unsigned,
                                 on_progress=job.report)
        out = summary.to_json()
        out["selected"] = summary.selected
        return out

    def rerun_dry_run(request: Request) -> Response:
        data = form(request)
        flt = _filter(data)
        params = {"filters": {k: str(v) for k, v in flt.to_json().items()}}
        what = ", ".join(f"{k}={v}" for k, v in params["filters"].items())
        job = console.jobs.start("rerun-dry-run", f"Dry run: re-run failed records ({what})",
                                 params, console.actor(request),
                                 lambda job: run_bulk(job, dry_run=True, reason=None))
        return RedirectResponse(f"/jobs/{job.id}", status_code=303)

    def rerun_run(request: Request) -> Response:
        data = form(request)
        dry = console.jobs.get(str(data.get("dry_run") or ""))
        if dry is None or dry.kind != "rerun-dry-run" or dry.state != "done":
            raise BadInput("run the dry run first (its job is gone or did not finish)")
        reason = str(data.get("reason") or "").strip()
        if not reason:
            raise BadInput("reason: say why (it is kept in the audit trail)")
        with console.conn() as conn:
            last = console.store.audit_last_id(conn)
        job = console.jobs.start("rerun", dry.title.replace("Dry run: r", "R", 1),
                                 dict(dry.params), console.actor(request),
                                 lambda job: run_bulk(job, dry_run=False, reason=reason),
                                 audit_after=last)
        return RedirectResponse(f"/jobs/{job.id}", status_code=303)

    def rerun_keys(request: Request) -> Response:
        data = form(request)
        picked = []
        for value in data.getlist("pick"):
            pair = _decode_cursor(str(value))
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(x, str) for x in pair) and pair[1]):
                raise BadInput("a picked record is not NAMESPACE and KEY")
            picked.append((pair[0], pair[1]))
        if not picked:
            raise BadInput("pick at least one record")
        if len(picked) > MAX_PICKS:
            raise BadInput(f"at most {MAX_PICKS} records at once")
        reason = str(data.get("reason") or "").strip()
        if not reason:
            with console.conn() as conn:
                states = {(r["namespace"], r["idempotency_key"]): r for r in
                          console.store.redrive_states(conn, picked)}
            return console.render(request, "rerun_keys.html", title="Re-run chosen records",
                                  picked=picked, states=states)
        with console.conn() as conn:
            last = console.store.audit_last_id(conn)

        def work(job: Job) -> dict[str, Any]:
            results: list[dict[str, Any]] = []
            for i, (ns, key) in enumerate(picked):
                job.report(i, len(picked), sum(1 for r in results if r["ok"]))
                try:
                    with console.conn() as conn:
                        done = rerun_key(console.settings, conn, console.store, key,
                                         actor=job.actor, reason=reason, namespace=ns,
                                         trust_unsigned=console.options.trust_unsigned,
                                         via="console")
                    results.append({"namespace": ns, "key": key, "ok": True,
                                    "what": f"republished to {done.target} from "
                                    f"{done.dlq_topic}[{done.letter.partition}]@"
                                    f"{done.letter.offset}"})
                except KafkaIdemError as exc:
                    results.append({"namespace": ns, "key": key, "ok": False,
                                    "what": redact(str(exc), console.secrets())})
            job.report(len(picked), len(picked), sum(1 for r in results if r["ok"]))
            return {"results": results, "rerun": sum(1 for r in results if r["ok"]),
                    "refused": sum(1 for r in results if not r["ok"])}

        title = (f"Re-run {picked[0][1]}" if len(picked) == 1
                 else f"Re-run {len(picked)} chosen records")
        job = console.jobs.start("rerun-keys", title, {"picked": picked},
                                 console.actor(request), work, audit_after=last)
        return RedirectResponse(f"/jobs/{job.id}", status_code=303)

    def jobs(request: Request) -> Response:
        return console.render(request, "jobs.html", title="Jobs", jobs=console.jobs.recent(100))

    def job_page(request: Request) -> Response:
        job = console.jobs.get(request.path_params["job_id"])
        if job is None:
            return console.render(request, "error.html", 404, title="No such job",
                                  message="no such job (jobs live until the console restarts)")
        audit_rows: list[dict[str, Any]] = []
        if job.state != "running" and job.kind in ("redrive", "rerun", "rerun-keys"):
            with console.conn() as conn:
                audit_rows = console.store.audit_after(conn, job.audit_after, actor=job.actor)
        name = "_job.html" if request.query_params.get("fragment") else "job.html"
        return console.render(request, name, title=job.title, job=job, audit=audit_rows)

    def login_page(request: Request) -> Response:
        if console.guard.token is None:
            return RedirectResponse("/", status_code=303)
        return console.render(request, "login.html", title="Log in", error=None,
                              next=security.safe_next(request.query_params.get("next")))

    def login(request: Request) -> Response:
        data = form(request)
        target = security.safe_next(str(data.get("next") or "/"))
        operator = security.clean_operator(str(data.get("operator") or ""))
        if console.guard.token is None:
            return RedirectResponse("/", status_code=303)
        if not console.guard.check_token(str(data.get("token") or "")) or not operator:
            why = "wrong token" if operator else "give your name (it goes in the audit trail)"
            return console.render(request, "login.html", 401, title="Log in", error=why,
                                  next=target)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(security.SESSION_COOKIE, console.guard.session_cookie(operator),
                            max_age=security.SESSION_SECONDS, httponly=True, samesite="strict",
                            path="/")
        return response

    def logout(request: Request) -> Response:
        response = RedirectResponse("/login" if console.guard.token else "/", status_code=303)
        response.delete_cookie(security.SESSION_COOKIE, path="/")
        return response

    def healthz(request: Request) -> Response:
        if request.query_params.get("ready") and not console.index.ready:
            return PlainTextResponse("indexing the dead-letter topics", status_code=503)
        return PlainTextResponse("ok")

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> Any:
        await run_in_threadpool(console.start)
        try:
            yield
        finally:
            await run_in_threadpool(console.stop)

    static = StaticFiles(directory=str(resources.files("kafka_idem.console") / "static"))
    routes = [
        Route("/", page(overview)),
        Route("/records", page(records)),
        Route("/record", page(record)),
        Route("/dlq", page(dlq)),
        Route("/letter", page(letter)),
        Route("/redrive", page(redrive_form)),
        Route("/redrive/dry-run", page(redrive_dry_run), methods=["POST"]),
        Route("/redrive/run", page(redrive_run), methods=["POST"]),
        Route("/rerun", page(rerun_form)),
        Route("/rerun/dry-run", page(rerun_dry_run), methods=["POST"]),
        Route("/rerun/run", page(rerun_run), methods=["POST"]),
        Route("/rerun/keys", page(rerun_keys), methods=["POST"]),
        Route("/jobs", page(jobs)),
        Route("/jobs/{job_id}", page(job_page)),
        Route("/login", page(login_page)),
        Route("/login", page(login), methods=["POST"]),
        Route("/logout", page(logout), methods=["POST"]),
        Route("/healthz", healthz_endpoint(healthz)),
        Mount("/static", app=static, name="static"),
    ]
    web = Starlette(routes=routes, lifespan=lifespan)
    web.add_middleware(security.GuardMiddleware, guard=console.guard)
    return web


def healthz_endpoint(fn: Callable[[Request], Response]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        return fn(request)
    return endpoint


def _totals(summaries: list[replay.ReplaySummary]) -> dict[str, Any]:
    """Several replays' counts added up (the records picked by hand: one replay each)."""
    by_kind: dict[str, dict[str, int]] = {}
    untrusted: dict[str, int] = {}
    for s in summaries:
        for kind, per in s.by_kind.items():
            mine = by_kind.setdefault(kind, {})
            for outcome, n in per.items():
                mine[outcome] = mine.get(outcome, 0) + n
        for why, n in s.untrusted.items():
            untrusted[why] = untrusted.get(why, 0) + n
    return {"scanned": sum(s.scanned for s in summaries),
            "matched": sum(s.matched for s in summaries),
            "sent": sum(s.sent for s in summaries),
            "would_send": sum(s.would_send for s in summaries),
            "by_kind": by_kind, "untrusted": untrusted,
            "unsendable": [u for s in summaries for u in s.unsendable],
            "groups": [s.group for s in summaries], "runs": [s.run for s in summaries],
            "outcomes": [o for o in replay.OUTCOMES
                         if any(per.get(o) for per in by_kind.values())]}


def create_app(app: App, settings: Settings, options: Options) -> Starlette:
    """The console of ``app`` (its handlers name the DLQ topics it shows)."""
    token = settings.console_token.get_secret_value() if settings.console_token else None
    guard = security.Guard(token=token, read_only=options.read_only, actor=options.actor)
    return build(Console(app, settings, options, guard))
