"""``kafka-idem run`` keeps other libraries quiet: a third-party logger's INFO lines
(an HTTP client's, one per request) are left out of a member's output while the app's
own INFO lines show; ``KAFKA_IDEM_LOG_LEVELS`` lets a library's through; a bad level
is a configuration error naming the setting."""

from __future__ import annotations

import pytest

from consumers.payments import encode_charge
from tests.acceptance.conftest import kafka_idem
from tests.conftest import DB, Members, Topics, caught_up, member_env, produce, wait_for

APP = "tests.apps.chatty:app"


@pytest.mark.parametrize("levels", [None, "urllib3=INFO"], ids=["default", "log_levels"])
def test_a_members_output_has_the_apps_info_lines_and_a_librarys_only_when_asked(
    db: DB, topics: Topics, members: Members, group: str, levels: str | None
) -> None:
    topic = topics(partitions=1)
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in ("o1", "o2")])
    env = member_env(db, topic, **({"KAFKA_IDEM_LOG_LEVELS": levels} if levels else {}))
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), what="the charges")
    members.stop_all()
    out = members.logs()
    assert "INFO tests.apps.chatty: app line: charging o1" in out
    assert "INFO tests.apps.chatty: app line: charging o2" in out
    library = [line for line in out.splitlines() if "library line" in line]
    if levels is None:
        assert library == []
    else:
        assert [line.split(" INFO ", 1)[1] for line in library] == [
            f"urllib3.connectionpool: library line: POST https://bank.example/charges {o}"
            for o in ("o1", "o2")]
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o2": 1}


def test_a_bad_level_names_the_setting() -> None:
    r = kafka_idem("status", env={"KAFKA_IDEM_LOG_LEVELS": "httpx=LOUD"})
    assert r.code == 2
    assert r.err.strip().startswith("error: invalid setting log_levels (KAFKA_IDEM_LOG_LEVELS): ")
    assert "'httpx=LOUD': the level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL" \
        in r.err
