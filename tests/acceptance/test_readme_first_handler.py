"""The README's "Your first handler", followed as written from an empty folder next to a
fresh clone of this repository, against the real broker and a new, empty database.

The section is read from the clone's README.md and run in order, in one bash session
(so ``cd``, the venv's ``activate`` and ``export`` carry over, as in a terminal):

* each line of a ``sh`` block is a command, which must exit 0;
* a ``python`` block whose first line is ``# NAME.py`` is written to that file;
* a ``text`` block lists lines the previous ``sh`` block printed; a ``log`` block, lines
  the member (``kafka-idem run``, "in a second terminal": here in the background, its
  output in ``run.log``) writes, waited for; ``…`` stands for any text;
* the section's topic name is made unique, the group is set with KAFKA_IDEM_GROUP_ID
  and the two ``export``\\ s get this test's broker and database, so parallel runs on
  shared services never meet. Nothing else is changed.

``pip install`` builds the clone offline (``PIP_NO_INDEX``, no build isolation): the
dependencies come from this test's own environment on ``PYTHONPATH``, so the step
proves the package builds and installs from the clone, not that PyPI answers.

The clone is of this repository's HEAD plus its uncommitted changes to tracked files
(``git stash create``): a file not yet added to git is not in it, as it would not be in
a clone.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.conftest import ADMIN_DSN, BOOTSTRAP, ROOT, Topics, dsn_for, wait_for

pytestmark = pytest.mark.slow

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
OFFLINE_BUILD = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "kafka_idem",
                 "__editable__", "distutils-precedence.pth", "__pycache__")


def section(readme: str, title: str) -> str:
    start = readme.index(f"\n## {title}\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end]


def steps(text: str) -> list[tuple[str, str]]:
    """The section's fenced blocks, in order: (kind, body)."""
    return [(kind, body) for kind, body in FENCE.findall(text)]


def pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*?".join(re.escape(part) for part in line.split("…")))


class Shell:
    """One bash session: commands run in turn, each one's exit code and output read back."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def run(self, command: str, *, timeout: float = 300) -> tuple[int, str]:
        marker = f"__done_{uuid.uuid4().hex}__"
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\necho {marker}$?\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"`{command}` did not finish within {timeout:.0f} s:\n{''.join(out)}")
            if line.startswith(marker):
                return int(line[len(marker):]), "".join(out)
            out.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture
def scratch(tmp_path: Path, topics: Topics) -> Iterator[tuple[Path, str, str]]:
    """The empty database, a clone next to the user's folder, this run's topic name."""
    name = f"kafka_idem_readme_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    topic = f"inventory-{uuid.uuid4().hex[:8]}.reserve"
    topics.created += [topic, f"{topic}.dlq"]
    yield tmp_path, dsn_for(name), topic
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def clone(into: Path) -> Path:
    """A fresh clone of this repository, at HEAD plus its uncommitted tracked changes."""
    sha = subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    target = into / "kafka_idem"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(target)], check=True)
    if sha:
        subprocess.run(["git", "checkout", "-q", sha], cwd=target, check=True)
    return target


def offline_env(tmp: Path, dsn: str, group: str) -> dict[str, str]:
    """The terminal's environment: ``python3`` is this interpreter; pip builds offline with
    the dependencies of this environment (a folder of links to them on PYTHONPATH)."""
    bin_dir, deps = tmp / "bin", tmp / "deps"
    bin_dir.mkdir()
    deps.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for entry in site.iterdir():
        if not entry.name.startswith(OFFLINE_BUILD):
            (deps / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KAFKA_IDEM_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(deps),
                "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", "KAFKA_IDEM_GROUP_ID": group,
                "README_DSN": dsn, "COLUMNS": "200"})
    return env


def wait_log(log: Path, line: str) -> None:
    """Until the member's output has ``line`` (its progress lines come up to 10 s apart)."""
    wanted = pattern(line)
    # the member's shell opens run.log in the background: it may not exist yet
    wait_for(lambda: log.exists() and wanted.search(log.read_text(errors="replace")),
             what=f"{line!r} in the member's output", timeout=60)


def test_the_readme_first_handler_section_works_as_written(
    scratch: tuple[Path, str, str],
) -> None:
    tmp, dsn, topic = scratch
    if importlib.util.find_spec("wheel") is None:  # setuptools < 70 builds wheels with it
        pytest.fail("the offline build of the clone needs the `wheel` package of the dev "
                    "extra: run `./dev test` (it installs it) or `pip install -e '.[dev]'`")
    repo = clone(tmp)
    text = section((repo / "README.md").read_text(), "Your first handler")
    assert "inventory.reserve" in text
    text = text.replace("inventory.reserve", topic)
    group = f"inventory-{uuid.uuid4().hex[:8]}"
    shell = Shell(tmp, offline_env(tmp, dsn, group))
    member_pid: int | None = None
    last_output = ""
    try:
        for kind, body in steps(text):
            if kind == "sh":
                last_output = ""
                for command in filter(None, (ln.strip() for ln in body.splitlines())):
                    if command.startswith("export KAFKA_IDEM_BOOTSTRAP_SERVERS="):
                        command = f"export KAFKA_IDEM_BOOTSTRAP_SERVERS={BOOTSTRAP}"
                    elif command.startswith("export KAFKA_IDEM_DATABASE_URL="):
                        command = 'export KAFKA_IDEM_DATABASE_URL="$README_DSN"'
                    elif command.startswith("kafka-idem run "):  # "in a second terminal"
                        command = f"{command} > run.log 2>&1 & echo $! > run.pid"
                    code, out = shell.run(command)
                    assert code == 0, f"`{command}` exited {code}:\n{out}"
                    if command.startswith("kafka-idem inspect "):
                        assert "succeeded" in out, out
                    last_output += out
            elif kind == "python":
                first = body.partition("\n")[0]
                assert first.startswith("# ") and first.endswith(".py"), first
                _, cwd = shell.run("pwd")
                (Path(cwd.strip()) / first[2:]).write_text(body)
            elif kind == "text":
                for line in filter(None, body.splitlines()):
                    assert pattern(line).search(last_output), f"{line!r} not in:\n{last_output}"
            elif kind == "log":
                folder = Path(shell.run("pwd")[1].strip())
                member_pid = int((folder / "run.pid").read_text())
                for line in filter(None, body.splitlines()):
                    wait_log(folder / "run.log", line)
    finally:
        if member_pid is not None:
            os.kill(member_pid, signal.SIGTERM)  # Ctrl-C in its terminal
        shell.close()

    folder = tmp / "inventory"
    log = (folder / "run.log").read_text(errors="replace")
    wait_for(lambda: "consumer stopped" in (folder / "run.log").read_text(), what="the stop")
    assert "Traceback" not in log and " ERROR " not in log, log
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT shop, order_id, sku, qty FROM inventory.reservations"
                            ).fetchall()
        record = conn.execute("SELECT status, attempts, result_json FROM "
                              "kafka_idem.task_idempotency WHERE idempotency_key = "
                              "'s1:reserve:o-1' AND namespace = 'inventory'").fetchone()
    assert rows == [("s1", "o-1", "sku-9", 2)]  # two deliveries, one reservation
    assert record == ("succeeded", 1, {"reserved": 2})
