"""The chaos run's ``--orm``: the ORM payments example instead of payments.py, said in
the command that replays the run."""

from __future__ import annotations

from tools.chaos.members import APP, ORM_APP
from tools.chaos.options import parse, replay_args


def test_orm_runs_the_orm_example_and_the_replay_says_so() -> None:
    plain, orm = parse([], ""), parse(["--orm", "--mode", "leased", "--async-handler"], "")
    assert (plain.orm, orm.orm) == (False, True)
    assert "--orm" not in replay_args(plain, 1).split()
    assert replay_args(orm, 1).split()[-1] == "--orm"
    assert (APP, ORM_APP) == ("consumers.payments:app", "consumers.payments_orm:app")
