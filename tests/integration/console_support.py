"""Helpers for the console's HTTP tests (``test_console_*.py``): the console in-process
under Starlette's TestClient (its lifespan runs: the pool, the DLQ index, the sampler),
the pages' parts the tests read (ids, links, forms), jobs polled to their end, the
store's durable state for "nothing changed", and a world of records and dead letters
made by the console tests' app (``tests.apps.consoled``) against the real broker and
database."""

from __future__ import annotations

import contextlib
import html
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
from psycopg import sql
from starlette.testclient import TestClient

from kafka_idem import App
from kafka_idem.console import Options, create_app
from kafka_idem.settings import Settings
from tests.acceptance.conftest import produce_with_headers, read_all
from tests.apps.consoled import build
from tests.conftest import (
    ADMIN_DSN,
    DB,
    InProcess,
    Topics,
    app_settings,
    committed,
    produce,
    wait_for,
)
from tests.integration.support import migrate_app

BASE = "http://127.0.0.1"  # a loopback Host: a console without a token serves no other
ACTOR = "tester"
OPERATOR = f"{ACTOR} (console)"  # the audit actor of a write through the console
CONSOLE_SCRIPT = '<script src="/static/console.js" defer></script>'
SECURITY_HEADERS = {"x-frame-options": "DENY", "x-content-type-options": "nosniff",
                    "cache-control": "no-store"}


# --- the console ------------------------------------------------------------------------


@contextlib.contextmanager
def console(app: App, settings: Settings | None = None, *, ready: bool = True,
            raise_server_exceptions: bool = True, **options: Any) -> Iterator[TestClient]:
    """A TestClient over the console of ``app`` (its lifespan started, and with
    ``ready`` its DLQ index caught up), redirects not followed."""
    options.setdefault("actor", ACTOR)
    web = create_app(app, settings or app.settings, Options(**options))
    with TestClient(web, base_url=BASE, follow_redirects=False,
                    raise_server_exceptions=raise_server_exceptions) as client:
        if ready:
            wait_for(lambda: client.get("/healthz?ready=1").status_code == 200, timeout=60,
                     what="the console's DLQ index to catch up", interval=0.05)
        yield client


def get(client: TestClient, url: str, **kwargs: Any) -> Page:
    """GET ``url``, which must answer 200, as a :class:`Page`."""
    r = client.get(url, **kwargs)
    assert r.status_code == 200, (url, r.status_code, r.text[-2000:])
    return Page(r.text)


def csrf_of(client: TestClient) -> str:
    """The CSRF token of ``client``'s cookie: from the form of a page, or (a read-only
    console shows no form) made as the console makes it, with its key."""
    page = Page(client.get("/rerun").text)
    if page.inputs("csrf"):
        return page.csrf
    from kafka_idem.console import security

    [guard] = [m.kwargs["guard"] for m in client.app.user_middleware  # type: ignore[attr-defined]
               if m.cls is security.GuardMiddleware]
    return str(guard.csrf_token(client.cookies[guard.csrf_name]))


def post(client: TestClient, url: str, data: dict[str, Any] | list[tuple[str, str]], *,
         csrf: bool = True, **kwargs: Any) -> Any:
    """POST a form, with the client's CSRF token unless ``csrf`` is false."""
    items = list(data.items()) if isinstance(data, dict) else list(data)
    if csrf:
        items.append(("csrf", csrf_of(client)))
    return client.post(url, data=_form(items), **kwargs)


