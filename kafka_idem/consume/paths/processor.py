"""The message path's one entry point: :class:`Processor` runs a unit of work through
the right path and says, per message, what became of it.

* local mode: the batch path (:mod:`~kafka_idem.consume.paths.batch_path`) when every handler
  of the unit allows it, else (or when it falls back) the per-message path
  (:mod:`~kafka_idem.consume.paths.local_path`);
* leased mode: :mod:`~kafka_idem.consume.paths.leased_path`, one message at a time.

The result is :class:`Finished` (the offset may advance, after the DLQ record if any
is acknowledged) or :class:`Deferred` (the partition waits; retry later). Kafka is
not touched here: the runner owns the consumer.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from kafka_idem.app import App, Handler
from kafka_idem.consume.config_hold import ConfigHold
from kafka_idem.consume.outcome import Ahead, Message, Parts, Prepared, Result, Results
from kafka_idem.consume.paths.batch_path import BatchPath, Fallback
from kafka_idem.consume.paths.database import Database
from kafka_idem.consume.paths.lease_keeper import LeaseKeeper
from kafka_idem.consume.paths.leased_path import LeasedPath
from kafka_idem.consume.paths.local_path import LocalPath
from kafka_idem.consume.paths.round_claim import RoundClaim
from kafka_idem.consume.paths.slots import Gate
from kafka_idem.consume.paths.steps import Steps, log
from kafka_idem.consume.paths.worker_groups import WorkerGroups
from kafka_idem.consume.tracing import Tracing
from kafka_idem.errors import FrameworkError, MessageError, StoreUnavailable
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Conn, Store, classify_db_error


class Processor:
    """One processor per thread: it owns one database connection, which its paths share."""

    def __init__(
        self,
        app: App,
        *,
        store: Store,
        metrics: Metrics,
        leases: LeaseKeeper | None = None,
        hold: ConfigHold | None = None,
    ) -> None:
        self.app = app
        self.settings = app.settings
        # the app's keys live in its namespace (a store built without one gets it here)
        self.store = store if store.namespace is not None else store.scoped(app.namespace)
        self.metrics = metrics
        self.leases = leases
        self.group_id = app.group_id
        self.db = Database(self.settings, application_name=f"kafka_idem:{app.name}")
        self.tracing = Tracing(group=app.group_id)
        self.steps = Steps(app, store=self.store, metrics=metrics, db=self.db,
                           tracing=self.tracing, hold=hold)
        self.local_path = LocalPath(self.steps, self.db)
        self.leased_path = LeasedPath(self.steps, self.db, leases)
        self.batch_path = BatchPath(self.steps, self.db)
        self.worker_groups = WorkerGroups(self.steps, self.db, self.local_path)

    def connection(self) -> Conn:
        return self.db.connection()

    def close(self) -> None:
        self.db.close()

    def prepare(self, handler: Handler[Any], msg: Message) -> Prepared:
        """Decode, validate, build key and hash; raise a MessageError when impossible."""
        return self.steps.prepare(handler, msg)

    def run_local(self, parts: Parts, ahead: Ahead | None = None) -> Results:
        """The batch path when it applies, else (or on fallback) the per-message path;
        a span per message when tracing is on (:mod:`kafka_idem.consume.tracing`). The batch
        path takes what ``ahead`` decoded; a fallback decodes afresh, so a model a
        rolled-back handler changed is never used again."""
        with self.tracing.unit([m for _, msgs in parts for m in msgs]) as spans:
            return spans.finish(self._run_local(parts, ahead))

    def _run_local(self, parts: Parts, ahead: Ahead | None) -> Results:
        handlers = {self.app.handlers[tp[0]] for tp, _ in parts}
        if not (self.settings.batch_path and all(h.batch for h in handlers)):
            return self.run_local_safe(parts)
        if self.store.distributed:  # a transaction per Citus worker (worker_groups)
            if any(h.retry_blocks_partition for h in handlers):
                # nothing after a waiting key may take effect before it ends; groups on
                # two workers would commit a later message first
                return self.run_local_safe(parts)
            return self.worker_groups.run(parts, ahead)
        try:
            return self.batch_path.run(parts, ahead)
        except Fallback as exc:
            self._fell_back(parts, exc)
        except (FrameworkError, MessageError, psycopg.Error) as exc:
            # A message's data refused by the database (DataRejected) falls back too:
            # the per-message path isolates the one message it belongs to.
            if isinstance(exc, StoreUnavailable) or classify_db_error(exc) is StoreUnavailable:
                return self.steps.defer_all(parts, exc)
            self._fell_back(parts, exc)
        except Exception as exc:
            # A defect of the optimisation must not take the member down: the
            # per-message path is the reference and decides the batch.
            self._fell_back(parts, exc, defect=True)
        return self.run_local_safe(parts)

    def _fell_back(self, parts: Parts, exc: BaseException, *, defect: bool = False) -> None:
        """Count and log a batch left to the per-message path, with where it was."""
        where = ", ".join(f"{tp[0]}[{tp[1]}]@{msgs[0].offset()}-{msgs[-1].offset()}"
                          for tp, msgs in parts if msgs)
        for topic in {tp[0] for tp, msgs in parts if msgs}:
            self.metrics.batch_fallbacks.labels(topic=topic).inc()
        if defect:
            log.exception("batch path failed; falling back (%s)", where,
                          extra={"action": "batch_fallback"})
        else:
            log.debug("batch falls back: %s (%s)", exc, where,
                      extra={"action": "batch_fallback"})

    def run_local_safe(self, parts: Parts) -> Results:
        """The per-message path alone (see :meth:`LocalPath.run`)."""
        return self.local_path.run(parts)

    def run_leased(
        self, msg: Message, *, reentrant: uuid.UUID | None = None,
        prepared: Prepared | None = None, round: RoundClaim | None = None,
        gate: Gate | None = None,
    ) -> Result:
        with self.tracing.unit([msg]) as spans:
            tp = (msg.topic(), msg.partition())
            res = self.leased_path.run(msg, reentrant=reentrant, prepared=prepared,
                                       round=round, gate=gate)
            return spans.finish({tp: [res]})[tp][0]
