"""What /livez and /readyz answer, from what the loop reported (no services)."""

from __future__ import annotations

from kafka_idem.observe.health import Health


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def health(clock: Clock) -> Health:
    return Health(liveness_seconds=10, max_lag=5, clock=clock)


def test_live_while_the_loop_makes_rounds_and_not_after_a_stall() -> None:
    clock = Clock()
    h = health(clock)
    assert h.live().ok  # starting counts as progress
    clock.now += 9
    h.round()
    clock.now += 9
    assert h.live().ok
    clock.now += 2
    probe = h.live()
    assert not probe.ok and "no progress for 11s" in probe.body["reason"]


def test_not_ready_before_the_first_assignment_and_a_spare_member_is_ready() -> None:
    h = health(Clock())
    assert h.ready().body["reason"].startswith("not joined")
    h.assigned([])
    assert h.ready().ok and h.ready().body["assigned"] == 0


def test_ready_when_every_assigned_partition_is_measured_and_within_the_bound() -> None:
    h = health(Clock())
    h.assigned([("t", 0), ("t", 1)])
    assert h.ready().body["reason"] == "2 of 2 partitions not measured yet"
    h.observed({("t", 0): 5, ("t", 1): None})
    assert h.ready().body["reason"] == "1 of 2 partitions not measured yet"
    h.observed({("t", 1): 6})
    probe = h.ready()
    assert not probe.ok and probe.body["reason"] == "1 of 2 partitions more than 5 messages behind"
    assert probe.body["max_lag"] == 6
    h.observed({("t", 1): 0})
    assert h.ready().ok


def test_a_revoked_partition_no_longer_counts() -> None:
    h = health(Clock())
    h.assigned([("t", 0), ("t", 1)])
    h.observed({("t", 0): 0, ("t", 1): 500})
    h.revoked([("t", 1)])
    assert h.ready().ok and h.assignment() == [("t", 0)]


def test_not_ready_while_stopping_or_not_live() -> None:
    clock = Clock()
    h = health(clock)
    h.assigned([])
    clock.now += 11
    assert not h.ready().ok and "no progress" in h.ready().body["reason"]
    h.round()
    h.stopping()
    assert h.ready().body["reason"] == "stopping"


def test_not_ready_while_the_outbox_relay_is_in_trouble_and_ready_again_after() -> None:
    h = health(Clock())
    h.assigned([])
    h.outbox("outbox shard 1: database: StoreUnavailable: connection lost")
    probe = h.ready()
    assert not probe.ok
    assert probe.body["reason"] == (
        "outbox relay: outbox shard 1: database: StoreUnavailable: connection lost")
    h.outbox(None)
    assert h.ready().ok
