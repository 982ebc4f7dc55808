"""Write the reference pages of the docs site from the code: ``python -m
tools.docs.reference`` (re)writes them in docs/reference/; ``--check`` writes nothing
and exits 1 naming each page that differs from what the code makes (stale or missing).

    settings.md  the fields of kafka_idem.settings.Settings
    cli.md       every command of kafka-idem (kafka_idem.cli)
    metrics.md   kafka_idem.observe.metrics.METRICS
    headers.md   kafka_idem.deadletters.headers (dead letters, outbox events, replays)
    api.md       mkdocstrings directives for the public modules' __all__
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tools.docs.api import api_page
from tools.docs.cli import cli_page
from tools.docs.markdown import COMMAND
from tools.docs.pages import headers_page, metrics_page, settings_page

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "docs" / "reference"
PAGES: dict[str, Callable[[], str]] = {
    "api.md": api_page,
    "cli.md": cli_page,
    "headers.md": headers_page,
    "metrics.md": metrics_page,
    "settings.md": settings_page,
}


def render() -> dict[str, str]:
    """Every page's text, as the code makes it now."""
    return {name: make() for name, make in PAGES.items()}


def stale(folder: Path = FOLDER) -> list[str]:
    """The pages in ``folder`` that differ from :func:`render` (or are missing)."""
    out = []
    for name, want in render().items():
        path = folder / name
        if not path.is_file() or path.read_text(encoding="utf-8") != want:
            out.append(name)
    return out


def write(folder: Path = FOLDER) -> list[str]:
    """Write every page that changed; return their names."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = stale(folder)
    pages = render()
    for name in changed:
        (folder / name).write_text(pages[name], encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each stale page")
    parser.add_argument("--out", type=Path, default=FOLDER, metavar="DIR",
                        help="the pages' folder (default: docs/reference)")
    args = parser.parse_args(argv)
    folder: Path = args.out
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    if args.check:
        old = stale(folder)
        for name in old:
            print(f"{shown / name} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if old else 0
    for name in write(folder):
        print(f"wrote {shown / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
