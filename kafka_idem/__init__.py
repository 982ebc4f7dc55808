"""kafka_idem: exactly-once effects for Kafka consumers, backed by PostgreSQL.

    from kafka_idem import App, Context

    app = App("payments")

    @app.handler(topic="payments.charge-requested", model=ChargeRequested,
                 key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"))
    def charge(msg: ChargeRequested, ctx: Context) -> dict:
        ctx.tx.execute("INSERT INTO payments.ledger ...", (...))
        return {"ok": True}

Run it with ``kafka-idem run shop:app``, or from code::

    from kafka_idem import Runner

    runner = Runner(app)
    runner.install_signal_handlers()  # SIGTERM/SIGINT stop it as they stop `kafka-idem run`
    raise SystemExit(runner.run())    # until stopped (runner.stop() from another thread)
"""

from kafka_idem._version import __version__
from kafka_idem.app import App, AsyncContext, Context, Done, Handler
from kafka_idem.consume.runner import Runner
from kafka_idem.errors import (
    ConfigError,
    DataRejected,
    DeadLetterError,
    DeliveryFailed,
    FrameworkError,
    HandlerError,
    IllegalTransition,
    InvalidEvent,
    InvalidKey,
    InvalidPayload,
    KafkaIdemError,
    MessageError,
    MissingKeyField,
    Permanent,
    Retryable,
    StaleOwner,
    StoreError,
    StoreUnavailable,
    Undecodable,
    UnknownOutcome,
)
from kafka_idem.keys import request_hash
from kafka_idem.retry import RetryPolicy, no_wait
from kafka_idem.settings import Settings

__all__ = [
    "App",
    "AsyncContext",
    "ConfigError",
    "Context",
    "DataRejected",
    "DeadLetterError",
    "DeliveryFailed",
    "Done",
    "FrameworkError",
    "Handler",
    "HandlerError",
    "IllegalTransition",
    "InvalidEvent",
    "InvalidKey",
    "InvalidPayload",
    "KafkaIdemError",
    "MessageError",
    "MissingKeyField",
    "Permanent",
    "RetryPolicy",
    "Retryable",
    "Runner",
    "Settings",
    "StaleOwner",
    "StoreError",
    "StoreUnavailable",
    "Undecodable",
    "UnknownOutcome",
    "__version__",
    "no_wait",
    "request_hash",
]
