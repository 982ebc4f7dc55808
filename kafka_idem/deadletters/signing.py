"""Signed dead letters: who wrote a DLQ record, checked before a replay acts on it.

A replay runs with an operator's rights and acts on what a dead letter's headers
say (which key to re-run, where to send the value). Anyone who may write to a
DLQ topic could otherwise make it act on another app's keys or topics. With
signing keys configured (``dlq_signing_keys``, ``KAFKA_IDEM_DLQ_SIGNING_KEYS``),
every dead letter carries ``idem.signature``:

    v1:<hex HMAC-SHA256>

keyed by the *first* key, over the record's canonical form (:func:`canonical`):
its ``idem.*`` headers in the order they were written (name and value, length
prefixed, the signature itself left out), then the SHA-256 of its Kafka key and
of its value (``None`` and empty are distinct). Every configured key verifies,
so keys can be rotated: put the new key first, keep the old one after it until
the DLQ's retention has passed.

What is not covered: headers other than ``idem.*`` (the original message's own,
which travel along on a replay unchanged; a DLQ mirrored by a tool that adds
headers keeps its signatures) and the DLQ topic's name (a mirrored DLQ has
another name). Where a record came from is covered by its ``idem.original.*``
headers, which a replay checks against its boundary.

    >>> keys = (b"0123456789abcdef0123",)
    >>> headers = [("idem.key", b"t1:charge:o1"), ("idem.namespace", b"payments")]
    >>> signed = headers + [(SIGNATURE, sign(keys[0], headers, b"o1", b"{}").encode())]
    >>> verify(keys, signed, b"o1", b"{}")
    'valid'
    >>> verify(keys, signed, b"o1", b'{"amount": 700}')
    'invalid'
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Literal

from kafka_idem.deadletters import headers

SIGNATURE = headers.SIGNATURE.name
VERSION = "v1"
PREFIX = headers.PREFIX
MIN_KEY_BYTES = 16

Verdict = Literal["valid", "invalid", "unsigned", "unverifiable"]
# What each verdict means, for ``dlq show`` and the docs.
MEANING: dict[str, str] = {
    "valid": "signed with a configured key; headers, key and value are as written",
    "invalid": "its idem.signature does not hold for any configured key: forged or altered",
    "unsigned": "no idem.signature (written before signing, or by another producer)",
    "unverifiable": "no signing key configured (dlq_signing_keys): it cannot be checked",
}

HeaderPairs = Sequence[tuple[str, str | bytes | None]]


def _blob(value: bytes | None) -> bytes:
    if value is None:
        return b"\x00"
    return b"\x01" + len(value).to_bytes(8, "big") + value


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode("utf-8") if isinstance(value, str) else value


def _digest(value: bytes | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + hashlib.sha256(value).digest()


def canonical(headers: HeaderPairs, key: bytes | None, value: bytes | None) -> bytes:
    """The bytes a signature covers (see the module doc)."""
    parts = [b"kafka_idem dead letter v1\n"]
    for name, raw in headers:
        if name.startswith(PREFIX) and name != SIGNATURE:
            parts.append(_blob(name.encode("utf-8", "surrogateescape")))
            parts.append(_blob(_bytes(raw)))
    parts.append(_digest(key))
    parts.append(_digest(value))
    return b"".join(parts)


def sign(secret: bytes, headers: HeaderPairs, key: bytes | None, value: bytes | None) -> str:
    """The ``idem.signature`` value of a record, keyed by ``secret``."""
    mac = hmac.new(secret, canonical(headers, key, value), hashlib.sha256).hexdigest()
    return f"{VERSION}:{mac}"


def verify(secrets: Sequence[bytes], headers: HeaderPairs, key: bytes | None,
           value: bytes | None) -> Verdict:
    """Whether a record's signature holds for one of ``secrets``.

    A record with more than one ``idem.signature`` header is ``invalid``: a writer
    adding a second one must not choose which one is read."""
    found = [raw for name, raw in headers if name == SIGNATURE]
    if not secrets:
        return "unverifiable"
    if not found:
        return "unsigned"
    if len(found) > 1:
        return "invalid"
    given = (_bytes(found[0]) or b"").decode("ascii", "replace")
    body = canonical(headers, key, value)
    for secret in secrets:
        mac = hmac.new(secret, body, hashlib.sha256).hexdigest()
        if hmac.compare_digest(given, f"{VERSION}:{mac}"):
            return "valid"
    return "invalid"


class Signer:
    """Signs records with the first key (what
    :class:`~kafka_idem.deadletters.dead_letter.DeadLetterer` holds when keys are configured)."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("a Signer needs at least one key")
        self.secret = secrets[0]

    def header(self, headers: HeaderPairs, key: bytes | None,
               value: bytes | None) -> tuple[str, bytes]:
        return SIGNATURE, sign(self.secret, headers, key, value).encode("ascii")
