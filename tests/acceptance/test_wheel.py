"""The wheel holds the runtime, the test kit and ``verify``: not the repository's tools
(the chaos run), not the tests, no ``sys.path`` edit but the CLI's one (``kafka-idem``
makes the current directory importable, as ``python -m`` does); installed alone in a
clean virtual environment, every module of it imports."""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kafka_idem
from tests.docs.pages import OFFLINE_BUILD, clone

pytestmark = pytest.mark.slow

IMPORT_ALL = """
import importlib, pkgutil, sys
import kafka_idem
assert kafka_idem.__file__.startswith(sys.prefix), kafka_idem.__file__
names = [m.name for m in pkgutil.walk_packages(kafka_idem.__path__, "kafka_idem.")
         if not m.name.endswith(".__main__")]  # running it is what a __main__ is for
for name in names:
    importlib.import_module(name)
from kafka_idem.admin.migrate import full_schema, migrations
from kafka_idem.store.queries import raw_queries
assert migrations() and full_schema() and raw_queries()  # the package's SQL files
print(len(names), "modules")
"""

# Without the optional extras' packages (here: opentelemetry, the otel extra), the user's
# API, the CLI and the member still import, and tracing is off.
IMPORT_WITHOUT_EXTRAS = """
import importlib.util, sys
import kafka_idem
assert kafka_idem.__file__.startswith(sys.prefix), kafka_idem.__file__
assert importlib.util.find_spec("opentelemetry") is None
import kafka_idem.cli.commands, kafka_idem.consume.runner, kafka_idem.testing
from kafka_idem.observe import tracing
assert not tracing.enabled()
print(kafka_idem.__version__)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    repo = clone(tmp)
    out = tmp / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(repo)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    # The distribution is kafka-idem; wheel file names normalise it to kafka_idem.
    (found,) = out.glob("kafka_idem-*.whl")
    assert found.name == f"kafka_idem-{kafka_idem.__version__}-py3-none-any.whl"
    return found


def test_the_wheel_metadata_names_the_distribution_and_the_package_version(
        wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (path,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(zf.read(path).decode())
    assert metadata["Name"] == "kafka-idem"
    assert metadata["Version"] == kafka_idem.__version__
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"protobuf", "otel", "testing", "docs", "dev"} <= extras, extras


def test_the_wheel_holds_the_package_and_nothing_of_the_repository(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kafka_idem"}
    assert not [n for n in names if "chaos" in n or "/tests/" in n or n.startswith("tests/")]
    assert "kafka_idem/py.typed" in names
    assert any(n.startswith("kafka_idem/admin/migrations/") and n.endswith(".sql")
               for n in names)
    assert {"kafka_idem/store/queries.sql", "kafka_idem/admin/schema.sql"} <= set(names)
    edits = sorted(n for n, text in sources.items()
                   if "sys.path.insert" in text or "sys.path.append" in text)
    assert edits == ["kafka_idem/cli/common.py"]


def clean_venv(wheel: Path, tmp_path: Path, *, without: tuple[str, ...] = ()
               ) -> tuple[Path, dict[str, str]]:
    """A venv with the wheel extracted into it, and the environment that gives it this
    environment's installed packages (but kafka_idem and ``without``) on PYTHONPATH."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The dependencies, offline: links to this environment's installed packages, but not
    # kafka_idem (an editable install of the checkout) nor pip/setuptools.
    deps = tmp_path / "deps"
    deps.mkdir()
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for entry in site.iterdir():
        if not entry.name.startswith(OFFLINE_BUILD + without):
            (deps / entry.name).symlink_to(entry)
    target = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)  # what pip does for a pure-Python wheel
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(deps)
    return python, env


def test_a_clean_venv_with_the_wheel_imports_every_module(wheel: Path, tmp_path: Path) -> None:
    python, env = clean_venv(wheel, tmp_path)
    done = subprocess.run([str(python), "-c", IMPORT_ALL], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 100, done.stdout


def test_the_wheel_imports_without_the_optional_extras(wheel: Path, tmp_path: Path) -> None:
    python, env = clean_venv(wheel, tmp_path, without=("opentelemetry",))
    done = subprocess.run([str(python), "-c", IMPORT_WITHOUT_EXTRAS], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, kafka_idem.__version__), done.stderr
