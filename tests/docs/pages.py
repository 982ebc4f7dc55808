"""Runs a documentation page as a reader would follow it, against the real services.

A page of the tutorial or of the how-to guides is a script in prose. Its fenced code
blocks are run in order, in one bash session in an empty folder (so ``cd``, a venv's
``activate`` and ``export`` carry over, as in a terminal):

* a block whose first line names a file (``# app.py``, ``# schemas/order.avsc`` is not
  possible in JSON, so ``// orders.proto`` for Protobuf) is written to that file, as the
  reader would save it; its language does not matter; so is a block whose info string
  gives its ``title="schemas/order.avsc"`` (shown as the block's title on the site);
* a block whose only line is ``--8<-- "path"`` shows a file of this repository verbatim
  (mkdocs' snippets): the file must exist; its own tests cover it;
* ``sh``: each line is a command (``\\`` continues a line; ``#`` lines are comments),
  which must exit 0. ``kafka-idem run …``, and a command ending in `` &``, is a
  process "in a second terminal":
  it runs in the background, its output in a log of its own, and gets SIGTERM (what
  Ctrl-C or a deployment's stop asks) when the page ends, which it must obey;
* ``text``: lines the previous ``sh`` block printed (when that block only reads:
  ``curl``, ``kafka-idem inspect``/``status``/``dlq list``/``dlq show``, ``cat``, a
  ``--dry-run``, it is run
  again until they are there, for up to 60 s: the output once the member caught up);
  ``log``: lines the latest background process writes, waited for; in both, ``…``
  stands for any text;
* any other block fails the test: every block of a guide is run or checked.

The page's front matter (YAML between ``---`` lines, which mkdocs takes as the page's
metadata and does not show) says what the run needs::

    test:
      topics: [inventory.reserve]   # names made unique for this run, everywhere on the page
      clone: true                   # a clone of this repository next to the folder
      expect_sql:                   # after the page: query -> the rows it must return
        "SELECT count(*) FROM inventory.reservations": [[1]]
      tracebacks: false             # (default) no "Traceback" in a background process's log
      ports: [9108]                 # each replaced, everywhere on the page, by a free port
      names: [billing]              # other names made unique for this run, everywhere on
                                    # the page: an app's name, so that its namespace, the
                                    # outbox's control topic ``kafka-idem-outbox.<name>``
                                    # (deleted afterwards) and transactional ids are its own
      registry: true                # a real schema registry (tests/conftest.py's); the
                                    # page's ``export KAFKA_IDEM_SCHEMA_REGISTRY_URL=`` is it

Each page gets a new, empty database (``KAFKA_IDEM_DATABASE_URL``), a consumer group
of its own (``KAFKA_IDEM_GROUP_ID``) and the test broker; the page's ``export
KAFKA_IDEM_BOOTSTRAP_SERVERS=`` and ``export KAFKA_IDEM_DATABASE_URL=`` lines are given
these. ``kafka-idem`` and ``python`` are this environment's, except on a ``clone:`` page,
whose own venv installs the clone offline (or, with ``KAFKA_IDEM_DOCS_WHEEL`` set, the
wheel at that path, with its dependencies from the package index: CI's check that the
built wheel runs the tutorial's app).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

import kafka_idem

FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
TITLE = re.compile(r'\btitle="([\w./-]+\.\w+)"')
FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
FILE_LINE = re.compile(r"^(?:#|//) ([\w./-]+\.\w+)$")
# Commands that only read: a ``text`` block after a block of these waits for its lines.
READ_ONLY = ("curl ", "kafka-idem inspect ", "kafka-idem status", "kafka-idem dlq list ",
             "kafka-idem dlq show ", "cat ")


def read_only(command: str) -> bool:
    """Whether ``command`` only reads (a global option before the command is allowed;
    any ``kafka-idem`` command with ``--dry-run`` only reads)."""
    bare = re.sub(r'^kafka-idem --database-url ("[^"]*"|\S+) ', "kafka-idem ", command)
    return bare.startswith(READ_ONLY) or (bare.startswith("kafka-idem ")
                                          and " --dry-run" in bare)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
# The site's own folders, and the repository root (for --8<-- includes).
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The test environment's packages a clone's offline install must not see: the build
# tools and the checkout's own (editable) kafka_idem.
OFFLINE_BUILD = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "kafka_idem",
                 "__editable__", "distutils-precedence.pth", "__pycache__")


@dataclass
class Block:
    kind: str
    body: str
    line: int  # 1-based, in the page's source
    title: str | None = None  # ```json title="schemas/x.avsc": the file it is

    def where(self, page: Path) -> str:
        return f"{page.relative_to(ROOT)}:{self.line} ({self.kind or 'plain'} block)"


@dataclass
class Page:
    path: Path
    meta: dict[str, Any]
    blocks: list[Block]

    @property
    def test(self) -> dict[str, Any]:
        test = self.meta.get("test") or {}
        assert isinstance(test, dict), f"{self.path}: front matter `test:` is not a mapping"
        return test


def read(path: Path) -> Page:
    text = path.read_text()
    meta: dict[str, Any] = {}
    front = FRONT.match(text)
    if front:
        meta = yaml.safe_load(front.group(1)) or {}
    blocks = [Block(m.group(1), m.group(3), text.count("\n", 0, m.start()) + 1,
                    title=found.group(1) if (found := TITLE.search(m.group(2))) else None)
              for m in FENCE.finditer(text)]
    return Page(path, meta, blocks)


def file_name(block: Block) -> str | None:
    if block.title is not None:
        return block.title
    first = block.body.partition("\n")[0].strip()
    found = FILE_LINE.match(first)
    return found.group(1) if found else None


def snippet(block: Block) -> str | None:
    lines = [ln for ln in block.body.splitlines() if ln.strip()]
    found = SNIPPET.match(lines[0].strip()) if len(lines) == 1 else None
    return found.group(1) if found else None


def unrunnable(page: Page) -> list[str]:
    """The page's blocks this runner would neither run nor check."""
    return [b.where(page.path) for b in page.blocks
            if b.kind not in ("sh", "text", "log") and file_name(b) is None
            and snippet(b) is None]


