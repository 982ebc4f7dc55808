"""The tutorial and every how-to guide, followed as written against the real broker and
a new database: each code block is run or checked (tests/docs/pages.py says how)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.conftest import BOOTSTRAP, Topics, dsn_for, empty_database
from tests.docs.pages import (
    ROOT,
    Run,
    Shell,
    clone,
    environment,
    free_ports,
    guides,
    read,
    unrunnable,
)

pytestmark = pytest.mark.slow

PAGES = guides()
WHEEL = os.environ.get("KAFKA_IDEM_DOCS_WHEEL")


def test_there_is_a_tutorial_and_guides() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert "docs/tutorial.md" in names
    assert len(names) >= 2, names


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_every_block_is_run_or_checked(path: Path) -> None:
    assert unrunnable(read(path)) == []


@pytest.fixture
def database() -> Iterator[str]:
    with empty_database("kafka_idem_docs") as name:
        yield dsn_for(name)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_the_page_works_as_written(path: Path, tmp_path: Path, database: str,
                                   topics: Topics, request: pytest.FixtureRequest) -> None:
    page = read(path)
    test = page.test
    run_id = uuid.uuid4().hex[:8]
    substitute = {name: f"{name}-{run_id}" for name in test.get("topics", [])}
    for name in substitute.values():
        topics.created += [name, f"{name}.dlq", f"{name}.retry"]
    substitute.update(free_ports(test))
    names = {name: f"{name}-{run_id}" for name in test.get("names", [])}
    topics.created += [f"kafka-idem-outbox.{name}" for name in names.values()]
    substitute.update(names)
    if test.get("clone"):
        clone(tmp_path)
    env = environment(tmp_path, bootstrap=BOOTSTRAP, dsn=database, group=f"docs-{run_id}",
                      clone=bool(test.get("clone")), wheel=WHEEL)
    if test.get("registry"):
        env["DOCS_REGISTRY"] = request.getfixturevalue("schema_registry")
    work = tmp_path / "work"
    work.mkdir()
    run = Run(page, Shell(tmp_path if test.get("clone") else work, env), substitute,
              wheel=WHEEL)
    try:
        run.follow()
    finally:
        problems = run.stop()
        run.shell.close()
    assert problems == []
    with psycopg.connect(database) as conn:
        for query, rows in (test.get("expect_sql") or {}).items():
            got = [list(r) for r in conn.execute(run.text(query)).fetchall()]
            assert got == rows, f"{path.name}: {query}"
