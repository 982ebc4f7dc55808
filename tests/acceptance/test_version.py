"""``kafka-idem --version``: the installed command prints the package's one version (the
one ``pyproject.toml`` reads), before and without any setting, database or broker."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import kafka_idem
from tests.acceptance.conftest import kafka_idem as run_cli
from tests.conftest import ROOT


def test_version_prints_the_package_version() -> None:
    done = run_cli("--version")
    assert (done.code, done.out, done.err) == (0, f"kafka-idem {kafka_idem.__version__}\n", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+", kafka_idem.__version__)


def test_version_needs_no_valid_setting() -> None:
    """An eager option: printed before the group loads its settings."""
    bad = {"KAFKA_IDEM_MAX_POLL_INTERVAL_MS": "many"}
    assert run_cli("migrate", env=bad).code == 2  # the setting is refused by a command
    done = run_cli("--version", env=bad)
    assert (done.code, done.out) == (0, f"kafka-idem {kafka_idem.__version__}\n")


def test_python_dash_m_prints_the_same_version() -> None:
    done = subprocess.run([sys.executable, "-m", "kafka_idem.cli", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"kafka-idem {kafka_idem.__version__}\n")


def test_pyproject_reads_the_version_from_the_package() -> None:
    """Written once: the distribution's version is the module's attribute."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "kafka-idem"
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "kafka_idem._version.__version__"
    from kafka_idem._version import __version__
    assert __version__ == kafka_idem.__version__
