"""A member told to stop stops: ``kafka-idem run`` processes against the real broker
and database, stopped with SIGTERM in the situations long chaos runs found one
hanging for a minute (a member whose log ended with ``stopping``).

The bound is the documented one (docs/reference/cli-conventions.md, run):
``drain_seconds`` + 2 s after the signal, plus
:data:`EXIT_SLACK` for the interpreter's own exit on a loaded machine. A stop that
has not ended by then ends the process at once (a crash, which the protocol is built
for); a second signal ends it at once too. Every test then checks the effects: each
charge once, whoever finished it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from consumers.payments import encode_charge
from tests.conftest import (
    BOOTSTRAP,
    DB,
    Members,
    caught_up,
    member_env,
    produce,
    wait_for,
)
from tools.chaos.services import kafka_sh

DRAIN = 2.0
EXIT_SLACK = 3.0  # the interpreter's own exit after the stop, on two busy cores
APP = "tests.apps.variants:app"


def stop_within(proc: subprocess.Popen[bytes], bound: float, *signals: int) -> tuple[int, float]:
    """Send ``signals`` (0.3 s apart); the exit code and the seconds from the first."""
    start = time.monotonic()
    for i, signum in enumerate(signals):
        if i:
            time.sleep(0.3)
        proc.send_signal(signum)
    try:
        code = proc.wait(timeout=bound + EXIT_SLACK)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the member did not exit within {bound + EXIT_SLACK:.1f} s") \
            from None
    return code, time.monotonic() - start


def charges(topic: str, orders: list[str]) -> None:
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])


def test_a_stop_that_overruns_its_bound_ends_the_process_at_the_bound(
    db: DB, topic: str, group: str, members: Members, tmp_path: Path
) -> None:
    """Local mode runs a batch in the loop thread: a handler blocked there keeps the
    loop from ever seeing the stop. The member ends anyway, at the bound, saying why
    and where its threads were; nothing of the blocked batch was committed, and the
    next member applies every charge once."""
    block = tmp_path / "block"
    block.write_text("")
    orders = ["a", "b", "c"]
    charges(topic, orders)
    env = member_env(db, topic, KAFKA_IDEM_DRAIN_SECONDS=str(DRAIN))
    hung = members.start(APP, {**env, "BLOCK_FILE": str(block), "BLOCK_ORDERS": "b"},
                         group=group)
    wait_for(Path(f"{block}.waiting").exists, timeout=60, what="the handler blocked mid-batch")
    code, took = stop_within(hung, DRAIN + 2, signal.SIGTERM)
    assert code == 0, members.logs()
    assert took >= DRAIN + 1, "it ended before its bound: the watch fired too early?"
    logs = members.logs()
    assert "the stop did not end within 4.0 s: ending at once" in logs, logs
    assert "Thread " in logs or "Current thread" in logs  # the stacks, for the operator
    block.unlink()
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the next member")
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}


def test_a_second_signal_ends_the_member_at_once(
    db: DB, topic: str, group: str, members: Members, tmp_path: Path
) -> None:
    block = tmp_path / "block"
    block.write_text("")
    charges(topic, ["a"])
    env = member_env(db, topic, KAFKA_IDEM_DRAIN_SECONDS="60")  # a bound far away
    hung = members.start(APP, {**env, "BLOCK_FILE": str(block), "BLOCK_ORDERS": "*"},
                         group=group)
    wait_for(Path(f"{block}.waiting").exists, timeout=60, what="the handler blocked")
    code, _ = stop_within(hung, 0.3, signal.SIGTERM, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, members.logs()
    assert "second SIGTERM: stopping at once" in members.logs()
    block.unlink()
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the next member")
    assert db.ledger_counts() == {"t1:charge:a": 1}


def test_a_member_stops_within_the_bound_right_after_a_freeze(
    db: DB, topic: str, group: str, members: Members
) -> None:
    """SIGSTOP past the session timeout (the group moves on without it), SIGCONT and
    at once SIGTERM: the thawed member finds its partitions gone and stops in time."""
    orders = [f"o{i}" for i in range(20)]
    charges(topic, orders)
    env = member_env(db, topic, KAFKA_IDEM_DRAIN_SECONDS=str(DRAIN))
    member = members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    member.send_signal(signal.SIGSTOP)
    time.sleep(7.0)  # the fault: frozen past session.timeout.ms (6 s in member_env)
    member.send_signal(signal.SIGCONT)
    code, _ = stop_within(member, DRAIN + 2, signal.SIGTERM)
    assert code == 0, members.logs()
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}


def broker_down() -> bool:
    host, port = BOOTSTRAP.split(",")[0].rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, int(port))) != 0


@pytest.mark.exclusive("it restarts the shared broker")
def test_a_member_stops_within_the_bound_during_a_broker_restart(
    db: DB, topic: str, group: str, members: Members
) -> None:
    """The local broker restarts (scripts/kafka.sh restart) while a busy member runs;
    SIGTERM comes while the broker is down: the member stops in time anyway, and once
    the broker is back another member finishes every charge once."""
    orders = [f"o{i}" for i in range(200)]
    charges(topic, orders)
    env = member_env(db, topic, KAFKA_IDEM_DRAIN_SECONDS=str(DRAIN))
    member = members.start(APP, {**env, "SLOW_ORDERS": "*", "SLOW_SECONDS": "0.02"},
                           group=group)
    wait_for(lambda: db.ledger_counts(), timeout=60, what="the member to start charging")
    result: list[subprocess.CompletedProcess[str]] = []
    restart = threading.Thread(target=lambda: result.append(kafka_sh("restart")), daemon=True)
    restart.start()
    try:
        wait_for(broker_down, timeout=60, interval=0.05, what="the broker to go down")
        code, _ = stop_within(member, DRAIN + 2, signal.SIGTERM)
        assert code == 0, members.logs()
    finally:
        restart.join(300)
    assert result and result[0].returncode == 0, result[0].stderr if result else "no result"
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=120, what="the next member")
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
