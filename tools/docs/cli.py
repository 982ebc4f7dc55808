"""The CLI reference page: every command and group of ``kafka-idem``, recursively, read
from the click objects (usage, help, options, arguments)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import click

from kafka_idem.cli.commands import cli
from tools.docs.markdown import cell, code, page, table, text

PROGRAM = "kafka-idem"
# click >= 8.3 marks an option given no default with a sentinel, not None
_UNSET = getattr(click.core, "UNSET", None)


def walk(command: click.Command, ctx: click.Context) -> Iterator[tuple[click.Command,
                                                                     click.Context]]:
    """``command`` and every command under it, depth first, sub-commands by name."""
    yield command, ctx
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            sub = command.commands[name]
            if not sub.hidden:
                yield from walk(sub, click.Context(sub, info_name=name, parent=ctx,
                                                    **sub.context_settings))


def command_paths() -> list[str]:
    """Every command's path (``kafka-idem dlq list``), as the page lists them."""
    return [ctx.command_path for _, ctx in walk(cli, root())]


def root() -> click.Context:
    """The top group's context, with its context settings (``-h``/``--help``)."""
    return click.Context(cli, info_name=PROGRAM, **cli.context_settings)


def type_of(param: click.Parameter) -> str:
    """An option's or argument's type in user terms."""
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    if isinstance(kind, click.Choice):
        said = "one of " + ", ".join(str(c) for c in kind.choices)
    elif isinstance(kind, click.IntRange | click.FloatRange):
        lo = "" if kind.min is None else f"{'>' if kind.min_open else '>='} {kind.min}"
        hi = "" if kind.max is None else f"{'<' if kind.max_open else '<='} {kind.max}"
        base = "integer" if isinstance(kind, click.IntRange) else "number"
        said = ", ".join(p for p in (base, lo, hi) if p)
    else:
        said = kind.name
    if param.multiple:
        said += ", repeatable"
    return said


def default_of(param: click.Parameter, ctx: click.Context) -> str:
    """An option's default as it would be typed (a dash when it has none)."""
    value: Any = param.get_default(ctx, call=False)
    if callable(value) or value is None or value is _UNSET or value in ((), []):
        return "-"
    if isinstance(param, click.Option) and param.is_flag:
        return "-" if value is False else code("on")
    return code(str(value))


def help_markdown(help_text: str | None) -> list[str]:
    """A command's help as Markdown paragraphs (click's ``\\b`` ones kept line by line)."""
    if not help_text:
        return []
    out: list[str] = []
    for para in inspect.cleandoc(help_text).split("\n\n"):
        if para.startswith("\b"):
            out += ["```text", *para[1:].strip("\n").splitlines(), "```", ""]
        else:
            out += [text(" ".join(para.split())), ""]
    return out


def options_table(command: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option) or param.hidden:
            continue
        if set(param.opts) & set(ctx.help_option_names):
            continue
        names = ", ".join(code(o) for o in (*param.opts, *param.secondary_opts))
        help_text = param.help or ""
        if param.required:
            help_text = f"Required. {help_text}"
        if param.envvar:
            help_text += f" (variable: {param.envvar})"
        rows.append([names, cell(type_of(param)), default_of(param, ctx), cell(help_text)])
    return table(["Option", "Type", "Default", "Help"], rows) if rows else []


def arguments_table(command: click.Command) -> list[str]:
    rows = []
    for param in command.params:
        if not isinstance(param, click.Argument):
            continue
        name = param.metavar or (param.name or "").upper()
        many = "one or more" if param.nargs == -1 else ""
        need = "required" if param.required else "optional"
        rows.append([code(name), cell(type_of(param)),
                     cell(", ".join(p for p in (need, many) if p))])
    return table(["Argument", "Type", "Needed"], rows) if rows else []


def section(command: click.Command, ctx: click.Context) -> list[str]:
    level = "#" * min(ctx.command_path.count(" ") + 2, 6)
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    out = [f"{level} {ctx.command_path}", "", "```text", f"Usage: {usage}", "```", ""]
    out += help_markdown(command.help)
    arguments = arguments_table(command)
    if arguments:
        out += ["Arguments:", "", *arguments, ""]
    options = options_table(command, ctx)
    if options:
        out += ["Options:", "", *options, ""]
    if isinstance(command, click.Group):
        subs = [f"[`{ctx.command_path} {n}`](#{_anchor(f'{ctx.command_path} {n}')})"
                for n in sorted(command.commands) if not command.commands[n].hidden]
        out += ["Commands: " + ", ".join(subs) + ".", ""]
    return out


def _anchor(title: str) -> str:
    """The id mkdocs' toc extension gives a heading of plain words and dashes."""
    return "-".join(title.lower().split())


def cli_page() -> str:
    """Every command of ``kafka-idem``: the top group first, then depth first by name."""
    body = [
        f"Every command of `{PROGRAM}` (also `python -m kafka_idem.cli`). Global "
        f"options go before the command: `{PROGRAM} --database-url URL status` (after it "
        "they are accepted too, unless the command has an option of that name). Every "
        "command takes `-h`/`--help`. Settings not given as options are read from "
        "`KAFKA_IDEM_*` variables (see the settings page).",
        "",
    ]
    for command, ctx in walk(cli, root()):
        body += section(command, ctx)
    return page("Command line", "the click commands of kafka_idem.cli", body)
