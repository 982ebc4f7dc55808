"""What a user reads about Citus in the code points to the how-to (docs/CITUS.md), not to
the measurements (docs/SCALING.md), and an app's migrations name the command that runs
them (`kafka-idem migrate --app`)."""

from __future__ import annotations

from pathlib import Path

from kafka_idem import App
from kafka_idem.cli.commands import migrate
from kafka_idem.store.citus import refuse_uncolocated
from kafka_idem.store.errors import local_write_error

ROOT = Path(__file__).resolve().parents[2]


def test_citus_texts_point_to_the_how_to() -> None:
    import inspect

    texts = {"App.co_locate": App.co_locate.__doc__, "App.handler": App.handler.__doc__,
             "migrate --help": migrate.help,
             "the local-table refusal": local_write_error("h", ["s.t"], "s.r").message,
             "refuse_uncolocated": inspect.getsource(refuse_uncolocated)}
    for where, text in texts.items():
        assert text and "docs/CITUS.md" in text and "SCALING.md" not in text, where
    assert (ROOT / "docs" / "CITUS.md").exists()


def test_an_app_migration_names_the_command_with_its_app() -> None:
    doc = " ".join((App.migration.__doc__ or "").split())
    assert "run by ``kafka-idem migrate --app MODULE:APP``" in doc
