"""The member's progress line: the first outcomes at once, then at most one line per
interval, nothing while idle, the rest when the member stops."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from kafka_idem.consume.progress import Progress

T, U = "inventory.reserve", "inventory.cancel"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "progress"]


@pytest.fixture
def progress(caplog: pytest.LogCaptureFixture) -> Progress:
    caplog.set_level(logging.INFO, logger="kafka_idem.consume")
    return Progress(10.0)


def test_the_first_message_finished_is_said_at_once(
    progress: Progress, caplog: pytest.LogCaptureFixture,
) -> None:
    progress.tick(100.0)
    assert lines(caplog) == []  # idle: nothing to say
    progress.add(Counter({(T, "succeeded"): 1}))
    progress.tick(100.5)
    assert lines(caplog) == [f"processed 1 message(s): {T}: succeeded 1"]


def test_a_flood_is_one_line_per_interval_with_every_outcome_per_topic(
    progress: Progress, caplog: pytest.LogCaptureFixture,
) -> None:
    progress.add(Counter({(T, "succeeded"): 1}))
    progress.tick(0.0)
    for i in range(1, 100):  # ten rounds a second for ten seconds
        now = i / 10
        progress.add(Counter({(T, "succeeded"): 5, (T, "replayed"): 1, (U, "busy"): 3,
                              (U, "dead_lettered"): 1}))
        progress.tick(now)
    assert len(lines(caplog)) == 1
    progress.add(Counter({(T, "retried"): 2}))
    progress.tick(10.0)
    assert lines(caplog)[1] == (
        f"processed 693 message(s) in the last 10.0 s: {U}: dead_lettered 99; "
        f"{T}: replayed 99, succeeded 495; 2 retries scheduled ({T}: 2)")  # busy is not
    # progress; a retry is not a message processed (it comes again): counted apart
    progress.tick(25.0)
    assert len(lines(caplog)) == 2  # idle again: silent


def test_what_is_left_is_said_when_the_member_stops(
    progress: Progress, caplog: pytest.LogCaptureFixture,
) -> None:
    progress.add(Counter({(T, "succeeded"): 1}))
    progress.tick(0.0)
    progress.add(Counter({(T, "replayed"): 1}))
    progress.tick(3.0)
    progress.tick(3.0, final=True)
    assert lines(caplog)[-1] == f"processed 1 message(s) in the last 3.0 s: {T}: replayed 1"


def test_retries_alone_are_not_messages_processed(
    progress: Progress, caplog: pytest.LogCaptureFixture,
) -> None:
    progress.add(Counter({(T, "retried"): 1}))
    progress.tick(0.0)
    assert lines(caplog) == [f"no message finished: 1 retry scheduled ({T}: 1)"]


def test_an_interval_of_zero_switches_the_line_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem.consume")
    off = Progress(0.0)
    off.add(Counter({(T, "succeeded"): 3}))
    off.tick(100.0, final=True)
    assert lines(caplog) == []
