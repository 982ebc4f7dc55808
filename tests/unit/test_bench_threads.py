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
    # The kernel counts CPU in clock ticks, and a loaded machine may not run
    # the spinner for a whole tick in any fixed window: it spins until a read
    # taken while it runs shows its time (or a generous deadline passes).
    before = procstat.threads()
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spinner-1")
    spinner.start()
    deadline = time.monotonic() + 30.0
    try:
        while True:
            time.sleep(0.05)
            during = procstat.threads()  # read while it runs: its name is known then
            split = procstat.thread_delta(before, during)
            if split.get("spinner", 0.0) > 0.0 or time.monotonic() > deadline:
                break
    finally:
        done.set()
        spinner.join()
    assert split.get("spinner", 0.0) > 0.0
    assert all(v >= 0.0 for v in split.values())


def test_a_thread_seen_only_later_counts_whole_and_nothing_goes_negative() -> None:
    a = {1: ("MainThread", 5.0), 2: ("kafka-idem-key", 1.0)}
    b = {1: ("MainThread", 5.5), 2: ("kafka-idem-key", 1.25), 3: ("kafka-idem-key", 0.5)}
    assert procstat.thread_delta(a, b) == {"kafka-idem-key": 0.75, "MainThread": 0.5}
