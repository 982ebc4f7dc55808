"""The README is a front page that stays true: at most 200 lines, the quick start's two
commands, a handler taken from the tutorial (which a test runs), links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 200


def test_the_quick_start_has_exactly_two_commands() -> None:
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    block = quick.split("```sh", 1)[1].split("```", 1)[0]
    commands = [ln for ln in block.splitlines() if ln.strip()]
    assert [c.split("#")[0].strip() for c in commands] == ["./dev demo", "./dev test"]


def test_the_quick_start_says_how_to_move_the_ports() -> None:
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "KAFKA_IDEM_KAFKA_PORT" in quick and "KAFKA_IDEM_PG_PORT" in quick


def test_the_readme_handler_is_the_tutorial_app_line_for_line() -> None:
    """Every line of the README's handler is in the tutorial's app.py, in order: the
    tutorial's test runs that file, so the front page shows code that works."""
    (handler,) = re.findall(r"```python\n(.*?)```", README, re.S)
    app = next(block for block in re.findall(r"```python\n(.*?)```", TUTORIAL, re.S)
               if block.startswith("# app.py"))
    remaining = app.splitlines()
    for line in handler.splitlines():
        assert line in remaining, f"{line!r} is not in the tutorial's app.py (in order)"
        remaining = remaining[remaining.index(line) + 1:]
    assert 15 <= len([ln for ln in handler.splitlines() if ln.strip()]) <= 25


def test_the_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_the_tutorial_says_whose_database_it_uses() -> None:
    assert "That URL is the demo's database" in TUTORIAL
    assert "createdb" in TUTORIAL


def test_no_page_documents_app_run() -> None:
    """``App`` has no ``run()``: a member runs with ``kafka-idem run`` or ``Runner(app)``."""
    from kafka_idem import App

    assert not hasattr(App, "run")
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    assert [p.name for p in pages if "app.run(" in p.read_text()] == []
