"""``max_rate`` (:mod:`kafka_idem.consume.rate_limit`): the token bucket on an injected
clock, what dispatch hands to units under it in each mode (the units are stubs: no Kafka,
no PostgreSQL), how long the loop may wait, and the refusal of bad values."""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from kafka_idem import App
from kafka_idem.consume.concurrency.units import Units
from kafka_idem.consume.outcome import Finished, Result
from kafka_idem.consume.partitions import Partitions
from kafka_idem.consume.rate_limit import Bucket, RateLimits
from kafka_idem.errors import ConfigError
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing import FakeMessage

# --- the bucket ------------------------------------------------------------------------


def test_a_bucket_starts_full_with_a_second_s_worth_and_refills_at_its_rate() -> None:
    b = Bucket(50)
    assert b.take(80, 0.0) == 50  # the burst: one second's worth, at once
    assert b.take(1, 0.0) == 0
    assert b.ready_at() == pytest.approx(0.02)  # the next token in 1/50 s
    assert b.take(10, 0.1) == 5  # 0.1 s at 50/s
    assert b.take(100, 10.0) == 50  # never more than the burst, however long it idled


def test_a_slow_rate_holds_one_token_and_keeps_the_fraction_it_earned() -> None:
    b = Bucket(0.5)
    assert b.burst == 1.0
    assert b.take(3, 0.0) == 1
    assert b.take(1, 1.0) == 0  # half a token
    assert b.ready_at() == pytest.approx(2.0)
    assert b.take(1, 2.0) == 1


def test_tokens_given_back_are_there_for_the_next_take_up_to_the_burst() -> None:
    b = Bucket(10)
    assert b.take(10, 0.0) == 10
    b.give_back(4)
    assert b.take(10, 0.0) == 4
    b.give_back(100)
    assert b.tokens == 10


def test_limits_count_the_seconds_a_topic_was_held_back_and_when_to_wake() -> None:
    waited: list[tuple[str, float]] = []
    limits = RateLimits({"slow": 2.0}, lambda t, s: waited.append((t, s)))
    limits.round(0.0)
    assert limits.take("fast", 1000, 0.0) == 1000  # no limit
    assert limits.take("slow", 5, 0.0) == 2
    assert limits.wake_at() == pytest.approx(0.5)
    limits.round(0.5)  # held from 0 to 0.5
    assert limits.take("slow", 3, 0.5) == 1
    limits.round(0.75)
    assert limits.take("slow", 2, 0.75) == 0
    limits.round(1.0)
    assert limits.take("slow", 2, 1.0) == 1
    limits.round(1.5)
    assert limits.take("slow", 1, 1.5) == 1  # all it wanted: not held
    limits.round(2.0)
    assert waited == [("slow", 0.5), ("slow", 0.25), ("slow", 0.25), ("slow", 0.5)]
    assert limits.wake_at() is None


# --- dispatch under a limit -------------------------------------------------------------


def app(mode: str = "local", *, max_rate: float | None = 10, **settings: Any) -> App:
    a = App("rates", database_url="postgresql://u@127.0.0.1:1/none", batch_size=100,
            **settings)
    kw: dict[str, Any] = {"concurrency": 4} if mode == "keyed" else {}
    a.handler(topic="slow", key="{id}", hash_fields=("id",), max_rate=max_rate,
              mode="local" if mode == "local" else "leased", **kw)(lambda msg, ctx: None)
    a.handler(topic="fast", key="{id}", hash_fields=("id",),
              mode="local" if mode == "local" else "leased")(lambda msg, ctx: None)
    return a


def units_of(a: App) -> tuple[Units, Partitions, list[list[tuple[str, int]]]]:
    """Units whose local and leased runs are stubs that finish every message they get and
    record (topic, offset) of each, one list per unit."""
    parts = Partitions()
    units = Units(a, parts, store=Store(schema="kafka_idem", table="t"), metrics=Metrics(),
                  leases=None, stopping=threading.Event())
    parts._make = units.keyed.make_state  # as the runner's Partitions(make=...)
    ran: list[list[tuple[str, int]]] = []

    def local(todo: list[tuple[Any, list[Any]]], ahead: Any = None) -> dict[Any, list[Result]]:
        ran.append([(m.topic(), m.offset()) for _, msgs in todo for m in msgs])
        return {tp: [Finished("succeeded") for _ in msgs] for tp, msgs in todo}

    def leased(tp: Any, msgs: list[Any], tokens: Any, cancel: Any) -> dict[Any, list[Result]]:
        return local([(tp, msgs)])

    units._run_local_batch = local  # type: ignore[method-assign,assignment]
    units._run_leased_partition = leased  # type: ignore[method-assign]
    return units, parts, ran


def fill(parts: Partitions, topic: str, n: int, now: float = 0.0) -> None:
    for o in range(n):
        parts.add(FakeMessage(topic, offset=o, value=f'{{"id": "{o}"}}'), now)


