"""``purge``'s window against the source topics' retention
(:func:`kafka_idem.admin.purge.purge_risk`)."""

from __future__ import annotations

import pytest

from kafka_idem.admin.operations import parse_duration
from kafka_idem.admin.purge import (
    RETENTION_FLOOR_SECONDS,
    TopicRetention,
    format_duration,
    purge_risk,
)

DAY_MS = 86_400_000


def test_a_window_at_least_the_longest_retention_is_not_too_short() -> None:
    topics = [TopicRetention("a", DAY_MS), TopicRetention("b", 7 * DAY_MS)]
    assert purge_risk(7 * 86400, topics) is None
    risk = purge_risk(7 * 86400 - 1, topics)
    assert risk is not None and risk.retention == topics[1] and risk.needed == 7 * 86400
    assert "--older-than 7d or longer" in risk.refusal("6d")


def test_a_topic_kept_forever_makes_every_window_too_short() -> None:
    topics = [TopicRetention("a", DAY_MS), TopicRetention("f", -1)]
    risk = purge_risk(10 * 365 * 86400, topics)
    assert risk is not None and risk.retention == topics[1] and risk.needed is None
    assert "forever" in risk.refusal("3650d") and "--older-than" not in risk.way_forward()


def test_an_unread_retention_or_no_topic_applies_the_one_hour_floor() -> None:
    unread = [TopicRetention("a", 60_000), TopicRetention("u", None, "no answer")]
    assert purge_risk(RETENTION_FLOOR_SECONDS, unread) is None
    risk = purge_risk(RETENTION_FLOOR_SECONDS - 1, unread)
    assert risk is not None and risk.retention == unread[1] and risk.needed == 3600
    assert "could not be read (no answer)" in risk.refusal("59m")
    none = purge_risk(0, [])
    assert none is not None and none.retention is None
    assert "no record names its source topic" in none.refusal("0s")
    assert purge_risk(RETENTION_FLOOR_SECONDS, []) is None
    # read and shorter than the floor: the retention read is the yardstick
    assert purge_risk(120, [TopicRetention("a", 60_000)]) is None


@pytest.mark.parametrize("seconds", [0.5, 59, 60, 5400, 3600, 86400, 129600, 604800])
def test_a_suggested_window_reads_back_at_least_as_long(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) >= seconds
    assert format_duration(86400) == "1d" and format_duration(5400) == "90m"
