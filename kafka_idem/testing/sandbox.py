"""One database and what runs against it: the app pointed at it, its store, its dead
letters, the processors (each one a consumer process of its own), and how a message is
run on a path until it is finished (:class:`Delivered` says what became of it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kafka_idem.app import App
from kafka_idem.consume.outcome import TP, Finished, Reason, Result
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.observe.metrics import Metrics
from kafka_idem.retry import no_wait
from kafka_idem.store import Conn, Store, connect
from kafka_idem.testing.events import EmittedEvent, mark, read_events
from kafka_idem.testing.letters import CapturedLetter, LetterBox
from kafka_idem.testing.message import FakeMessage
from kafka_idem.testing.processor import KitProcessor
from kafka_idem.testing.tables import State, Table, snapshot

Path = Literal["batch", "per-message", "leased"]
"""How a message is run: the local batch path (falling back to the per-message path,
as the runner does), the local per-message path alone, or the leased path."""


@dataclass(frozen=True)
class Delivered:
    """What became of one delivered message.

    ``outcome`` is the last try's: ``succeeded``, ``replayed`` (a duplicate of a key
    that succeeded: the handler did not run), ``conflict`` (the key was first used
    with another payload), ``dead_lettered``, or ``deferred`` (``reason`` says why:
    ``busy`` when another owner's live lease holds the key). Tries that failed and
    were retried at once are in ``steps`` (``("retry", "retry", "dead_lettered")``).
    ``events`` are the events it left in the outbox (``ctx.emit``, committed): none
    for a replay, a conflict or a failure.
    """

    outcome: str
    reason: str | None
    steps: tuple[str, ...]
    key: str | None
    record: dict[str, Any] | None
    dead_letters: tuple[CapturedLetter, ...]
    message: FakeMessage
    events: tuple[EmittedEvent, ...] = ()

    @property
    def status(self) -> str | None:
        """The key's record status (``None``: no record, e.g. an undecodable message)."""
        return None if self.record is None else self.record["status"]

    @property
    def result(self) -> Any:
        """The stored result every duplicate gets back (``None`` until it succeeded)."""
        if self.record is None or self.record["status"] != "succeeded":
            return None
        return self.record["result_json"]

    @property
    def attempts(self) -> int:
        """The attempts the key's record counts (0: no record)."""
        return 0 if self.record is None else int(self.record["attempts"])


def _step(result: Result) -> str:
    return result.outcome.value if isinstance(result, Finished) else result.reason.value


class Sandbox:
    """One clean database and what runs against it: the app pointed at it, its store,
    its dead letters, and the processors (each one a consumer process of its own)."""

    def __init__(self, app: App, kit: Conn) -> None:
        self.app = app
        self.dsn = app.settings.dsn
        s = self.app.settings
        self.store = Store(schema=s.schema_name, table=s.table, namespace=self.app.namespace)
        self.letters = LetterBox(header_limit=s.error_message_max,
                                 signing_keys=s.signing_keys)
        self._procs: list[KitProcessor] = []
        self._main: KitProcessor | None = None
        self._kit = kit

    @property
    def main(self) -> KitProcessor:
        """The processor :meth:`Harness.deliver` uses (one consumer process)."""
        if self._main is None:
            self._main = self.processor()
        return self._main

    def processor(self) -> KitProcessor:
        """A new processor: a process of its own, with its own connection (and, for
        ``async def`` handlers, its own event loop and async connection)."""
        proc = KitProcessor(self.app, store=self.store, metrics=Metrics())
        self._procs.append(proc)
        return proc

    def conn(self) -> Conn:
        """The kit's own connection (reads, and the clock), outside any processor's."""
        return self._kit

    def connect(self) -> Conn:
        """A new connection of the kit's own (autocommit), for a thread of its own."""
        conn = connect(self.dsn, application_name="kafka_idem:testing")
        conn.autocommit = True
        return conn

    def record(self, key: str | None) -> dict[str, Any] | None:
        """The idempotency record of ``key`` as a dict of its columns (``None``: none)."""
        return None if key is None else self.store.get(self.conn(), key)

    def state(self, tables: Iterable[Table]) -> State:
        """A snapshot of the rows of ``tables``, to compare with another run's."""
        return snapshot(self.conn(), tables)

    def expire_leases(self, key: str | None = None) -> list[str]:
        """Make the processing records' leases (``key``'s only, when given) expire now, as if
        their owner had stalled; return the keys whose lease was expired."""
        return self.store.expire_leases(self.conn(), key=key)

    def events(self, *, after: int = 0) -> list[EmittedEvent]:
        """The committed events in the outbox (ids above ``after``), in id order."""
        return read_events(self.conn(), self.app, after=after)

    def mark(self) -> int:
        """The outbox's highest id now: :meth:`events` after it are what came since."""
        return mark(self.conn(), self.app.settings.schema_name, self.app.namespace)

    def run(self, proc: Processor, msg: FakeMessage, path: Path,
            reentrant: Any = None) -> Result:
        """One try of ``msg`` on ``path`` (what one unit of work of the runner does); an
        ``async def`` handler's on the async leased path (:class:`KitProcessor`)."""
        tp: TP = (msg.topic(), msg.partition())
        if path == "leased":
            result = proc.run_leased(msg, reentrant=reentrant)
        elif path == "batch":
            result = proc.run_local([(tp, [msg])])[tp][0]
        else:
            result = proc.run_local_safe([(tp, [msg])])[tp][0]
        return result

    def run_until(self, proc: Processor, msg: FakeMessage, path: Path,
                  ran: Callable[[], bool], retried: Callable[[Result], None]) -> Result:
        """Tries of ``msg`` on ``path`` until ``ran()`` (a plan's hook ran): a handler
        whose first attempts fail (``Retryable``: a remote side busy) is tried again at
        once, as the runner would retry it, each such try told to ``retried``; the last
        try's result (a hook that raises ends it there)."""
        handler = self.app.handlers[msg.topic()]
        token = None
        with no_wait():
            for _ in range(max(1, self.app.retry_policy(handler).max_attempts)):
                result = self.run(proc, msg, path, token)
                if ran() or isinstance(result, Finished) or result.reason != Reason.RETRY:
                    break
                retried(result)
                token = result.token
        return result

    def drive(self, proc: Processor, msg: FakeMessage, path: Path, *,
              limit: int | None = None) -> Delivered:
        """Run ``msg`` as the runner would until it is finished: a retry is due at once
        (no waiting), a failure of the framework's surroundings is tried again; a busy
        key (another owner's live lease) stops it, deferred. At most ``limit`` tries
        (default: the handler's retry budget, and ten more)."""
        if limit is None:
            handler = self.app.handlers[msg.topic()]
            limit = self.app.retry_policy(handler).max_attempts + 10
        steps: list[Result] = []
        letters: list[CapturedLetter] = []
        token = None
        since = self.mark()
        with no_wait():
            for _ in range(limit):
                result = self.run(proc, msg, path, token)
                steps.append(result)
                letters += self.letters.send({(msg.topic(), msg.partition()): [result]})
                if isinstance(result, Finished) or result.reason == "busy":
                    break
                token = result.token
        return self.delivered(proc, msg, steps, letters, since=since)

    def delivered(self, proc: Processor, msg: FakeMessage, steps: list[Result],
                  letters: list[CapturedLetter], *, since: int | None = None) -> Delivered:
        """What became of ``msg``; its events are those after the mark ``since``
        (``None``: not known, several deliveries ran at once)."""
        last = steps[-1]
        key = last.key if isinstance(last, Finished) else None
        if key is None:
            key = proc.steps.key_of(proc.steps.handler(msg), msg)
        return Delivered(
            outcome=last.outcome.value if isinstance(last, Finished) else "deferred",
            reason=None if isinstance(last, Finished) else last.reason.value,
            steps=tuple(_step(r) for r in steps), key=key, record=self.record(key),
            dead_letters=tuple(letters), message=msg,
            events=() if since is None else tuple(self.events(after=since)))

    def close(self) -> None:
        """Close every processor: its connections, async ones included, and its loop."""
        for proc in self._procs:
            proc.close()
        self._procs.clear()
        self._main = None


