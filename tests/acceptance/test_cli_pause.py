"""``kafka-idem pause`` / ``resume`` against three ``kafka-idem run`` members of one group
(the issue's done-when): within 5 s of the pause every member says it holds it and no
call of the handler takes effect after, while the other handler goes on; within 5 s of
the resume the paused handler's messages are called.

"No call" is counted in ``pausable.calls`` after every member acknowledged the pause
(its log line ``handler alpha paused on this member``, written once none of the
handler's work runs there), while the other handler's messages, produced after the
paused one's, all take effect: unpaused, the paused one's would have run first. A
member killed while the handler is paused changes nothing: the survivor, taking its
partitions over, keeps them paused.
"""

from __future__ import annotations

import json
import signal
import time

import psycopg

from tests.acceptance.conftest import kafka_idem
from tests.apps import pausable
from tests.conftest import DB, Members, Topics, member_env, produce, wait_for

APP = "tests.apps.pausable:app"
PAUSED = "handler alpha paused on this member"
RESUMED = "handler alpha resumed on this member"


def feed(topic: str, start: int, n: int) -> None:
    produce(topic, [(str(i).encode(), json.dumps({"id": str(i)}).encode())
                    for i in range(start, start + n)])


def calls(db: DB, handler: str) -> int:
    return int(db.value("SELECT count(*) FROM pausable.calls WHERE handler = %s", (handler,)))


def saying(members: Members, line: str) -> int:
    """How many members' logs have ``line``."""
    return sum(line in p.read_text(errors="replace")
               for p in members.tmp.glob("member-*.log"))


def test_pause_and_resume_on_three_members_through_the_cli(
        db: DB, topics: Topics, members: Members, group: str) -> None:
    a, b = topics(partitions=3), topics(partitions=3)
    with psycopg.connect(db.dsn) as conn:
        pausable.create_tables(conn)
    apps = {"PAUSABLE_A": a, "PAUSABLE_B": b}
    env = member_env(db, a, PYTHONUNBUFFERED="1", **apps)
    for _ in range(3):
        members.start(APP, env, group=group)
    feed(a, 0, 6)
    feed(b, 0, 6)
    wait_for(lambda: calls(db, "alpha") == 6 and calls(db, "beta") == 6, timeout=60,
             what="both handlers running")
    wait_for(lambda: saying(members, "assigned ") == 3, timeout=30, what="three members in")

    done = kafka_idem("pause", APP, "--handler", "alpha", "--reason", "PSP incident 4411",
                      db=db, env=apps)
    paused_at = time.monotonic()
    assert done.code == 0, done.err
    assert "alpha: paused by acceptance" in done.out
    wait_for(lambda: saying(members, PAUSED) == 3, timeout=5, what="three members holding it")
    assert time.monotonic() - paused_at < 5
    feed(a, 100, 30)
    feed(b, 100, 30)
    wait_for(lambda: calls(db, "beta") == 36, timeout=30, what="beta going on")
    assert calls(db, "alpha") == 6

    again = kafka_idem("pause", APP, "--handler", "alpha", "--reason", "twice", db=db, env=apps)
    assert again.code == 0 and "paused already, by acceptance" in again.out
    assert "PSP incident 4411" in again.out
    status = kafka_idem("status", "--json", db=db)
    assert status.code == 0, status.err
    [shown] = status.json()["paused_handlers"]
    assert (shown["namespace"], shown["handler"], shown["reason"], shown["actor"]) == (
        "pausable", "alpha", "PSP incident 4411", "acceptance")
    text = kafka_idem("status", db=db)
    assert "paused handlers" in text.out and "PSP incident 4411" in text.out

    done = kafka_idem("resume", APP, "--handler", "alpha", db=db, env=apps)
    resumed_at = time.monotonic()
    assert done.code == 0 and "alpha: resumed by acceptance" in done.out
    wait_for(lambda: calls(db, "alpha") == 36, timeout=5, what="alpha called again")
    assert time.monotonic() - resumed_at < 5
    wait_for(lambda: saying(members, RESUMED) == 3, timeout=5, what="three members resumed")
    assert kafka_idem("status", "--json", db=db).json()["paused_handlers"] == []


def test_an_unknown_handler_is_one_line_naming_the_apps_handlers(db: DB) -> None:
    done = kafka_idem("pause", APP, "--handler", "gamma", "--reason", "x", db=db)
    assert done.code == 2
    assert done.err.count("\n") == 1 and "no handler 'gamma'" in done.err
    assert "its handlers: alpha, beta" in done.err
    resume = kafka_idem("resume", APP, "--handler", "alpha", db=db)
    assert resume.code == 0 and "alpha: not paused; nothing changed" in resume.out
    assert db.value("SELECT count(*) FROM kafka_idem.admin_audit") == 0


def test_a_member_killed_while_its_handler_is_paused_changes_nothing(
        db: DB, topics: Topics, members: Members, group: str) -> None:
    a, b = topics(partitions=2), topics(partitions=2)
    with psycopg.connect(db.dsn) as conn:
        pausable.create_tables(conn)
    apps = {"PAUSABLE_A": a, "PAUSABLE_B": b}
    env = member_env(db, a, PYTHONUNBUFFERED="1", **apps)
    doomed = members.start(APP, env, group=group)
    members.start(APP, env, group=group)
    wait_for(lambda: saying(members, "assigned ") == 2, timeout=30, what="two members in")
    assert kafka_idem("pause", APP, "--handler", "alpha", "--reason", "r", db=db,
                      env=apps).code == 0
    wait_for(lambda: saying(members, PAUSED) == 2, timeout=5, what="both members holding it")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    feed(a, 0, 10)
    feed(b, 0, 10)  # the survivor gets the dead member's partitions after its session ends
    wait_for(lambda: calls(db, "beta") == 10, timeout=60, what="beta on the survivor")
    assert calls(db, "alpha") == 0
    assert kafka_idem("resume", APP, "--handler", "alpha", db=db, env=apps).code == 0
    wait_for(lambda: calls(db, "alpha") == 10, timeout=5, what="alpha after the resume")
