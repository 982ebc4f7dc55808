"""Every ``idem.*`` header kafka_idem writes, in one table: its name, what it means and
when it is present. The writers take the names from here (dead letters:
:mod:`~kafka_idem.deadletters.dead_letter` and :mod:`~kafka_idem.deadletters.signing`;
replayed copies: :mod:`kafka_idem.replay.republishing`; outbox events:
:mod:`kafka_idem.outbox.relay`), and the reference's header page is generated from it,
so the two cannot drift apart.

    >>> ORIGINAL_TOPIC.name
    'idem.original.topic'
    >>> [h.name for h in DEAD_LETTER if h.present != ALWAYS][:2]
    ['idem.namespace', 'idem.key']
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "idem."  # every header kafka_idem sets starts with it
ALWAYS = "always"


@dataclass(frozen=True, slots=True)
class Header:
    """One header: ``name``, what its value means, and when it is present."""

    name: str
    meaning: str
    present: str = ALWAYS


# --- on dead letters, in the order they are written -------------------------------------

ORIGINAL_TOPIC = Header("idem.original.topic", "The topic the failed message was read from.")
ORIGINAL_PARTITION = Header("idem.original.partition", "Its partition.")
ORIGINAL_OFFSET = Header("idem.original.offset", "Its offset.")
ORIGINAL_TIMESTAMP = Header(
    "idem.original.timestamp",
    "Its Kafka timestamp (milliseconds since the epoch), -1 when it had none.")
ERROR_KIND = Header(
    "idem.error.kind",
    "Why it was dead-lettered: permanent, exhausted, payload_conflict or undecodable.")
ERROR_CLASS = Header("idem.error.class",
                     "The exception's class name (at most 200 bytes).")
ERROR_MESSAGE = Header(
    "idem.error.message",
    "The exception's text, at most error_message_max bytes, no stack trace; an exhausted "
    "key's begins with why (e.g. 3 attempts reached the limit of 3; last error: ...).")
ATTEMPTS = Header("idem.attempts", "Attempts made (0 for a message that never reached "
                  "its handler).")
FIRST_FAILURE_AT = Header("idem.first_failure_at",
                          "When the key first failed (ISO 8601, UTC).")
LAST_FAILURE_AT = Header("idem.last_failure_at", "When it last failed (ISO 8601, UTC).")
CONSUMER_GROUP = Header("idem.consumer_group", "The consumer group that dead-lettered it.")
HANDLER = Header("idem.handler", "The handler's name.")
NAMESPACE = Header(
    "idem.namespace", "The app's namespace, the scope of its idempotency keys.",
    "Whenever a member writes it (dead letters from before namespaces lack it).")
KEY = Header("idem.key", "The idempotency key, never cut.",
             "When a key could be built (absent for undecodable input or a bad key).")
TRUNCATED = Header(
    "idem.truncated",
    "What was left out of a record too large for Kafka: value, and key (over 1 KiB) or "
    "headers (the original ones), comma-separated.",
    "Only on a record too large for Kafka.")
VALUE_BYTES = Header("idem.original.value_bytes", "The size of the left-out value, in bytes.",
                     "With idem.truncated.")
VALUE_SHA256 = Header("idem.original.value_sha256",
                      "The SHA-256 of the left-out value (hex).", "With idem.truncated.")
SIGNATURE = Header(
    "idem.signature",
    "v1: and the HMAC-SHA256, by the first signing key, of the record's idem.* headers "
    "and the digests of its key and value; dlq replay acts only on records whose "
    "signature holds.",
    "With dlq_signing_keys (KAFKA_IDEM_DLQ_SIGNING_KEYS); always the last header.")

DEAD_LETTER: tuple[Header, ...] = (
    ORIGINAL_TOPIC, ORIGINAL_PARTITION, ORIGINAL_OFFSET, ORIGINAL_TIMESTAMP, ERROR_KIND,
    ERROR_CLASS, ERROR_MESSAGE, ATTEMPTS, FIRST_FAILURE_AT, LAST_FAILURE_AT,
    CONSUMER_GROUP, HANDLER, NAMESPACE, KEY, TRUNCATED, VALUE_BYTES, VALUE_SHA256,
    SIGNATURE,
)

# --- on a dead letter's value sent again (dlq replay, rerun) -----------------------------
# They replace the dead letter's own idem.* headers; a copy that fails again keeps them.

REPLAY_AT = Header("idem.replay.at", "When it was sent again (ISO 8601, UTC).")
REPLAY_BY = Header("idem.replay.by",
                   "Who sent it again (KAFKA_IDEM_ACTOR, else the OS user).")
REPLAY_SOURCE_TOPIC = Header("idem.replay.source_topic", "The dead-letter topic it came from.")
REPLAY_SOURCE_PARTITION = Header("idem.replay.source_partition",
                                 "The dead letter's partition.")
REPLAY_SOURCE_OFFSET = Header("idem.replay.source_offset", "The dead letter's offset.")
REPLAY_GROUP = Header(
    "idem.replay.group",
    "The consumer group of the dlq replay run that sent it: that run never sends the "
    "copy's own dead letter again.",
    "When sent by dlq replay.")

REPLAYED: tuple[Header, ...] = (
    REPLAY_AT, REPLAY_BY, REPLAY_SOURCE_TOPIC, REPLAY_SOURCE_PARTITION, REPLAY_SOURCE_OFFSET,
    REPLAY_GROUP,
)

# --- on outbox events (ctx.emit), after the emitter's own headers ------------------------

EVENT_KEY = Header("idem.key",
                   "The idempotency key of the message whose handler emitted the event.")
EVENT_NAMESPACE = Header("idem.namespace", "The emitting app's namespace.")
EVENT_ID = Header("idem.outbox.id",
                  "The event's outbox row id, unique per event of one store.")
EVENT_SOURCE_TOPIC = Header(
    "idem.source.topic", "The topic of the message whose handler emitted it.",
    "When the outbox row recorded its source (every event ctx.emit writes).")
EVENT_SOURCE_PARTITION = Header("idem.source.partition", "That message's partition.",
                                "With idem.source.topic.")
EVENT_SOURCE_OFFSET = Header("idem.source.offset", "That message's offset.",
                             "With idem.source.topic.")

OUTBOX_EVENT: tuple[Header, ...] = (
    EVENT_KEY, EVENT_NAMESPACE, EVENT_ID, EVENT_SOURCE_TOPIC, EVENT_SOURCE_PARTITION,
    EVENT_SOURCE_OFFSET,
)
