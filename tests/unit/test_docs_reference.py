"""The generated reference (docs/reference/, ``python -m tools.docs.reference``): each page
is what the code makes now, names every setting, command, metric and ``idem.*`` header
(found here independently of the generator), and every public name has a docstring."""

from __future__ import annotations

import datetime as dt
import importlib
import os
import re
import subprocess
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from kafka_idem.cli.commands import cli
from kafka_idem.deadletters import headers
from kafka_idem.deadletters.dead_letter import DeadLetter
from kafka_idem.deadletters.signing import Signer
from kafka_idem.observe.metrics import Metrics
from kafka_idem.replay.records import DlqRecord
from kafka_idem.replay.republishing import replay_headers
from kafka_idem.settings import Settings
from kafka_idem.settings.environment import setting_variables
from kafka_idem.testing import FakeMessage
from tools.docs import api
from tools.docs.reference import FOLDER, PAGES, ROOT, render, stale, write

COMMAND = "python -m tools.docs.reference"
PACKAGE = ROOT / "kafka_idem"


def page(name: str) -> str:
    return (FOLDER / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_page_is_what_the_code_makes_now(name: str) -> None:
    path = FOLDER / name
    assert path.is_file(), f"docs/reference/{name} is missing: run {COMMAND}"
    assert path.read_text(encoding="utf-8") == PAGES[name](), (
        f"docs/reference/{name} is stale (the code changed): run {COMMAND}")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_page_says_it_is_generated_and_by_what(name: str) -> None:
    first = render()[name].splitlines()[0]
    assert "Generated" in first and COMMAND in first


def test_the_pages_are_made_the_same_way_twice() -> None:
    assert render() == render()


def test_check_names_each_stale_page_and_the_command(tmp_path: Path) -> None:
    assert sorted(write(tmp_path)) == sorted(PAGES)
    assert stale(tmp_path) == []
    (tmp_path / "metrics.md").write_text("# Metrics\n", encoding="utf-8")
    (tmp_path / "cli.md").unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tools.docs.reference", "--check",
                           "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert lines == [f"{tmp_path / 'cli.md'} is stale: run {COMMAND}",
                     f"{tmp_path / 'metrics.md'} is stale: run {COMMAND}"]
    again = subprocess.run([sys.executable, "-m", "tools.docs.reference",
                            "--out", str(tmp_path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert stale(tmp_path) == []
    assert (tmp_path / "metrics.md").read_text(encoding="utf-8") == PAGES["metrics.md"]()


# --- everything is in the pages -------------------------------------------------------

def test_every_setting_is_in_the_settings_page() -> None:
    text = page("settings.md")
    missing = [v for v in setting_variables() if f"`{v}`" not in text]
    assert missing == []
    assert len(setting_variables()) == len(Settings.model_fields)


def test_every_setting_has_a_description() -> None:
    assert [n for n, f in Settings.model_fields.items() if not (f.description or "").strip()] \
        == []


def _commands(command: click.Command, path: str) -> list[tuple[str, click.Command]]:
    found = [(path, command)]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            if not sub.hidden:  # a hidden command is left out of the page, as of --help
                found += _commands(sub, f"{path} {name}")
    return found


def test_every_command_is_in_the_cli_page() -> None:
    text = page("cli.md")
    paths = [p for p, _ in _commands(cli, "kafka-idem")]
    assert {"kafka-idem", "kafka-idem run", "kafka-idem dlq replay"} <= set(paths)
    missing = [p for p in paths
               if not re.search(rf"^#+ {re.escape(p)}$", text, re.MULTILINE)
               or f"Usage: {p} " not in text]
    assert missing == []


def test_every_option_of_every_command_is_in_the_cli_page_with_its_help() -> None:
    text = page("cli.md")
    missing = []
    for path, command in _commands(cli, "kafka-idem"):
        if not (command.help or "").strip():
            missing.append(f"{path}: no help text")
        for param in command.params:
            if isinstance(param, click.Option):
                if not (param.help or "").strip():
                    missing.append(f"{path} {param.opts[0]}: no help text")
                if f"`{param.opts[0]}`" not in text:
                    missing.append(f"{path} {param.opts[0]}: not in the page")
    assert missing == []


def test_every_metric_registered_is_in_the_metrics_page() -> None:
    text = page("metrics.md")
    families = list(Metrics().registry.collect())
    names = [f.name + ("_total" if f.type == "counter" else "") for f in families]
    assert "kafka_idem_messages_total" in names
    assert "kafka_idem_handler_duration_seconds" in names
    assert [n for n in names if f"`{n}`" not in text] == []


# a whole quoted or ``code`` name, not a prefix ("idem.replay.") nor a pattern (idem.original.*)
_IDEM_NAME = re.compile(r"(?<=[\"'`])idem\.[a-z_]+(?:\.[a-z_0-9]+)*(?=[\"'`])")


def test_every_idem_header_the_package_names_is_in_the_headers_page() -> None:
    """Every ``idem.x.y`` the package's code or docstrings quote (writers and readers)."""
    text = page("headers.md")
    named = {m for path in PACKAGE.rglob("*.py") for m in _IDEM_NAME.findall(path.read_text())}
    assert {"idem.key", "idem.signature", "idem.outbox.id", "idem.replay.group"} <= named
    assert sorted(n for n in named if f"`{n}`" not in text) == []


def _names(pairs: Sequence[tuple[str, object]]) -> list[str]:
    return [k for k, _ in pairs if k.startswith(headers.PREFIX)]


def test_the_dead_letter_table_is_what_a_dead_letter_carries() -> None:
    """Written in the table's order; the table holds nothing a dead letter never has."""
    source = FakeMessage("orders", partition=1, offset=7, key=b"k", value=b"x" * 2000,
                         headers=[("trace", b"t")], timestamp=1_714_557_600_000)
    letter = DeadLetter(dlq_topic="orders.dlq", source=source, kind="permanent",
                        error_class="Permanent", error_message="no", attempts=1,
                        consumer_group="g", handler="h", idempotency_key="t:o:1",
                        namespace="shop", first_failure_at=dt.datetime.now(dt.UTC))
    signer = Signer([b"0123456789abcdef0123"])
    full, slim = (_names([*r.headers, signer.header(r.headers, r.key, r.value)])
                  for r in (letter.record(1024), letter.slim(1024)))
    table = [h.name for h in headers.DEAD_LETTER]
    assert full == [n for n in table if n in full]
    assert slim == [n for n in table if n in slim]
    assert set(full) | set(slim) == set(table)
    bare = _names(DeadLetter(dlq_topic="orders.dlq", source=source, kind="undecodable",
                             error_class="Undecodable", error_message="no", attempts=0,
                             consumer_group="g", handler="h").headers(1024))
    assert bare == [h.name for h in headers.DEAD_LETTER if h.present == headers.ALWAYS]


def test_the_replay_table_is_what_a_replayed_copy_carries() -> None:
    dead = FakeMessage("orders.dlq", partition=0, offset=3, key=b"k", value=b"{}",
                       headers=[("idem.key", b"t:o:1"), ("idem.original.topic", b"orders")])
    copy = replay_headers(DlqRecord.from_message(dead), actor="ops", group="replay-1")
    assert _names(copy) == [h.name for h in headers.REPLAYED]


# --- docstrings -------------------------------------------------------------------------

def test_every_public_name_has_a_docstring() -> None:
    missing = api.undocumented()
    assert missing == [], ("public names without a docstring (api.md shows them "
                           f"empty): {', '.join(missing)}")


def test_the_api_page_has_a_section_per_export() -> None:
    text = page("api.md")
    for module in api.PUBLIC_MODULES:
        names = [n for n in importlib.import_module(module).__all__ if not n.startswith("__")]
        assert [n for n in names if f"::: {module}.{n}\n" not in text] == [], module
    assert "`kafka_idem.__version__`" in text
    assert [n for n in api.PUBLIC_NAMES if f"::: {n}\n" not in text] == []


UNSAID = 1
SAID = 2
"""Documented."""


@dataclass
class _Plain:
    value: int


class _Told:
    """Documented."""

    def said(self) -> None:
        """Documented."""

    def unsaid(self) -> None:
        pass

    @property
    def bare(self) -> int:
        return 1


def test_the_audit_finds_what_has_no_docstring(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("kafka_idem_audit_probe")
    module.__file__ = str(Path(__file__))
    module._Plain = _Plain  # type: ignore[attr-defined]
    module._Told = _Told  # type: ignore[attr-defined]
    module.bare_function = lambda: None  # type: ignore[attr-defined]
    module.UNSAID, module.SAID = UNSAID, SAID  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    probe = [f"{module.__name__}.{n}"
             for n in ("_Plain", "_Told", "bare_function", "UNSAID", "SAID")]
    assert api.undocumented(probe) == [
        f"{module.__name__}._Plain",  # a dataclass's made-up signature is no docstring
        f"{module.__name__}._Told.bare",
        f"{module.__name__}._Told.unsaid",
        f"{module.__name__}.bare_function",
        f"{module.__name__}.UNSAID",  # a constant: no string right after its assignment
    ]


class _Scope:
    """What the role rewriter asks of a griffe object: resolve a name in its scope."""

    parent = None

    def resolve(self, name: str) -> str:
        if name == "Harness":
            return "kafka_idem.testing.harness.Harness"
        raise KeyError(name)


def test_rest_roles_become_optional_cross_references() -> None:
    from tools.docs.griffe_rest import rewrite

    text = ("See :class:`~kafka_idem.errors.ConfigError` and :meth:`Harness.check`, "
            ":func:`nowhere`; from code::\n\n    x = 1\n")
    assert rewrite(_Scope(), text) == (  # type: ignore[arg-type]
        'See <autoref identifier="kafka_idem.errors.ConfigError" optional>'
        "<code>ConfigError</code></autoref> and "
        '<autoref identifier="kafka_idem.testing.harness.Harness.check" optional>'
        "<code>Harness.check</code></autoref>, "
        '<autoref identifier="nowhere" optional><code>nowhere</code></autoref>; '
        "from code:\n\n    x = 1\n")


def test_a_boolean_setting_is_called_a_boolean() -> None:
    from tools.docs.pages import type_name

    assert (type_name(bool), type_name(int), type_name(bool | None)) == (
        "boolean", "integer", "boolean, optional")
    text = page("settings.md")
    assert "| `KAFKA_IDEM_EVENT_LOOP_THREAD` | `event_loop_thread` | boolean |" in text
