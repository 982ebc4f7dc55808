"""Tests in parallel (``./dev test`` runs pytest-xdist workers): the services are shared,
so a test that takes one of them away from everyone (the broker restarted) runs alone.

Every test holds a shared lock for its duration; a test marked
``@pytest.mark.exclusive("reason")`` holds it exclusively, so it starts once the tests
running on the other workers have ended, and none starts until it has. A turnstile in
front of the lock keeps a stream of shared holders from starving an exclusive one.
Outside xdist (one process) nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _lock_dir() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in every worker of one run
    if not run:
        return None
    path = Path(tempfile.gettempdir()) / f"kafka_idem-tests-{run}"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def hold(exclusive: bool) -> Iterator[None]:
    """Hold the run's services lock, shared or exclusive, for the block."""
    where = _lock_dir()
    if where is None:
        yield
        return
    turnstile, services = where / "turnstile", where / "services"
    if exclusive:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(services, fcntl.LOCK_EX):
            yield
        return
    with _flock(turnstile, fcntl.LOCK_SH):
        shared = _flock(services, fcntl.LOCK_SH)
        shared.__enter__()
    try:
        yield
    finally:
        shared.__exit__(None, None, None)


@contextlib.contextmanager
def one_at_a_time(name: str) -> Iterator[None]:
    """A lock across the run's workers (and across runs when not under xdist: a
    start script that must not run twice at once)."""
    where = _lock_dir() or Path(tempfile.gettempdir())
    with _flock(where / f"kafka_idem-{name}.lock", fcntl.LOCK_EX):
        yield


@pytest.fixture(autouse=True)
def _services_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("exclusive")
    if marker is not None and not marker.args:
        pytest.fail(f"{request.node.name}: exclusive needs the reason it must run alone")
    with hold(marker is not None):
        yield
