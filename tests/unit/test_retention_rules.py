"""The background retention's pure parts: the ``retention`` setting reads a duration,
and a window is refused by the same rule as ``kafka-idem purge`` (``purge_risk``), in
one line naming the setting; a topic whose retention could not be read does not refuse
the start, but stops the runs (``unchecked``)."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import ValidationError

from kafka_idem.admin import retention
from kafka_idem.admin.purge import TopicRetention
from kafka_idem.settings import Settings

DAY_MS = 86_400_000


def test_the_setting_is_a_duration_off_by_default() -> None:
    s = Settings()
    assert s.retention is None and s.retention_force is False
    assert s.retention_interval_seconds == 300.0
    assert Settings(retention=" 30d").retention == "30d"
    for bad in ("30 days", "-1d", "0", "soon"):
        with pytest.raises(ValidationError, match="retention"):
            Settings(retention=bad)


def test_the_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_IDEM_RETENTION", "12h")
    monkeypatch.setenv("KAFKA_IDEM_RETENTION_FORCE", "true")
    s = Settings()
    assert (s.retention, s.retention_force) == ("12h", True)


def test_a_window_at_least_the_longest_topic_retention_passes() -> None:
    topics = [TopicRetention("a", DAY_MS), TopicRetention("b", 7 * DAY_MS)]
    assert retention.refusal("7d", topics) is None
    assert retention.refusal("30d", topics) is None


def test_a_shorter_window_is_refused_in_one_line_naming_the_setting() -> None:
    line = retention.refusal("3d", [TopicRetention("a", DAY_MS),
                                    TopicRetention("orders", 7 * DAY_MS)])
    assert line is not None and "\n" not in line
    assert line.startswith("retention=3d (KAFKA_IDEM_RETENTION): topic orders keeps "
                           "messages for 7d (retention.ms=604800000)")
    assert "set retention to 7d or longer" in line
    assert "retention_force=true (KAFKA_IDEM_RETENTION_FORCE)" in line


def test_a_topic_kept_forever_refuses_every_window() -> None:
    line = retention.refusal("3650d", [TopicRetention("ledger", -1)])
    assert line is not None and "keeps messages forever" in line
    assert "set retention to" not in line  # no window is long enough: only the force


def test_an_unread_retention_does_not_refuse_but_stops_the_runs() -> None:
    unread = [TopicRetention("a", None, "Kafka at x is unreachable"),
              TopicRetention("b", DAY_MS)]
    assert retention.refusal("2d", unread) is None  # the start goes on
    assert retention.unchecked(unread) == ("the retention of topic a could not be read "
                                           "(Kafka at x is unreachable)")
    assert retention.unchecked([TopicRetention("b", DAY_MS)]) is None
    # what was read still refuses
    assert retention.refusal("1h", unread) is not None


def test_the_pace_rests_a_multiple_of_a_batch_counts_it_and_ends_on_a_stop() -> None:
    stopping = threading.Event()
    counted: list[int] = []
    between = retention.pace(stopping, counted.append)
    started = time.monotonic()
    assert between(1000, 0.02) is True
    assert time.monotonic() - started >= 0.02 * retention.PACE
    assert counted == [1000]
    stopping.set()
    started = time.monotonic()
    assert between(1000, 10.0) is False  # at once
    assert time.monotonic() - started < 1.0
