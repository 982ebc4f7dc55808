"""The group's options after the command are moved before it, for every command of
``kafka-idem`` (nested ones too), values included; a command's own option of the
same name, an option's value and what follows ``--`` stay where they are."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest

from kafka_idem.cli.commands import cli
from kafka_idem.cli.common import GlobalOptions, hoisted

GLOBAL = ["--database-url", "postgresql://x@h/db", "--schema=s2", "--debug",
          "--log-format", "json", "--bootstrap-servers", "b:9092", "--table", "t2"]


def paths(group: click.Group, ctx: click.Context, prefix: tuple[str, ...] = ()
          ) -> Iterator[tuple[str, ...]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from paths(command, ctx, (*prefix, name))


COMMANDS = list(paths(cli, click.Context(cli)))


def test_every_command_is_covered() -> None:
    assert {("status",), ("migrate",), ("run",), ("relay",), ("dlq", "replay"),
            ("dlq", "list"), ("topics", "create"), ("verify",), ("purge",)} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_the_group_options_after_any_command_go_before_it(path: tuple[str, ...]) -> None:
    ctx = click.Context(cli)
    args = [*path, "ARG", *GLOBAL]
    assert hoisted(cli, ctx, args) == [*GLOBAL, *path, "ARG"]
    # parsed by click: the group's own values
    parsed = cli.make_context("kafka-idem", [*path, "--database-url", "u", "--debug"],
                              resilient_parsing=True)
    assert (parsed.params["database_url"], parsed.params["debug"]) == ("u", True)


def test_a_commands_own_option_of_the_same_name_and_values_stay() -> None:
    @click.group(cls=GlobalOptions)
    @click.option("--schema")
    @click.option("--debug", is_flag=True)
    def group(schema: str | None, debug: bool) -> None: ...

    @group.command()
    @click.option("--schema")
    @click.option("--key")
    def sub(schema: str | None, key: str | None) -> None: ...

    ctx = click.Context(group)
    assert hoisted(group, ctx, ["sub", "--schema", "mine", "--key", "--debug"]) == [
        "sub", "--schema", "mine", "--key", "--debug"]  # --debug is --key's value here
    assert hoisted(group, ctx, ["--schema", "g", "sub", "--debug", "--", "--debug"]) == [
        "--schema", "g", "--debug", "sub", "--", "--debug"]
    assert hoisted(group, ctx, ["nosuch", "--debug"]) == ["nosuch", "--debug"]
