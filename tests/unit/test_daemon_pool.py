"""The key-ordered path's thread pool: a call never waits behind a running one while
the pool has room (a sync handler's slow message must not hold up other keys)."""

from __future__ import annotations

import threading

import pytest

from kafka_idem.consume.concurrency.daemon_pool import DaemonPool


@pytest.mark.parametrize("n", [2, 4, 16])
def test_calls_submitted_back_to_back_all_run_at_once(n: int) -> None:
    """Each call waits for all the others to be running: with a call queued behind a
    busy thread, the barrier breaks (the pool once started a thread only when none was
    idle, counting one just started and not yet there as idle)."""
    pool = DaemonPool(n, "test-pool")
    barrier = threading.Barrier(n, timeout=10)
    futures = [pool.submit(barrier.wait) for _ in range(n)]
    assert sorted(f.result(timeout=15) for f in futures) == list(range(n))
    pool.stop()


def test_a_free_thread_is_reused_and_the_pool_never_grows_past_its_size() -> None:
    pool = DaemonPool(2, "test-pool")
    assert pool.submit(lambda: 1).result(timeout=5) == 1
    assert pool.submit(lambda: 2).result(timeout=5) == 2
    release = threading.Event()
    blocked = [pool.submit(release.wait) for _ in range(3)]  # the third waits for room
    assert not blocked[2].done()
    release.set()
    assert all(f.result(timeout=5) for f in blocked)
    assert len(pool._threads) <= 2
    pool.stop()
