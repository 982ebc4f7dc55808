"""The app ``kafka-idem verify`` runs in its member processes.

    IDEM_VERIFY_TOPIC=... IDEM_VERIFY_BIZ_SCHEMA=... kafka-idem run kafka_idem.verify.app:app

One handler on ``IDEM_VERIFY_TOPIC``: the payload is an :class:`Intent` (Avro
``kafka_idem.verify.Intent``, shipped next to this file), the idempotency key
``{tenant_id}:verify:{order_id}``, the request hash over amount and currency.
Its business write is one row in ``<IDEM_VERIFY_BIZ_SCHEMA>.ledger``, a table
with *no* unique constraint, so a double execution shows as a second row.

Every handler call also leaves a trace row in ``<biz>.calls``, written on a
connection of its own (autocommit), so it survives the rollback of the call's
transaction: which process ran which attempt, and when.

Fault hooks (environment, read by :meth:`Config.from_env`):

* ``IDEM_VERIFY_MODE``: ``local`` (default) or ``leased``;
* ``IDEM_VERIFY_SLOW_SECONDS`` / ``IDEM_VERIFY_SLOW_ATTEMPTS``: sleep after the
  business write on attempts up to N (default 1), holding the claim;
* ``IDEM_VERIFY_KILL_ORDERS``: order ids whose first attempt SIGKILLs this process
  right after its business write (before the success state);
* ``IDEM_VERIFY_RETRYABLE_ORDERS`` / ``IDEM_VERIFY_RETRYABLE_ATTEMPTS``: raise
  Retryable (after the business write) on attempts up to N;
* ``IDEM_VERIFY_PERMANENT_ORDERS``: raise Permanent after the business write;
* ``IDEM_VERIFY_GATEWAY_URL`` / ``IDEM_VERIFY_GATEWAY_TIMEOUT``: charge the example
  payment gateway (``consumers.gateway``, leased mode, reconciled by key) first;
* ``IDEM_VERIFY_EVENTS_TOPIC``: with its business write, every call emits one
  :class:`Charged` event (JSON; Kafka key = order id) to this topic through the
  outbox (``ctx.emit``), rolled back with the write when the call fails.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from pydantic import BaseModel

from kafka_idem.app import App, Context, Done
from kafka_idem.codecs.avro_codec import AvroCodec
from kafka_idem.errors import Permanent, Retryable

SCHEMA_NAME = "kafka_idem.verify.Intent"
SCHEMAS_DIR = Path(__file__).resolve().parent
KEY_TEMPLATE = "{tenant_id}:verify:{order_id}"
HASH_FIELDS = ("amount", "currency")
HANDLER = "intent"
ENV_PREFIX = "IDEM_VERIFY_"
APP_NAME = "kafka-idem-verify"  # also the namespace of its records


class Intent(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str
    request_id: str
    requested_at: dt.datetime


class Charged(BaseModel):
    """The event of a charge that took effect (``IDEM_VERIFY_EVENTS_TOPIC``)."""

    idempotency_key: str
    order_id: str
    amount: Decimal
    currency: str
    pid: int
    attempt: int


def _orders(raw: str) -> frozenset[str]:
    return frozenset(o for o in raw.split(",") if o)


@dataclass(frozen=True)
class Config:
    """What one member does; built from ``IDEM_VERIFY_*`` (or given to :func:`build_app`)."""

    topic: str = "kafka-idem-verify"
    biz_schema: str = "verify_biz"
    mode: str = "local"
    slow_seconds: float = 0.0
    slow_attempts: int = 1
    kill_orders: frozenset[str] = field(default_factory=frozenset)
    retryable_orders: frozenset[str] = field(default_factory=frozenset)
    retryable_attempts: int = 0
    permanent_orders: frozenset[str] = field(default_factory=frozenset)
    gateway_url: str | None = None
    gateway_timeout: float = 2.0
    events_topic: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        e = os.environ if env is None else env

        def get(name: str, default: str = "") -> str:
            return e.get(ENV_PREFIX + name, default)

        return cls(
            topic=get("TOPIC", cls.topic),
            biz_schema=get("BIZ_SCHEMA", cls.biz_schema),
            mode=get("MODE", cls.mode),
            slow_seconds=float(get("SLOW_SECONDS", "0")),
            slow_attempts=int(get("SLOW_ATTEMPTS", "1")),
            kill_orders=_orders(get("KILL_ORDERS")),
            retryable_orders=_orders(get("RETRYABLE_ORDERS")),
            retryable_attempts=int(get("RETRYABLE_ATTEMPTS", "0")),
            permanent_orders=_orders(get("PERMANENT_ORDERS")),
            gateway_url=get("GATEWAY_URL") or None,
            gateway_timeout=float(get("GATEWAY_TIMEOUT", "2")),
            events_topic=get("EVENTS_TOPIC") or None,
        )

    def to_env(self) -> dict[str, str]:
        """The environment that makes :meth:`from_env` give this config back."""
        env = {
            "TOPIC": self.topic,
            "BIZ_SCHEMA": self.biz_schema,
            "MODE": self.mode,
            "SLOW_SECONDS": str(self.slow_seconds),
            "SLOW_ATTEMPTS": str(self.slow_attempts),
            "KILL_ORDERS": ",".join(sorted(self.kill_orders)),
            "RETRYABLE_ORDERS": ",".join(sorted(self.retryable_orders)),
            "RETRYABLE_ATTEMPTS": str(self.retryable_attempts),
            "PERMANENT_ORDERS": ",".join(sorted(self.permanent_orders)),
            "GATEWAY_URL": self.gateway_url or "",
            "GATEWAY_TIMEOUT": str(self.gateway_timeout),
            "EVENTS_TOPIC": self.events_topic or "",
        }
        return {ENV_PREFIX + k: v for k, v in env.items()}


def business_tables(schema: str) -> list[sql.Composed]:
    """The scenario's business tables, in a schema of their own."""
    s = sql.Identifier(schema)
    return [
        sql.SQL("CREATE SCHEMA {}").format(s),
        sql.SQL(
            "CREATE TABLE {} (id bigserial PRIMARY KEY, idempotency_key text NOT NULL, "
            "order_id text NOT NULL, amount numeric(18,2) NOT NULL, currency text NOT NULL, "
            "charge_id text, pid integer NOT NULL, attempt integer NOT NULL, "
            "created_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(sql.Identifier(schema, "ledger")),
        sql.SQL(
            "CREATE TABLE {} (id bigserial PRIMARY KEY, idempotency_key text NOT NULL, "
            "attempt integer NOT NULL, pid integer NOT NULL, event text NOT NULL, "
            "txid bigint, visible_rows integer, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(sql.Identifier(schema, "calls")),
    ]


class _Tracer:
    """Writes ``calls`` rows on its own autocommit connection (one per process)."""

    def __init__(self, app: App, schema: str) -> None:
        self.app = app
        self.table = sql.Identifier(schema, "calls")
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None

    def __call__(self, ctx: Context, event: str, txid: int | None = None,
                 visible: int | None = None) -> None:
        with self.lock:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.app.settings.dsn, autocommit=True,
                                            application_name="kafka_idem:verify-trace")
            self.conn.execute(
                sql.SQL("INSERT INTO {} (idempotency_key, attempt, pid, event, txid, "
                        "visible_rows) VALUES (%s, %s, %s, %s, %s, %s)").format(self.table),
                (ctx.idempotency_key, ctx.attempt, os.getpid(), event, txid, visible),
            )


def _gateway_client(config: Config) -> Any:
    """``consumers.gateway.GatewayClient`` (the repository's example; not in the package)."""
    module = importlib.import_module("consumers.gateway")
    return module.GatewayClient(config.gateway_url, config.gateway_timeout)


def build_app(config: Config, **settings: Any) -> App:
    """The verify app for ``config``; ``settings`` override Settings fields."""
    settings.setdefault("schemas_dir", SCHEMAS_DIR)
    application = App(APP_NAME, **{"namespace": APP_NAME, **settings})
    gateway = _gateway_client(config) if config.gateway_url else None
    mode = "leased" if gateway is not None else config.mode
    ledger = sql.Identifier(config.biz_schema, "ledger")
    trace = _Tracer(application, config.biz_schema)
    if config.events_topic is not None:
        application.event_topic(config.events_topic, format="json", model=Charged)

    def write(msg: Intent, ctx: Context, charge_id: str | None) -> dict[str, Any]:
        ctx.tx.execute(
            sql.SQL("INSERT INTO {} (idempotency_key, order_id, amount, currency, charge_id, "
                    "pid, attempt) VALUES (%s, %s, %s, %s, %s, %s, %s)").format(ledger),
            (ctx.idempotency_key, msg.order_id, msg.amount, msg.currency, charge_id,
             os.getpid(), ctx.attempt),
        )
        result: dict[str, Any] = {"order_id": msg.order_id, "amount": str(msg.amount),
                                  "currency": msg.currency}
        if charge_id is not None:
            result["charge_id"] = charge_id
        if config.events_topic is not None:
            ctx.emit(config.events_topic, Charged(
                idempotency_key=ctx.idempotency_key, order_id=msg.order_id, amount=msg.amount,
                currency=msg.currency, pid=os.getpid(), attempt=ctx.attempt),
                key=msg.order_id)
        return result

    @application.handler(topic=config.topic, model=Intent, key=KEY_TEMPLATE,
                         hash_fields=HASH_FIELDS, schema=SCHEMA_NAME, name=HANDLER,
                         mode=mode)  # type: ignore[arg-type]
    def intent(msg: Intent, ctx: Context) -> dict[str, Any]:
        trace(ctx, "start")
        charge_id = None
        if gateway is not None:
            charge = gateway.charge(ctx.idempotency_key, {
                "tenant_id": msg.tenant_id, "order_id": msg.order_id,
                "amount": str(msg.amount), "currency": msg.currency,
            })
            charge_id = str(charge["id"])
        result = write(msg, ctx, charge_id)
        order = msg.order_id
        if order in config.permanent_orders:
            raise Permanent("injected permanent failure (verify)")
        if order in config.retryable_orders and ctx.attempt <= config.retryable_attempts:
            raise Retryable(f"injected transient failure on attempt {ctx.attempt}")
        if order in config.kill_orders and ctx.attempt == 1:
            # two statements: on Citus the count runs on the ledger's worker, and the
            # txid read with it would be that worker's; alone it is the transaction's own
            txid = ctx.tx.execute("SELECT txid_current()").fetchone()
            row = ctx.tx.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE idempotency_key = %s").format(ledger),
                (ctx.idempotency_key,),
            ).fetchone()
            assert row is not None and txid is not None
            trace(ctx, "killed_after_write", txid=int(txid[0]), visible=int(row[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        if config.slow_seconds and ctx.attempt <= config.slow_attempts:
            time.sleep(config.slow_seconds)
        return result

    if gateway is not None:

        @intent.reconciler
        def reconcile(msg: Intent, ctx: Context) -> Done | None:
            found = gateway.find(ctx.idempotency_key)
            trace(ctx, "reconciled" if found is not None else "reconcile_not_found")
            if found is None:
                return None
            return Done(write(msg, ctx, str(found["id"])))

    return application


@functools.cache
def codec() -> AvroCodec:
    return AvroCodec.from_dir(SCHEMAS_DIR)


def encode(tenant_id: str, order_id: str, amount: str, currency: str = "EUR", *,
           request_id: str | None = None) -> bytes:
    """The Avro single-object bytes of one intent (a new request id per send by default)."""
    return codec().encode(SCHEMA_NAME, {
        "tenant_id": tenant_id,
        "order_id": order_id,
        "amount": amount,
        "currency": currency,
        "request_id": request_id or uuid.uuid4().hex,
        "requested_at": dt.datetime.now(dt.UTC),
    })


def key_of(tenant_id: str, order_id: str) -> str:
    return KEY_TEMPLATE.format(tenant_id=tenant_id, order_id=order_id)


app = build_app(Config.from_env())
