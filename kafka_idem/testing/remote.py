"""Remote side effects, as the test kit sees them.

A handler's effects in *this* database are read from its tables. Effects elsewhere
(a payment API, an e-mail service) can only be seen by the service itself, so a test
passes the harness the fakes its handler calls, as ``remotes={"bank": bank}``: any
object with ``effects()`` (what the remote side did, in values that compare equal
from one run to the next) and ``reset()`` (forget everything; called before each
scenario). :class:`FakeService` is a ready one that deduplicates by idempotency key,
as a well-behaved remote API does: a handler that passes ``ctx.idempotency_key``
shows one effect however often it is called; one that does not shows one per call,
and a scenario that calls it again (a crash, a lease taken over, a retry) fails.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Remote(Protocol):
    """What the kit asks of a remote fake."""

    def effects(self) -> Iterable[Any]:
        """What the remote side did, each effect a value that compares (and hashes, or
        has a stable ``repr``) equal from one run to the next."""
        ...

    def reset(self) -> None:
        """Forget every effect (a scenario starts from a clean remote, as from a clean
        database)."""
        ...


@dataclass(frozen=True, slots=True)
class Call:
    """One request a :class:`FakeService` received."""

    operation: str
    key: str | None
    fields: tuple[tuple[str, Any], ...]
    applied: bool  # False: a repeat of a key already applied (answered from memory)


@dataclass
class FakeService:
    """A remote service for tests that records every call and deduplicates by key.

        bank = FakeService("bank")
        answer = bank.call("charge", key=ctx.idempotency_key, amount="10.00")
        bank.find(ctx.idempotency_key)   # in a reconciler: the answer, or None

    ``call`` applies an operation once per ``key`` (a repeat gets the first answer
    back, as with an ``Idempotency-Key`` header); a call without a key is applied
    every time. ``effects()`` lists what was applied (operation, key, fields); the
    answers carry an ``id`` numbered from 1 after each ``reset()``, so a scenario's
    ids match the reference's when the handler behaves.
    """

    name: str = "service"
    calls: list[Call] = field(default_factory=list)
    _answers: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    _applied: list[tuple[str, str | None, tuple[tuple[str, Any], ...]]] = field(
        default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def call(self, operation: str, *, key: str | None = None, **fields: Any) -> dict[str, Any]:
        """Apply ``operation`` (once per ``key``); return its answer: ``id``,
        ``operation``, ``key`` and the fields."""
        frozen = tuple(sorted(fields.items()))
        with self._lock:
            if key is not None and key in self._answers:
                self.calls.append(Call(operation, key, frozen, applied=False))
                return dict(self._answers[key])
            self._applied.append((operation, key, frozen))
            answer = {"id": f"{self.name}-{len(self._applied)}", "operation": operation,
                      "key": key, **fields}
            if key is not None:
                self._answers[key] = answer
            self.calls.append(Call(operation, key, frozen, applied=True))
            return dict(answer)

    def find(self, key: str) -> dict[str, Any] | None:
        """The answer of the operation applied with ``key``, or ``None`` (what a
        reconciler asks)."""
        with self._lock:
            found = self._answers.get(key)
            return None if found is None else dict(found)

    def effects(self) -> list[tuple[str, str | None, tuple[tuple[str, Any], ...]]]:
        """The operations applied, in order: ``(operation, key, sorted fields)``."""
        with self._lock:
            return list(self._applied)

    def reset(self) -> None:
        """Forget every call, answer and effect; ids start from 1 again."""
        with self._lock:
            self.calls.clear()
            self._answers.clear()
            self._applied.clear()