def settle(units: Units, parts: Partitions, now: float) -> None:
    """One round's dispatch and harvest, as the loop runs them."""
    units.dispatch(now)
    harvested = units.harvest(wait_all=True)
    if harvested is not None:
        parts.apply(harvested[0], now)


@pytest.mark.parametrize("local_workers", [0, 2])
def test_local_units_take_only_the_messages_the_limit_lets_go(local_workers: int) -> None:
    units, parts, ran = units_of(app(local_workers=local_workers))
    fill(parts, "slow", 30)
    fill(parts, "fast", 30)
    settle(units, parts, 0.0)
    assert sum(1 for u in ran for t, _ in u if t == "slow") == 10  # the burst
    assert sum(1 for u in ran for t, _ in u if t == "fast") == 30  # not slowed
    ran.clear()
    settle(units, parts, 0.05)  # half a token: nothing
    assert ran == []
    assert parts.wait_time(0.05, 5.0) == pytest.approx(0.05)  # until the next token
    settle(units, parts, 0.5)
    assert [o for u in ran for _, o in u] == [10, 11, 12, 13, 14]  # in order, 5 tokens


def test_a_member_under_its_limit_waits_for_nothing() -> None:
    """5 messages every half second at max_rate=10/s (bursts of 5): each burst goes in the
    round it arrives, and the loop has no token to wait for."""
    units, parts, ran = units_of(app(max_rate=10))
    for burst in range(6):
        now = burst * 0.5
        for o in range(5 * burst, 5 * burst + 5):
            parts.add(FakeMessage("slow", offset=o, value=f'{{"id": "{o}"}}'), now)
        settle(units, parts, now)
        assert [o for _, o in ran[-1]] == list(range(5 * burst, 5 * burst + 5))
        assert parts.wait_time(now, 5.0) == 5.0


def test_a_leased_partition_takes_only_its_tokens() -> None:
    units, parts, ran = units_of(app("leased", max_rate=3))
    fill(parts, "slow", 10)
    settle(units, parts, 0.0)
    assert ran == [[("slow", 0), ("slow", 1), ("slow", 2)]]
    ran.clear()
    settle(units, parts, 1.0)
    assert ran == [[("slow", 3), ("slow", 4), ("slow", 5)]]


def test_key_ordered_messages_start_one_token_each() -> None:
    units, parts, _ = units_of(app("keyed", max_rate=2))
    fill(parts, "slow", 6)
    started: list[int] = []
    units.keyed._start = (  # type: ignore[method-assign]
        lambda tp, st, entry, shared: started.append(entry.msg.offset()))
    units.keyed.dispatch(0.0)
    assert started == [0, 1]  # the burst of 2, though concurrency=4 would start 4
    units.keyed.dispatch(0.2)
    assert started == [0, 1]
    units.keyed.dispatch(0.5)
    assert started == [0, 1, 2]


def test_without_a_limit_there_are_no_buckets_at_all() -> None:
    units, parts, _ = units_of(app(max_rate=None))
    assert units.limits is None and parts.limits is None


def test_the_metrics_show_the_rate_and_the_time_waited() -> None:
    units, parts, _ = units_of(app(max_rate=5))
    fill(parts, "slow", 20)
    settle(units, parts, 0.0)
    settle(units, parts, 0.1)
    settle(units, parts, 0.3)
    reg = units.metrics.registry
    labels = {"topic": "slow", "handler": "<lambda>"}
    assert reg.get_sample_value("kafka_idem_handler_max_rate", labels) == 5
    # Held back from the first round on: it waited until the last round looked.
    assert reg.get_sample_value(
        "kafka_idem_handler_throttled_seconds_total", labels) == pytest.approx(0.3)


# --- bad values --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, -0.5, float("nan"), float("inf"), True, "50"])
def test_a_rate_that_is_not_a_positive_number_is_refused_naming_max_rate(bad: Any) -> None:
    a = App("rates", database_url="postgresql://u@127.0.0.1:1/none")
    with pytest.raises(ConfigError) as caught:
        a.handler(topic="slow", key="{id}", hash_fields=("id",), max_rate=bad)
    assert "(setting=max_rate)" in str(caught.value)
    assert "max_rate must be a positive number" in str(caught.value)


def test_a_fractional_rate_is_accepted() -> None:
    a = App("rates", database_url="postgresql://u@127.0.0.1:1/none")
    h: Any = a.handler(topic="slow", key="{id}", hash_fields=("id",), max_rate=0.5)(
        lambda msg, ctx: None)
    assert h.max_rate == 0.5


def test_kafka_idem_run_refuses_a_zero_rate_at_start_with_exit_2_naming_max_rate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kafka_idem.cli import main

    name = f"user_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from kafka_idem import App\n\napp = App('shop')\n\n\n"
        "@app.handler(topic='t', key='{id}', hash_fields=('id',), max_rate=0)\n"
        "def handle(msg, ctx):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SystemExit) as exited:
            main(["run", f"{name}:app"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "max_rate must be a positive number of messages a second, not 0" in err
    assert "setting=max_rate" in err
