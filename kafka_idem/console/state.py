"""What the console's pages share: :class:`Options` (how it was started) and
:class:`Console` (the app, its settings and store, a pool of connections, the DLQ
index, the overview's sampler, the jobs, the templates)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from psycopg_pool import ConnectionPool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from kafka_idem.admin import operations as admin
from kafka_idem.app import App
from kafka_idem.console import security
from kafka_idem.console.dlq_index import DlqIndex
from kafka_idem.console.forms import BadInput, encode_cursor, opt, when
from kafka_idem.console.jobs import Jobs
from kafka_idem.console.overview import Sampler
from kafka_idem.deadletters.dead_letter import ERROR_KINDS
from kafka_idem.observe.redact import redact
from kafka_idem.observe.text import plain
from kafka_idem.replay.reading import Reader
from kafka_idem.settings import Settings
from kafka_idem.store import Store
from kafka_idem.store.citus import fit
from kafka_idem.store.connection import configure
from kafka_idem.store.errors import translate_errors

POOL_TIMEOUT = 10.0  # seconds a page waits for a database connection


@dataclass
class Options:
    """How ``kafka-idem console`` was started."""

    addr: str = "127.0.0.1"
    port: int = 8088
    read_only: bool = False
    actor: str = "console"
    refresh_seconds: float = 5.0
    trust_unsigned: bool = False



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
            s.dsn, min_size=1, max_size=4, open=False, configure=configure, timeout=POOL_TIMEOUT,
            kwargs={"autocommit": False, "application_name": "kafka_idem.console"})
        dlqs = sorted({self.app.dlq_topic(h) for h in self.app.handlers.values()})
        self.index = DlqIndex(s, dlqs)
        self.sampler = Sampler(self.app, s, self.store, self.index,
                               self.options.refresh_seconds)
        self.reader = Reader(s)
        self.jobs.secrets = s.secret_values()
        self.templates = Environment(
            loader=PackageLoader("kafka_idem.console", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True))
        self.templates.filters["shown"] = plain
        secrets = s.secret_values()
        # error texts and header values: control characters escaped, and whatever looks
        # like a password (a URL's, password=...) or is one of the settings' masked
        self.templates.filters["masked"] = lambda v: redact(plain(v), secrets)
        self.templates.filters["shown_lines"] = lambda v: "\n".join(
            plain(line) for line in str(v).split("\n"))
        self.templates.filters["masked_lines"] = lambda v: "\n".join(
            redact(plain(line), secrets) for line in str(v).split("\n"))
        self.templates.filters["iso"] = lambda t: dt.datetime.fromtimestamp(
            t, dt.UTC).isoformat(timespec="seconds")
        self.templates.filters["when"] = when
        self.templates.filters["cursor"] = encode_cursor
        self.templates.filters["pick"] = lambda r: encode_cursor(
            [r["namespace"], r["idempotency_key"]])
        self.templates.globals["ns_shown"] = admin.shown

    @contextmanager
    def conn(self) -> Iterator[Any]:
        # translated: a store that went away (no connection within POOL_TIMEOUT) is the
        # error page's StoreUnavailable, as on any other database error
        with translate_errors(), self.pool.connection() as conn:
            yield conn
            conn.rollback()

    def secrets(self) -> list[str]:
        return self.settings.secret_values()

    def start(self) -> None:
        self.pool.open(wait=True, timeout=30)
        with self.conn() as conn:
            fit(conn, self.store)  # a store distributed on Citus: its queries
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

    def dlq_topic(self, params: Any) -> str:
        """The DLQ topic a page names: one of the app's."""
        topic = opt(params, "topic")
        if topic is None or topic not in self.index.topics:
            known = ", ".join(self.index.topics) or "none"
            raise BadInput(f"topic: {topic!r} is not a DLQ topic of app {self.app.name!r} "
                           f"(its DLQ topics: {known})")
        return topic

    def actor(self, request: Request) -> str:
        return f"{request.state.operator} (console)"


# --- small helpers -----------------------------------------------------------------------
