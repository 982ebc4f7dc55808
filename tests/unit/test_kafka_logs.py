"""librdkafka's lines through Python logging: each distinct line once per window, with a
count of what was held back; transient self-retried notices below WARNING."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from kafka_idem.observe.kafka_logs import KAFKA_LOG, KafkaLog
from kafka_idem.settings import Settings

REFUSED = ("[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 "
           "failed: Connection refused (after {ms}ms in state CONNECT)")
GETPID = ("[thrd:main]: Failed to acquire transactional PID from broker TxnCoordinator/1: "
          "Broker: Coordinator load in progress: retrying")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def kafka_log(clock: Clock, caplog: pytest.LogCaptureFixture) -> KafkaLog:
    caplog.set_level(logging.DEBUG, logger="kafka_idem.observe.kafka_logs")
    return KafkaLog(window=60, clock=clock)


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "kafka_idem.observe.kafka_logs"]


def test_a_repeated_line_is_written_once_per_window_with_the_count_held_back(
    kafka_log: KafkaLog, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    for i in range(160):  # 8 s of a broker that refuses, one attempt every 50 ms
        kafka_log.log(3, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", REFUSED.format(ms=i % 3))
        clock.now += 0.05
    assert len(lines(caplog)) == 1
    level, text = lines(caplog)[0]
    assert level == logging.WARNING
    assert text.startswith("Kafka: 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed")
    assert "[thrd:" not in text
    clock.now += 60
    kafka_log.log(3, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", REFUSED.format(ms=0))
    assert len(lines(caplog)) == 2
    assert "(and 159 more like it in the" in lines(caplog)[1][1]


def test_the_error_callback_and_the_log_line_of_one_failure_are_one_line(
    kafka_log: KafkaLog, caplog: pytest.LogCaptureFixture
) -> None:
    text = REFUSED.format(ms=0).split("]: ", 1)[1]
    kafka_log.log(3, "%s [%s] %s", "FAIL", "rdkafka#producer-2", REFUSED.format(ms=0))
    kafka_log.error(KafkaError(KafkaError._TRANSPORT, text))
    kafka_log.error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    got = lines(caplog)
    assert len(got) == 2, got
    assert "waiting for the broker and retrying" in got[1][1]
    assert {r.action for r in caplog.records} == {"kafka_log", "kafka_error"}  # type: ignore[attr-defined]


def test_distinct_lines_are_each_written(kafka_log: KafkaLog,
                                         caplog: pytest.LogCaptureFixture) -> None:
    kafka_log.log(4, "%s [%s] %s", "REQTMOUT", "rdkafka#consumer-1", "timed out: 1 request")
    kafka_log.log(4, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", "SASL authentication failed")
    assert len(lines(caplog)) == 2


def test_transient_self_retried_notices_are_info(kafka_log: KafkaLog,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    kafka_log.log(4, "%s [%s] %s", "GETPID", "rdkafka#producer-3", GETPID)
    ((level, text),) = lines(caplog)
    assert level == logging.INFO and "transactional PID" in text


def test_a_fatal_error_is_an_error(kafka_log: KafkaLog, caplog: pytest.LogCaptureFixture) -> None:
    kafka_log.error(KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True))
    assert lines(caplog)[0][0] == logging.ERROR


def test_a_level_switched_off_is_neither_written_nor_counted(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kafka_idem.observe.kafka_logs")
    kafka_log = KafkaLog(window=60, clock=clock)
    kafka_log.log(4, "%s [%s] %s", "GETPID", "rdkafka#producer-3", GETPID)
    assert lines(caplog) == []


def test_every_client_kafka_idem_builds_logs_through_python_logging() -> None:
    s = Settings(group_id="g", kafka={"linger.ms": 7})
    for conf in (s.consumer_config(), s.producer_config(), s.admin_config()):
        assert conf["logger"] is KAFKA_LOG


def test_debug_lines_asked_for_are_all_written(kafka_log: KafkaLog,
                                               caplog: pytest.LogCaptureFixture) -> None:
    for _ in range(3):
        kafka_log.log(7, "%s [%s] %s", "FETCH", "rdkafka#consumer-1", "Fetch topic t [0]")
    assert [lvl for lvl, _ in lines(caplog)] == [logging.DEBUG] * 3
