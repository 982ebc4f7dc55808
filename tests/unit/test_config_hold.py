"""A configuration error met while processing: the partition waits, the error is
counted every time and logged at ERROR with its text at most once a minute per handler."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import pytest

from kafka_idem.consume.config_hold import ConfigHold
from kafka_idem.consume.outcome import Deferred, Reason
from kafka_idem.errors import ConfigError
from kafka_idem.observe.metrics import Metrics


@dataclass(frozen=True)
class Msg:
    o: int

    def topic(self) -> str:
        return "inventory.reserve"

    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return self.o


@dataclass(frozen=True)
class H:
    name: str


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_error_is_counted_and_held_and_logged_at_error_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem.consume")
    metrics, clock = Metrics(), Clock()
    hold = ConfigHold(metrics, clock=clock)
    exc = ConfigError("no such key file /etc/inventory.pem", setting="inventory_key")
    results = []
    for second in range(0, 125, 5):  # every 5 s for two minutes
        clock.now = float(second)
        results.append(hold.hold(H("reserve"), Msg(7), exc))
    assert all(isinstance(r, Deferred) and r.reason is Reason.CONFIG for r in results)
    count = metrics.config_errors.labels("inventory.reserve", "reserve")._value.get()
    assert count == 25
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "handler 'reserve': configuration error at inventory.reserve[2]@7: no such key file "
        "/etc/inventory.pem (setting=inventory_key); the partition waits (the message is not "
        "charged) until the configuration is fixed and the member restarted",
    ] + [
        "handler 'reserve': configuration error at inventory.reserve[2]@7: no such key file "
        "/etc/inventory.pem (setting=inventory_key); the partition waits (the message is not "
        "charged) until the configuration is fixed and the member restarted (11 more since "
        "the last line)",
    ] * 2
    assert all(getattr(r, "action", None) == "config_error" for r in errors)


def test_two_handlers_are_rate_limited_apart_and_a_leased_claim_token_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem.consume")
    hold = ConfigHold(Metrics(), clock=Clock())
    token = uuid.uuid4()
    assert hold.hold(H("a"), Msg(1), ConfigError("x"), token=token).token == token
    hold.hold(H("a"), Msg(1), ConfigError("x"))
    hold.hold(H("b"), Msg(1), ConfigError("y"))
    assert [r.handler for r in caplog.records if r.levelno == logging.ERROR] == ["a", "b"]