def _form(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in items:
        if name in out:
            prev = out[name]
            out[name] = [*prev, value] if isinstance(prev, list) else [prev, value]
        else:
            out[name] = value
    return out


def job_of(response: Any) -> str:
    """The job a POST started (its 303 to the job's page)."""
    assert response.status_code == 303, (response.status_code, response.text[-2000:])
    location = response.headers["location"]
    assert location.startswith("/jobs/"), location
    return location.removeprefix("/jobs/")


def finished(client: TestClient, job_id: str, *, timeout: float = 90.0) -> Page:
    """The page of job ``job_id`` once it ended (polled: its fragment says data-final)."""
    def ended() -> bool:
        r = client.get(f"/jobs/{job_id}?fragment=1")
        assert r.status_code == 200, r.text
        return "data-final" in r.text

    wait_for(ended, timeout=timeout, what=f"job {job_id} to end", interval=0.1)
    return get(client, f"/jobs/{job_id}")


# --- reading pages -----------------------------------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str | None]] = []
        self.text: dict[str, list[str]] = {}
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag in VOID:
            return
        ident = a.get("id")
        if ident is not None:
            self.text.setdefault(ident, [])
        self.stack.append((tag, ident))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        for _, ident in self.stack:
            if ident is not None:
                self.text[ident].append(data)


class Page:
    """An HTML page: the text of its elements by id, its links, forms and inputs."""

    def __init__(self, text: str) -> None:
        self.html = text
        p = _Parser()
        p.feed(text)
        p.close()
        self.tags = p.tags
        self._text = {k: "".join(v) for k, v in p.text.items()}

    def has(self, ident: str) -> bool:
        return any(a.get("id") == ident for _, a in self.tags)

    def text(self, ident: str) -> str:
        assert ident in self._text, f"no element #{ident}"
        return self._text[ident]

    def href(self, ident: str) -> str | None:
        for tag, a in self.tags:
            if tag == "a" and a.get("id") == ident:
                return a["href"]
        return None

    def hrefs(self, prefix: str) -> list[str]:
        return [a["href"] for tag, a in self.tags if tag == "a" and a.get("href", "").startswith(
            prefix)]

    def inputs(self, name: str) -> list[str]:
        return [a.get("value", "") for tag, a in self.tags if tag == "input"
                and a.get("name") == name]

    @property
    def csrf(self) -> str:
        found = self.inputs("csrf")
        assert found, "no form with a CSRF field on the page"
        return found[0]

    def post_forms(self) -> list[str]:
        """The actions of the page's POST forms."""
        return [a.get("action", "") for tag, a in self.tags if tag == "form"
                and a.get("method", "").lower() == "post"]

    def record_links(self) -> list[tuple[str, str]]:
        """(namespace, key) of every link to a record's page, in page order."""
        out = []
        for href in self.hrefs("/record?"):
            q = parse_qs(urlsplit(href).query, keep_blank_values=True)
            out.append((q["ns"][0], q["key"][0]))
        return out

    def letter_links(self) -> list[tuple[int, int]]:
        """(partition, offset) of every link to a dead letter's page, in page order."""
        out = []
        for href in self.hrefs("/letter?"):
            q = parse_qs(urlsplit(href).query)
            out.append((int(q["partition"][0]), int(q["offset"][0])))
        return out


def scripts(text: str) -> list[str]:
    """Every ``<script`` tag of a page (case-insensitive), as written."""
    return [m.group(0) for m in re.finditer(r"<script[^>]*>", text, re.IGNORECASE)]


def assert_no_markup_from_data(text: str) -> None:
    """The page's only script tag is the console's own: no data became markup."""
    assert scripts(text) == [CONSOLE_SCRIPT.removesuffix("</script>")], scripts(text)
    for raw in ("<img", "<b>bold", "<b>lovelace"):  # markup the tests' data carries
        assert raw not in text.lower(), raw


def walk(client: TestClient, url: str) -> tuple[list[Page], list[str]]:
    """The pages from ``url`` on, following each page's ``#next-page`` link."""
    pages, urls = [], []
    while url:
        urls.append(url)
        page = get(client, url)
        pages.append(page)
        nxt = page.href("next-page")
        url = html.unescape(nxt) if nxt else ""
        assert len(pages) < 100, "the next-page links do not end"
    return pages, urls


# --- the store's durable state ------------------------------------------------------------


def state(db: DB) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Every record, every audit row and the ledger size: what a write would change."""
    records = db.rows("SELECT * FROM kafka_idem.task_idempotency "
                      "ORDER BY namespace, idempotency_key")
    audit = db.rows("SELECT * FROM kafka_idem.admin_audit ORDER BY id")
    return records, audit, int(db.value("SELECT count(*) FROM payments.ledger"))


def audit_rows(db: DB, action: str | None = None) -> list[dict[str, Any]]:
    if action is None:
        return db.rows("SELECT * FROM kafka_idem.admin_audit ORDER BY id")
    return db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = %s ORDER BY id",
                   (action,))


def status_of(db: DB, key: str, namespace: str = "consoled") -> str | None:
    return db.value("SELECT status FROM kafka_idem.task_idempotency WHERE namespace = %s "
                    "AND idempotency_key = %s", (namespace, key))


def pick(namespace: str, key: str) -> str:
    """A record's ``pick`` value on the records page (a chosen key to re-run)."""
    import base64

    raw = json.dumps([namespace, key]).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii")


# --- a world of records and dead letters ---------------------------------------------------


def order(tenant: str, order_id: str, do: str = "ok", **extra: Any) -> bytes:
    return json.dumps({"tenant": tenant, "order": order_id, "amount": 1, "do": do,
                       **extra}).encode()


def order_key(order_id: str, tenant: str = "t1") -> str:
    """The idempotency key of an order (``%`` and ``:`` percent-encoded by the template)."""
    return f"{tenant}:order:" + order_id.replace("%", "%25").replace(":", "%3A")


@dataclass
class World:
    """The console tests' app run over fresh topics into a database of its own."""

    db: DB
    orders: str  # handler "order" (2 partitions); its DLQ is also the refunds'
    refunds: str  # handler "refund" (1 partition)
    group: str
    app: App
    dlq: str = field(init=False)

    def __post_init__(self) -> None:
        self.dlq = f"{self.orders}.dlq"

    def run(self, *, dead_letters: int | None = None, until: Any = None) -> None:
        """Run the app's consumer until it consumed both topics (and the DLQ holds
        ``dead_letters`` records, and ``until()`` holds)."""
        def done() -> bool:
            if not (consumed(self.group, self.orders) and consumed(self.group, self.refunds)):
                return False
            if dead_letters is not None and len(read_all(self.dlq)) < dead_letters:
                return False
            return until is None or bool(until())

        with InProcess(self.app):
            wait_for(done, timeout=90, what="the consumer to catch up", interval=0.2)

    def produce(self, orders: list[tuple[bytes | str | None, bytes]] | None = None,
                refunds: list[tuple[bytes | str | None, bytes]] | None = None,
                *, with_headers: list[tuple[bytes, bytes, list[Any]]] | None = None) -> None:
        if orders:
            produce(self.orders, orders)
        if refunds:
            produce(self.refunds, refunds)
        if with_headers:
            produce_with_headers(self.orders, with_headers)  # type: ignore[arg-type]

    def fix(self, *orders: str) -> None:
        """The cause is fixed for these orders (``'*'``: every order)."""
        with psycopg.connect(self.db.dsn, autocommit=True) as conn:
            for o in orders:
                conn.execute("INSERT INTO consoled.fixed VALUES (%s) ON CONFLICT DO NOTHING",
                             (o,))


def consumed(group: str, topic: str) -> bool:
    """``group`` committed past every record of ``topic`` (a re-drive's records come in
    Kafka transactions: the end offset counts their commit markers too)."""
    last: dict[int, int] = {}
    for m in read_all(topic):
        last[m.partition()] = max(last.get(m.partition(), -1), m.offset())
    done = committed(group, topic)
    return all(done.get(p, -1) > offset for p, offset in last.items())


@contextlib.contextmanager
def world(admin: Any, template_db: str, **settings: Any) -> Iterator[World]:
    """A fresh database (a clone of the migrated template), fresh topics and the app."""
    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    topics = Topics(admin)
    try:
        db = DB(name)
        orders = topics(partitions=2, prefix="orders")
        refunds = topics(partitions=1, dlq=False, prefix="refunds")
        group = f"g-{uuid.uuid4().hex[:10]}"
        app = build(orders, refunds, **app_settings(
            db, group_id=group, max_attempts=2, backoff_base_seconds=0.02,
            backoff_cap_seconds=0.05, **settings))
        migrate_app(db, app)
        yield World(db, orders, refunds, group, app)
    finally:
        topics.delete_all()
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def stored(db: DB, key: str, status: str = "failed", *, namespace: str = "consoled",
           handler: str = "order", message: str = "m") -> None:
    """A record written straight through the store (keys and texts the app's key
    template would never build: control characters, markup)."""
    from kafka_idem.store import Delivery, Store, connect

    store = Store(schema="kafka_idem", table="task_idempotency", namespace=namespace)
    conn = connect(db.dsn)
    try:
        with conn.transaction():
            c = store.claim(conn, key=key, request_hash="v1:x",
                            delivery=Delivery("t", 0, 0, handler), lease_seconds=30,
                            max_attempts=5, max_elapsed_seconds=3600)
            assert c.token is not None
            if status == "succeeded":
                store.complete(conn, key=key, token=c.token, result=1)
            elif status in ("failed", "retryable_failed"):
                store.fail(conn, key=key, token=c.token, status=status, kind="permanent",
                           error_class="Permanent", error_message=message, delay=60)
    finally:
        conn.close()


def produce_one(topic: str, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes]], partition: int = 0) -> tuple[int, int]:
    """One record with ``headers`` (e.g. a dead letter written by hand: untrusted bytes);
    its (partition, offset)."""
    from confluent_kafka import Producer

    from tests.conftest import BOOTSTRAP

    got: list[tuple[int, int]] = []
    p = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    p.produce(topic, key=key, value=value, headers=headers, partition=partition,
              on_delivery=lambda err, msg: got.append((msg.partition(), msg.offset()))
              if err is None else None)
    assert p.flush(30) == 0
    assert len(got) == 1
    return got[0]
