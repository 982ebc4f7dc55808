"""The bench's split of the consumer's CPU by kind of thread (bench/procstat.py)."""

from __future__ import annotations

import threading
import time

from bench import procstat


def test_threads_are_grouped_by_name_without_their_number() -> None:
    assert procstat._group("kafka-idem-key-12") == "kafka-idem-key"
    assert procstat._group("rdk:broker3") == "rdk:broker"
    assert procstat._group("MainThread") == "MainThread"


def test_a_busy_thread_shows_under_its_own_kind() -> None:
    before = procstat.threads()
    stop = time.monotonic() + 0.3

    def spin() -> None:
        while time.monotonic() < stop:
            pass

    spinner = threading.Thread(target=spin, name="spinner-1")
    spinner.start()
    time.sleep(0.15)
    during = procstat.threads()  # read while it runs: its name is known then
    spinner.join()
    split = procstat.thread_delta(before, during)
    assert split.get("spinner", 0.0) > 0.0
    assert all(v >= 0.0 for v in split.values())


def test_a_thread_seen_only_later_counts_whole_and_nothing_goes_negative() -> None:
    a = {1: ("MainThread", 5.0), 2: ("kafka-idem-key", 1.0)}
    b = {1: ("MainThread", 5.5), 2: ("kafka-idem-key", 1.25), 3: ("kafka-idem-key", 0.5)}
    assert procstat.thread_delta(a, b) == {"kafka-idem-key": 0.75, "MainThread": 0.5}
