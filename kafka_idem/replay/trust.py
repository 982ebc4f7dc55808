"""Who a replay acts for: the boundary a dead letter must be inside to be sent or to
have its key re-run.

A dead letter's headers are written by whoever can write to the DLQ topic, and a
replay runs with an operator's rights. So a replay believes a header only as far
as it can check it (docs/PROTOCOL.md, "What a replay trusts"):

* **the signature** (:mod:`kafka_idem.deadletters.signing`): where signing keys are
  configured, a record whose ``idem.signature`` does not hold is never acted on;
  an unsigned one only with ``trust_unsigned`` (written before signing);
* **the target**: a record goes back only to a source topic of the DLQ: with an
  app, the topics of the handlers whose dead letters go to this DLQ; without one,
  the DLQ's name less the ``dlq_suffix``. ``--to`` replaces the target for every
  record (the operator's choice, not the header's);
* **the namespace**: only keys of the replay's namespace are re-run (the app's,
  or ``--namespace``); without one, no key is re-run;
* **the key** (with an app): the record's value, decoded by its handler's codec,
  must build the idempotency key the header names, and the request hash its
  record holds.

A record outside is skipped and counted as ``skipped_untrusted`` with one of
:data:`REASONS`, and logged with its position; nothing else of the replay changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kafka_idem.deadletters.signing import Verdict, verify
from kafka_idem.errors import ConfigError, MessageError
from kafka_idem.keys import check_key, hash_payload
from kafka_idem.replay.records import DlqRecord
from kafka_idem.settings import Settings

if TYPE_CHECKING:
    from kafka_idem.app import App
    from kafka_idem.handler import Handler

REASONS = {
    "bad_signature": "its idem.signature does not hold: forged or altered",
    "unsigned": "no idem.signature while signing keys are configured (--trust-unsigned "
                "admits records written before signing)",
    "other_topic": "its idem.original.topic is not a source topic of this DLQ",
    "other_namespace": "its idem.namespace is not the replay's namespace",
    "no_namespace": "names a failed key, and the replay has no namespace to re-run keys "
                    "in: give --app MODULE:APP or --namespace NS",
    "key_mismatch": "its value does not build the idempotency key (or request hash) its "
                    "headers name",
}


@dataclass(frozen=True)
class Boundary:
    """What a replay of ``dlq_topic`` may act on (see the module doc)."""

    dlq_topic: str
    sources: frozenset[str]  # where a record may go back to (unless to_topic)
    namespace: str | None  # where keys may be re-run (None: nowhere)
    to_topic: str | None = None
    secrets: tuple[bytes, ...] = ()
    trust_unsigned: bool = False
    app: App | None = None
    key_max_bytes: int = 1024

    @classmethod
    def of(cls, settings: Settings, dlq_topic: str, *, app: App | None = None,
           namespace: str | None = None, to_topic: str | None = None,
           trust_unsigned: bool = False) -> Boundary:
        """The boundary of a replay of ``dlq_topic``; :class:`ConfigError` when it has
        no source topic to send to (no app, no ``to_topic`` and a DLQ name without the
        suffix) or when ``namespace`` is not the app's."""
        if app is not None:
            owners = [h for h in app.handlers.values() if app.dlq_topic(h) == dlq_topic]
            if not owners:
                theirs = sorted({app.dlq_topic(h) for h in app.handlers.values()})
                raise ConfigError(
                    f"app {app.name!r} has no handler whose dead letters go to {dlq_topic!r} "
                    f"(its DLQ topics: {', '.join(theirs) or 'none'})", setting="app")
            if namespace is not None and namespace != app.namespace:
                raise ConfigError(
                    f"namespace {namespace!r} is not app {app.name!r}'s ({app.namespace!r}): "
                    "a replay with --app re-runs keys of its app only", setting="namespace")
            sources = frozenset(h.topic for h in owners)
            namespace = app.namespace
        else:
            suffix = settings.dlq_suffix
            source = dlq_topic[: -len(suffix)] if dlq_topic.endswith(suffix) else ""
            if not source and to_topic is None:
                raise ConfigError(
                    f"the source topic of {dlq_topic!r} cannot be told from its name (it does "
                    f"not end with the dlq_suffix {suffix!r}): give --app MODULE:APP, whose "
                    "handlers name their DLQ, or --to TOPIC", setting="app")
            sources = frozenset([source] if source else [])
        return cls(dlq_topic, sources, namespace, to_topic, settings.signing_keys,
                   trust_unsigned, app, settings.key_max_bytes)

    @property
    def verifies(self) -> bool:
        """Whether signatures can be checked (signing keys configured)."""
        return bool(self.secrets)

    def signature(self, rec: DlqRecord) -> Verdict:
        return verify(self.secrets, rec.headers, rec.key, rec.value)

    def outside(self, rec: DlqRecord) -> str | None:
        """Why ``rec`` is outside the boundary before its key's state is read (one of
        :data:`REASONS`), or ``None``."""
        verdict = self.signature(rec)
        if verdict == "invalid":
            return "bad_signature"
        if verdict == "unsigned" and not self.trust_unsigned:
            return "unsigned"
        if self.to_topic is None and rec.original_topic not in self.sources:
            return "other_topic"
        if (self.namespace is not None and rec.namespace is not None
                and rec.namespace != self.namespace):
            return "other_namespace"
        return None

    def handler_of(self, rec: DlqRecord) -> Handler[Any] | None:
        """The app's handler whose dead letter ``rec`` says it is (one of the DLQ's)."""
        if self.app is None or rec.original_topic not in self.sources:
            return None
        return self.app.handlers.get(rec.original_topic or "")

    def key_holds(self, rec: DlqRecord, state: Mapping[str, Any], *,
                  compare_hash: bool = True) -> bool:
        """With an app: whether the record's value builds the key its header names and,
        where the key's record holds one, the same request hash. Without an app there
        is no codec to check with: ``True``. A framework error (the schema registry
        down) is raised, never taken for a mismatch."""
        if self.app is None:
            return True
        handler = self.handler_of(rec)
        if handler is None:
            return False
        try:
            payload = handler.decode(rec.value)
            key = check_key(handler.key.build(payload), self.key_max_bytes,
                            escaped=handler.key.escapes)
            digest = hash_payload(payload, handler.hash_fields)
        except (MessageError, ValueError, TypeError, ArithmeticError):
            return False
        stored = state.get("request_hash") if compare_hash else None
        return key == rec.idempotency_key and (not stored or stored == digest)

    def verdict(self, rec: DlqRecord, state: Mapping[str, Any] | None = None) -> str:
        """``"ok"`` or why ``rec`` is outside (``dlq list`` and ``dlq show``): the checks
        of :meth:`outside`, and with an app whether a keyed record's value builds its
        key and the request hash of its key's record (``state``, when it has one)."""
        why = self.outside(rec)
        if why is not None:
            return why
        state = state or {}
        # The request hash matters where a replay would re-run or resend the key: not for
        # a payload conflict (its hash differs from the record's: that is what it says;
        # a replay skips it) nor for a key that succeeded (skipped too).
        compare = rec.kind != "payload_conflict" and state.get("status") != "succeeded"
        if rec.idempotency_key is not None and self.app is not None and not self.key_holds(
                rec, state, compare_hash=compare):
            return "key_mismatch"
        return "ok"

    def states(self, conn: Any, store: Any, records: list[DlqRecord],
               ) -> dict[str, Mapping[str, Any]]:
        """The records of the keys ``records`` name in the boundary's namespace, by key
        (what :meth:`verdict` compares a value's request hash with)."""
        keys = sorted({r.idempotency_key for r in records if r.idempotency_key is not None
                       and "\x00" not in r.idempotency_key})
        if self.namespace is None or not keys:
            return {}
        rows = store.redrive_states(conn, [(self.namespace, k) for k in keys])
        conn.rollback()
        return {row["idempotency_key"]: row for row in rows}
