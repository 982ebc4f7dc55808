"""The README stays true: every setting and every CLI command is documented."""

from __future__ import annotations

from pathlib import Path

from kafka_idem.cli.commands import cli
from kafka_idem.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table() -> None:
    missing = [f"KAFKA_IDEM_{name.upper()}" for name in Settings.model_fields
               if f"`KAFKA_IDEM_{name.upper()}`" not in README]
    assert missing == []


def test_every_cli_command_is_in_the_reference() -> None:
    missing = [name for name in cli.commands if f"| `{name}" not in README]
    assert missing == []


def test_the_quick_start_has_exactly_two_commands() -> None:
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    block = quick.split("```sh", 1)[1].split("```", 1)[0]
    commands = [ln for ln in block.splitlines() if ln.strip()]
    assert [c.split("#")[0].strip() for c in commands] == ["./dev demo", "./dev test"]


def test_your_first_handler_says_whose_database_it_uses() -> None:
    section = README.split("## Your first handler", 1)[1].split("\n## ", 1)[0]
    assert "That URL is the demo's database" in section
    assert "createdb" in section
