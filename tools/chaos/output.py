"""What the chaos run prints: timestamped progress lines, tables and the final summary.

Everything goes to one rich console on stdout; :func:`say` prefixes each line with
the seconds since the run started.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from tools.chaos.checker import Report
    from tools.chaos.faults import Injector
    from tools.chaos.members import Pool
    from tools.chaos.services import Offsets
    from tools.chaos.traffic import Feed

console = Console(highlight=False)
T0 = time.monotonic()


def say(text: str) -> None:
    console.print(f"[dim]{time.monotonic() - T0:7.1f}s[/] {text}", soft_wrap=True)


def table(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*(str(v) for v in row))
    return t


def progress(feed: Feed, offsets: Offsets, pool: Pool) -> None:
    state = offsets.lag(timeout=3)
    where = "broker not answering" if state is None else f"committed {state[0]}, lag {state[1]}"
    members = ", ".join(f"{m}{' STOPPED' if m.stopped else ''}" for m in pool.alive())
    say(f"[dim]sent {sum(feed.sent.values())}, acked {len(feed.acked)}, {where}; "
        f"members {members}[/]")


def print_summary(injector: Injector, feed: Feed, report: Report,
                  health: list[tuple[str, bool, str]], evidence: dict[str, int],
                  tracebacks: dict[str, int], result: dict[str, Any]) -> None:
    console.print(table("Fault log", ("#", "at", "fault", "pids", "detail"),
                        [(f.n, f"{f.at:.1f}s", f.fault, " ".join(map(str, f.pids)), f.detail)
                         for f in injector.log]))
    console.print(table("Faults by type", ("fault", "count"),
                        sorted(Counter(f.fault for f in injector.log).items())))
    console.print(table("Messages sent (acknowledged by kind)", ("kind", "sent", "acknowledged"),
                        [(k, feed.sent[k], feed.acked_kinds[k]) for k in sorted(feed.sent)]))
    console.print(table("What the members' logs show", ("sign", "lines"),
                        sorted(evidence.items())))
    if tracebacks:
        console.print(table("Tracebacks in the members' logs (logged, not necessarily fatal)",
                            ("exception (after: the log line before it)", "count"),
                            sorted(tracebacks.items())))
    console.print(report.figures_table())
    console.print(report.table())
    console.print(table("Run health", ("check", "", "detail"), [
        (name, "[green]PASS[/]" if ok else "[bold red]FAIL[/]", detail)
        for name, ok, detail in health]))
    heal = result["heal"]
    console.print(f"healed in {heal['healed_in']}s (bound {heal['bound']:.0f}s); "
                  f"{result['messages']['sent']} messages; {len(injector.log)} faults; "
                  f"{report.anomalies} anomalies")
