"""One key's audited re-run (``kafka-idem rerun KEY``, the console's re-run button).

The record is locked, moved ``failed -> retryable_failed`` with an audit row, and its
latest trusted dead letter republished to its source topic; the transaction commits
only once the broker acknowledged the message, so a refused message changes nothing.
A key *stranded* by a replay (:func:`~kafka_idem.admin.operations.stranded_by`) keeps
its state and gets its dead letter sent again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer

from kafka_idem.admin import operations as admin
from kafka_idem.errors import BrokerError, FrameworkError
from kafka_idem.replay.reading import latest_for_key
from kafka_idem.replay.records import DlqRecord, dlq_topic_for
from kafka_idem.replay.republishing import delivery_wait, republish_acknowledged
from kafka_idem.replay.trust import Boundary
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store

if TYPE_CHECKING:
    from kafka_idem.app import App


class NotRecorded(BrokerError):
    """The dead letter could not be republished: the re-run was rolled back."""


@dataclass(frozen=True, slots=True)
class KeyRerun:
    """What :func:`rerun_key` did."""

    key: str
    namespace: str
    actor: str
    dlq_topic: str
    letter: DlqRecord
    target: str
    audit_id: int
    stranded_by: dict[str, Any] | None  # the replay that left the key stranded, if one did


def rerun_key(settings: Settings, conn: Conn, store: Store, key: str, *, actor: str,
              reason: str, namespace: str | None = None, dlq_topic: str | None = None,
              trust_unsigned: bool = False, via: str = "rerun",
              app: App | None = None) -> KeyRerun:
    """Re-run ``key`` (in ``namespace``; without one, the only namespace that has it).

    Raises :class:`~kafka_idem.admin.operations.Refused` (no reason, no such key, not
    failed, no trusted dead letter, a dead letter without its value) before anything
    changes, and :class:`NotRecorded` when the broker did not take the message (the
    key is still ``failed``). ``via`` is kept in the audit row's selection. With
    ``app``, the key must be of its namespace, and its DLQ (unless ``dlq_topic``) is
    its handler's."""
    if not reason.strip():
        raise admin.Refused("a reason is required for a re-run: give --reason TEXT", key=key)
    if app is not None and namespace not in (None, app.namespace):
        raise admin.Refused(f"the key is of namespace {namespace!r}, another app's (app "
                            f"{app.name!r} has namespace {app.namespace!r}): re-run it "
                            "from that app", key=key)
    scoped = admin.resolve(conn, store, key, app.namespace if app is not None else namespace)
    rec = scoped.get(conn, key)
    stranded = (admin.stranded_by(conn, scoped, key)
                if rec is not None and rec["status"] == "retryable_failed" else None)
    conn.rollback()
    if rec is None:
        raise admin.Refused(f"no record with this key in namespace {scoped.ns!r}", key=key)
    topic = dlq_topic or dlq_topic_for(settings, rec["kafka_topic"], app)
    # Only a dead letter that says it came from the record's own topic, and whose
    # signature holds where keys are configured: its headers are anyone's who may
    # write to the DLQ.
    trusted = Boundary(topic, frozenset({rec["kafka_topic"]}), scoped.ns,
                       secrets=settings.signing_keys, trust_unsigned=trust_unsigned)
    wanted = rec["status"] == "failed" or stranded is not None
    letter = (latest_for_key(settings, topic, key, scoped.ns,
                             accept=lambda r: trusted.outside(r) is None)
              if wanted else None)
    if wanted and letter is None:
        raise admin.Refused(
            f"no dead-lettered message for this key in {topic} that came from "
            f"{rec['kafka_topic']}" + (" with a valid signature (--trust-unsigned "
                                       "admits unsigned ones)" if trusted.verifies else ""),
            key=key)
    if letter is not None and letter.truncated is not None:
        raise admin.Refused(
            f"its dead letter {topic}[{letter.partition}]@{letter.offset} was written without "
            f"its {letter.truncated} (too large for the DLQ); the original message is "
            f"{letter.original_topic}[{letter.original_partition}]@{letter.original_offset}",
            key=key)
    with conn.transaction():
        # The record stays locked until the message is acknowledged: a consumer that
        # receives it first waits for this commit; a refused message rolls it all back.
        done = admin.rerun(conn, scoped, key=key, actor=actor, reason=reason,
                           selection={"via": via})
        assert letter is not None
        conf = settings.producer_config()
        try:
            target = republish_acknowledged(Producer(conf), letter, actor=actor,
                                            timeout=delivery_wait(conf))
        except FrameworkError as exc:
            raise NotRecorded(f"re-run not recorded, {key} is still failed: {exc}") from exc
    return KeyRerun(key=key, namespace=scoped.ns, actor=actor, dlq_topic=topic, letter=letter,
                    target=target, audit_id=int(done["audit_id"]),
                    stranded_by=done.get("stranded_by"))
