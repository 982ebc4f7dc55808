"""The testing guide (docs/how-to/testing.md) beyond what tests/docs checks (which
follows the page, against the database): its app and tests copied into an empty
folder and run with pytest in a subprocess, where the plugin comes from the installed
entry point, with no database answering: the tests are skipped, saying why (and not
the password); a suite that requires the database fails instead. And the page says to
install pytest before its example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kafka_idem.testing.plugin import reachable
from tests.conftest import ROOT
from tests.docs.pages import file_name, read

GUIDE = ROOT / "docs" / "how-to" / "testing.md"


def files() -> dict[str, str]:
    """The guide's files, by the name on their first line (``# shop.py``)."""
    return {name: block.body for block in read(GUIDE).blocks
            if (name := file_name(block)) is not None}


def run(folder: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    for name in ("shop.py", "test_shop.py"):
        (folder / name).write_text(files()[name])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KAFKA_IDEM_DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "-p", "no:hypothesispytest", *args],  # hypothesis: seconds to import, unused here
        cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_the_guide_has_an_app_its_tests_and_a_handler_that_fails_the_check() -> None:
    assert set(files()) == {"shop.py", "test_shop.py", "orders.py", "check_orders.py"}


def test_the_guide_says_to_install_pytest_before_the_example() -> None:
    before = GUIDE.read_text().split("```python", 1)[0]
    assert "pip install 'kafka_idem[testing]'" in before and "pip install pytest" in before
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("pytest") for d in project["optional-dependencies"]["testing"])


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
