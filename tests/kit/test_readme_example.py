"""The README's "Testing your handlers" example runs as a user would run it: its two
files copied into an empty folder and run with pytest in a subprocess, where the
plugin comes from the installed entry point. Without a database the same tests are
skipped, saying why; a suite that requires the database fails instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kafka_idem.testing.plugin import reachable
from tests.conftest import ADMIN_DSN, ROOT

SECTION = (ROOT / "README.md").read_text().split("## Testing your handlers", 1)[1]
SECTION = SECTION.split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)


def files() -> dict[str, str]:
    """The README's files, by the name on their first line (``# shop.py``)."""
    found = {}
    for block in BLOCKS:
        first = block.splitlines()[0]
        name = re.match(r"# (\w+\.py)", first)
        if name:
            found[name[1]] = block
    return found


def run(folder: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    for name, text in files().items():
        (folder / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KAFKA_IDEM_DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "-p", "no:hypothesispytest", *args],  # hypothesis: seconds to import, unused here
        cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_has_an_app_and_its_tests() -> None:
    assert set(files()) == {"shop.py", "test_shop.py"}


def test_the_readme_example_passes_as_a_user_runs_it(tmp_path: Path) -> None:
    done = run(tmp_path, ADMIN_DSN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b4 passed\b", done.stdout), done.stdout


def test_without_a_database_the_tests_are_skipped_saying_why(tmp_path: Path) -> None:
    done = run(tmp_path, "postgresql://nobody:s3cret@127.0.0.1:1/none")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b4 skipped\b", done.stdout), done.stdout
    assert ("kafka_idem test kit: no PostgreSQL answers at "
            "postgresql://nobody:**********@127.0.0.1:1/none") in done.stdout
    assert "s3cret" not in done.stdout + done.stderr


@pytest.mark.parametrize(("option", "ini"), [(True, False), (False, True)])
def test_a_suite_that_requires_the_database_fails_without_it(option: bool, ini: bool) -> None:
    config = Config({"kafka_idem_database_url": "postgresql://nobody@127.0.0.1:1/none",
                     "kafka_idem_require_database": option},
                    {"kafka_idem_require_database": ini})
    with pytest.raises(pytest.fail.Exception, match=re.escape(
            "no PostgreSQL answers at postgresql://nobody@127.0.0.1:1/none")):
        reachable(config)  # type: ignore[arg-type]
    config.options["kafka_idem_require_database"] = config.ini[
        "kafka_idem_require_database"] = False
    with pytest.raises(pytest.skip.Exception, match="set KAFKA_IDEM_DATABASE_URL"):
        reachable(config)  # type: ignore[arg-type]


@dataclass
class Config:
    """The two questions the plugin asks of pytest's config."""

    options: dict[str, Any]
    ini: dict[str, Any]

    def getoption(self, name: str) -> Any:
        return self.options[name]

    def getini(self, name: str) -> Any:
        return self.ini[name]