def commands(body: str) -> list[str]:
    """An ``sh`` block's commands: ``\\``-continued lines joined, comments left out."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


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
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"`{command}` did not finish within {timeout:.0f} s:\n{''.join(out)}")
            before, found, code = line.partition(marker)
            if found:  # after the command's last line, or its last unended one
                return int(code), "".join([*out, before])
            out.append(line)

    def cwd(self) -> Path:
        return Path(self.run("pwd")[1].strip())

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@dataclass
class Background:
    command: str
    pid: int
    log: Path


@dataclass
class Run:
    """One page followed from its first block to its last."""

    page: Page
    shell: Shell
    substitute: dict[str, str]
    wheel: str | None = None
    background: list[Background] = field(default_factory=list)
    printed: str = ""
    last: list[str] = field(default_factory=list)

    def text(self, body: str) -> str:
        for old, new in self.substitute.items():
            body = re.sub(rf"(?<![\w.-]){re.escape(old)}(?![\w-])", new, body)
        return body

    def follow(self) -> None:
        for block in self.page.blocks:
            body = self.text(block.body)
            name = file_name(block)
            where = block.where(self.page.path)
            if block.kind == "sh":
                self.printed, self.last = "", commands(body)
                for command in self.last:
                    self.command(command, where)
            elif block.kind == "text":
                self.expect([ln for ln in body.splitlines() if ln], where)
            elif block.kind == "log":
                assert self.background, f"{where}: no process runs in the background"
                for line in filter(None, body.splitlines()):
                    self.wait_log(self.background[-1], line, where)
            elif name is not None:
                target = self.shell.cwd() / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(body)
            else:
                include = snippet(block)
                assert include is not None, f"{where}: not run, not checked"
                assert (ROOT / include).is_file(), f"{where}: no file {include}"

    def expect(self, lines: list[str], where: str) -> None:
        """``lines`` in what the last ``sh`` block printed. A block of read-only commands
        (``READ_ONLY``) is run again until they are, for up to 60 s: its output is what
        the reader sees once the member caught up, which a test cannot time."""
        deadline = time.monotonic() + 60
        while True:
            missing = [ln for ln in lines if not pattern(ln).search(self.printed)]
            if not missing:
                return
            if not all(read_only(c) for c in self.last) or (
                    time.monotonic() > deadline):
                pytest.fail(f"{where}: {missing[0]!r} is not in what the commands printed:"
                            f"\n{self.printed}")
            time.sleep(0.5)
            self.printed = ""
            for command in self.last:
                self.command(command, where)

    def command(self, command: str, where: str) -> None:
        if command.startswith("export KAFKA_IDEM_BOOTSTRAP_SERVERS="):
            command = 'export KAFKA_IDEM_BOOTSTRAP_SERVERS="$DOCS_BOOTSTRAP"'
        elif command.startswith("export KAFKA_IDEM_DATABASE_URL="):
            command = 'export KAFKA_IDEM_DATABASE_URL="$DOCS_DSN"'
        elif command.startswith("export KAFKA_IDEM_SCHEMA_REGISTRY_URL="):
            assert self.page.test.get("registry"), f"{where}: no `registry: true` in the page"
            command = 'export KAFKA_IDEM_SCHEMA_REGISTRY_URL="$DOCS_REGISTRY"'
        elif self.wheel and command == "pip install ../kafka_idem":
            command = f"pip install {self.wheel}"
        if command.endswith(" &") or command.startswith("kafka-idem run "):
            n = len(self.background) + 1
            log = self.shell.cwd() / f".background-{n}.log"
            foreground = command.removesuffix(" &")
            code, out = self.shell.run(f"{foreground} > {log} 2>&1 & echo $!")
            assert code == 0, f"{where}: `{command}` did not start:\n{out}"
            self.background.append(Background(command, int(out.split()[-1]), log))
            return
        code, out = self.shell.run(command)
        assert code == 0, f"{where}: `{command}` exited {code}:\n{out}"
        self.printed += out

    def wait_log(self, process: Background, line: str, where: str) -> None:
        wanted = pattern(line)
        deadline = time.monotonic() + 90
        while True:
            text = process.log.read_text(errors="replace") if process.log.exists() else ""
            if wanted.search(text):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{where}: {line!r} not in the output of `{process.command}` "
                            f"within 90 s:\n{text[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> list[str]:
        """SIGTERM for every background process, in reverse order; their logs' problems."""
        problems = []
        for process in reversed(self.background):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while alive(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            text = process.log.read_text(errors="replace") if process.log.exists() else ""
            if alive(process.pid):
                os.kill(process.pid, signal.SIGKILL)
                problems.append(f"`{process.command}` ignored SIGTERM for 60 s:\n{text[-3000:]}")
            elif "Traceback" in text and not self.page.test.get("tracebacks"):
                problems.append(f"`{process.command}` printed a traceback:\n{text[-3000:]}")
        return problems


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a child of the page's shell that has exited but is not yet reaped is a zombie
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone meanwhile
        return False
    return state != "Z"


def environment(tmp: Path, *, bootstrap: str, dsn: str, group: str,
                clone: bool, wheel: str | None) -> dict[str, str]:
    """The reader's terminal. Without a clone, this environment's ``python`` and
    ``kafka-idem`` are on PATH. With one, ``python3`` is this interpreter and the page's
    own venv installs the clone offline, its dependencies from this environment (a folder
    of links on PYTHONPATH), or installs the wheel from the package index."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KAFKA_IDEM_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({"KAFKA_IDEM_GROUP_ID": group, "DOCS_BOOTSTRAP": bootstrap, "DOCS_DSN": dsn,
                "KAFKA_IDEM_BOOTSTRAP_SERVERS": bootstrap, "KAFKA_IDEM_DATABASE_URL": dsn,
                "COLUMNS": "200", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    if not clone:
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        if Path(kafka_idem.__file__).resolve().parents[1] == ROOT:
            # the checkout under test, also where the environment's editable install is
            # another one (a git worktree run with PYTHONPATH=.)
            env["PYTHONPATH"] = str(ROOT)
        return env
    (bin_dir / "python3").symlink_to(sys.executable)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if wheel:
        return env
    deps = tmp / ".deps"
    deps.mkdir()
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for entry in site.iterdir():
        if not entry.name.startswith(OFFLINE_BUILD):
            (deps / entry.name).symlink_to(entry)
    env.update({"PYTHONPATH": str(deps), "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"})
    return env


def clone(into: Path) -> Path:
    """A clone of this repository in ``into/kafka_idem``: HEAD plus the uncommitted
    changes to tracked files (``git stash create``), as a commit would have them; a file
    not yet added to git is not in it, as it would not be in a clone."""
    sha = subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    target = into / "kafka_idem"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(target)], check=True)
    if sha:
        subprocess.run(["git", "checkout", "-q", sha], cwd=target, check=True)
    return target


def free_ports(test: dict[str, Any]) -> dict[str, str]:
    """The page's ``ports:`` (a metrics port it shows), each mapped to a port free now, so
    pages and test runs side by side do not collide."""
    found = {}
    for port in test.get("ports", []):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            found[str(port)] = str(sock.getsockname()[1])
    return found


def guides() -> list[Path]:
    """The pages whose code blocks are all run: the tutorial and the how-to guides."""
    return sorted([*DOCS.glob("tutorial*.md"), *(DOCS / "how-to").glob("*.md")])
