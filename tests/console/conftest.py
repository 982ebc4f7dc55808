"""Fixtures of the web console's end-to-end tests: a real Chromium driven by selenium, and
``kafka-idem console`` subprocesses for it to browse.

* ``browser`` (session): a headless Chrome WebDriver on Debian's ``chromium`` through its
  ``chromedriver``, which ``scripts/browser.sh install`` installs first when missing (so
  a fresh clone needs nothing more). Selenium Manager is never run: the driver's path is
  given, and a call to it fails the start. A 1280x900 window (a 1280x757 viewport),
  implicit wait 0, page loads 30 s.
* ``page`` (function): the same browser on ``about:blank``, one window, no cookies; when
  the test fails, a screenshot of where it was goes to ``.local/screenshots/failed/``.
* ``console_server`` (function): a factory, ``console_server(app_spec, *, env=None,
  args=(), db=None)``, that starts ``python -m kafka_idem.cli console APP --port P``,
  waits for ``GET /healthz?ready=1`` to answer 200 and stops it (SIGTERM) at teardown;
  ``Consoles`` is that factory for fixtures of a wider scope.
* helpers: ``wait_for(browser, css)``, ``wait_text(browser, css, text)``,
  ``screenshot(browser, name)`` (into ``$KAFKA_IDEM_SCREENSHOTS``, the docs' run sets it
  to ``docs/images/console``, else ``.local/screenshots``), ``screenshot(browser, name,
  whole=True)`` the whole page (the window made as tall as the page, 2000 px at most).

Chromium runs with the flags this closed network needs (no background networking, no
component updates, no sync, no QUIC: their connections are refused, many at a time) and
a new empty profile, removed at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver import Chrome
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.selenium_manager import SeleniumManager
from selenium.webdriver.remote.command import Command
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import ADMIN_DSN, BOOTSTRAP, DB, ROOT
from tests.integration.test_metrics import free_port

LOCAL_DIR = Path(os.environ.get("KAFKA_IDEM_LOCAL_DIR") or ROOT / ".local")
WINDOW = (1280, 900)
PAGE_LOAD_TIMEOUT = 30
#: The console's command line, before ``APP --port P ARGS`` (a test of the fixture itself
#: puts a stand-in here).
CONSOLE_COMMAND = [sys.executable, "-m", "kafka_idem.cli", "console"]
CONSOLE_READY_TIMEOUT = 60.0
CONSOLE_STOP_TIMEOUT = 10.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_SHOT_HEIGHT = 2000  # pixels of page in a whole-page screenshot

# --headless is Chromium's new headless mode (the old one is a separate binary now).
# The background-networking, component-update, sync and QUIC switches keep Chromium off
# the network it would otherwise reach for at every start (refused here); the others make
# it run as root, without a GPU, first-run UI or proxy, and with shared memory in /tmp
# (a container's /dev/shm may be tiny). The window is 1280x900; new headless keeps room
# for the (invisible) toolbars in it, so the viewport, and a screenshot, is 1280x757.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-proxy-server",
    "--disable-dev-shm-usage",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)

#: How long the browser took, in seconds: ``install`` (scripts/browser.sh install, a
#: download the first time) and ``start`` (the session's chromedriver and Chromium up, the
#: WebDriver session created); printed at the end of the run.
TIMINGS: dict[str, float] = {}
_installed: subprocess.CompletedProcess[str] | None = None


# --- the browser -----------------------------------------------------------------------


def _install() -> subprocess.CompletedProcess[str]:
    """``scripts/browser.sh install``, once per run."""
    global _installed
    if _installed is None:
        t0 = time.monotonic()
        _installed = subprocess.run(["bash", str(ROOT / "scripts" / "browser.sh"), "install"],
                                    capture_output=True, text=True, timeout=1800, check=False)
        TIMINGS["install"] = time.monotonic() - t0
    return _installed


@pytest.hookimpl(trylast=True)  # after -k and -m deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # When a selected test needs the browser, install it now, before any test runs: the
    # first install downloads ~100 MB, which must not count against a test's timeout
    # (pytest-timeout, 300 s). A failure is reported by the fixture, to those tests.
    if config.option.collectonly:
        return
    if any("browser_install" in getattr(item, "fixturenames", ()) for item in items):
        _install()


def browser_paths() -> tuple[str, str]:
    """Chromium's and ChromeDriver's paths, from ``scripts/browser.sh install`` (which
    installs the Debian packages when either is missing)."""
    done = _install()
    if done.returncode != 0:
        pytest.fail("no browser: scripts/browser.sh install (which installs Debian's chromium "
                    f"and chromium-driver when missing) failed:\n{done.stderr[-4000:]}",
                    pytrace=False)
    lines = done.stdout.splitlines()
    if len(lines) < 2:
        pytest.fail(f"scripts/browser.sh install printed no paths: {done.stdout!r}")
    return lines[-2], lines[-1]


@pytest.fixture(scope="session")
def browser_install() -> tuple[str, str]:
    """Chromium's and ChromeDriver's paths, installed when missing (before the first test,
    see ``pytest_collection_modifyitems``)."""
    return browser_paths()


@contextlib.contextmanager
def no_selenium_manager() -> Iterator[None]:
    """Selenium Manager is a downloader of drivers and browsers: it must never run.
    Selenium skips it when the Service names the driver (as here); inside this block a
    call to it fails, and SE_OFFLINE would keep it off the network anyway."""

    def refuse(self: Any, args: list[str]) -> dict[str, str]:
        raise AssertionError(f"selenium tried to run Selenium Manager ({args}): the tests "
                             "use Debian's chromium and chromedriver only")

    with (mock.patch.object(SeleniumManager, "binary_paths", refuse),
          mock.patch.dict(os.environ, {"SE_OFFLINE": "true"})):
        yield


@dataclass(frozen=True)
class _Proc:
    """A process by pid and start time (a pid alone may be reused)."""

    pid: int
    started: str

    @staticmethod
    def of(pid: int) -> _Proc | None:
        stat = _stat(pid)
        return _Proc(pid, stat[19]) if stat else None

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return bool(stat) and stat[19] == self.started and stat[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: state, ppid, ... (field 3 on)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _tree(root: int, marker: str) -> set[_Proc]:
    """``root`` and its descendants, and every process whose command line has ``marker``
    (our profile folder: a Chromium that lost its parent still carries it)."""
    parents: dict[int, int] = {}
    tagged: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _stat(pid)
        if stat is None:
            continue
        parents[pid] = int(stat[1])
        with contextlib.suppress(OSError):
            if marker.encode() in (entry / "cmdline").read_bytes():
                tagged.add(pid)
    found = {root} | tagged
    grew = True
    while grew:
        more = {p for p, pp in parents.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return {proc for pid in found if (proc := _Proc.of(pid)) is not None}


def _reap(procs: set[_Proc], timeout: float = 5.0) -> list[int]:
    """Wait for ``procs`` to end; SIGKILL the ones still there after ``timeout`` (and
    wait for them to be gone). Returns the pids that had to be killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.alive() for p in procs):
        time.sleep(0.1)
    killed = []
    for p in procs:
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(p.alive() for p in procs):
        time.sleep(0.05)
    return killed


def start_browser(profile: Path, timings: dict[str, float] | None = None) -> Chrome:
    """A Chrome WebDriver on Debian's chromium with an empty profile in ``profile``;
    ``timings["start"]`` gets how long the start took."""
    chromium, chromedriver = browser_paths()
    t0 = time.monotonic()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={profile}")
    # The browser's console (CSP reports, script errors) for driver.get_log("browser").
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # SE_CHROMEDRIVER would override the path given here: the tests name theirs.
    service = Service(executable_path=chromedriver, driver_path_env_key="KAFKA_IDEM_CHROMEDRIVER",
                      log_output=str(profile.parent / "chromedriver.log"))
    try:
        with no_selenium_manager():
            driver = webdriver.Chrome(service=service, options=options)
    except WebDriverException as exc:
        log = profile.parent / "chromedriver.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        pytest.fail(f"Chromium did not start ({chromium}, {chromedriver}): {exc}\n{tail}",
                    pytrace=False)
    driver.implicitly_wait(0)
    driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT)
    driver.set_window_size(*WINDOW)
    if timings is not None:
        timings["start"] = time.monotonic() - t0
    return driver


def stop_browser(driver: Chrome, marker: str) -> list[int]:
    """End the session and chromedriver; then make sure every Chromium process of ours
    (``marker``: the profile folder on their command lines) is gone too: if ending the
    session failed, each is sent SIGTERM at once, and any left after 5 s is killed.
    Returns the pids signalled."""
    process = getattr(driver.service, "process", None)
    procs = _tree(process.pid if process is not None else -1, marker)
    # Not driver.quit(): it swallows a failure, which is what this must know.
    ended = process is not None and process.poll() is None
    if ended:
        try:
            driver.execute(Command.QUIT)
        except Exception:
            ended = False
    with contextlib.suppress(Exception):
        driver.service.stop()
    termed = []
    if not ended:
        for p in procs:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
                termed.append(p.pid)
    return sorted(set(termed) | set(_reap(procs)))


@pytest.fixture(scope="session")
def browser(browser_install: tuple[str, str]) -> Iterator[Chrome]:
    """One headless Chromium for the session (see the module's docstring)."""
    home = Path(tempfile.mkdtemp(prefix="kafka_idem-chromium-"))
    profile = home / "profile"
    profile.mkdir()
    try:
        driver = start_browser(profile, TIMINGS)
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    try:
        yield driver
    finally:
        stop_browser(driver, str(profile))
        shutil.rmtree(home, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


def reset_browser(browser: Chrome) -> None:
    """One window, on ``about:blank``, no cookie of any site, an empty console log."""
    handles = browser.window_handles
    for handle in handles[1:]:
        browser.switch_to.window(handle)
        browser.close()
    browser.switch_to.window(handles[0])
    browser.get("about:blank")
    # delete_all_cookies() would clear only the current page's site (none, on about:blank).
    browser.execute_cdp_cmd("Network.clearBrowserCookies", {})
    browser.get_log("browser")  # read, so dropped: what earlier tests logged


@pytest.fixture
def page(browser: Chrome, request: pytest.FixtureRequest) -> Iterator[Chrome]:
    """The session's browser on ``about:blank``, in one window, with every cookie cleared
    (of all sites, not only the current one's). On failure, a screenshot of the page the
    test ended on is saved (its path is in the test's report)."""
    reset_browser(browser)
    yield browser
    if request.node.stash.get(_FAILED, False):
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)[-150:]
        with contextlib.suppress(Exception):
            path = _save_png(browser, LOCAL_DIR / "screenshots" / "failed", name)
            request.node.add_report_section("teardown", "screenshot", str(path))


# --- helpers ---------------------------------------------------------------------------


def _where(browser: WebDriver) -> str:
    try:
        body = browser.find_element(By.TAG_NAME, "body").text
    except WebDriverException:
        body = "(no body)"
    return f"at {browser.current_url}, the page reads:\n{body[:2000]}"


def wait_for(browser: WebDriver, css: str, timeout: float = 20) -> WebElement:
    """The first element matching ``css``, once it is in the DOM (``timeout`` seconds)."""
    try:
        found: WebElement = WebDriverWait(browser, timeout).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css)))
    except TimeoutException:
        pytest.fail(f"no element {css!r} after {timeout}s {_where(browser)}", pytrace=False)
    return found


def wait_text(browser: WebDriver, css: str, text: str, timeout: float = 20) -> WebElement:
    """The first element matching ``css``, once its text contains ``text``."""
    try:
        WebDriverWait(browser, timeout).until(
            expected_conditions.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))
    except TimeoutException:
        pytest.fail(f"no {css!r} with text {text!r} after {timeout}s {_where(browser)}",
                    pytrace=False)
    return browser.find_element(By.CSS_SELECTOR, css)


def screenshots_dir() -> Path:
    """``$KAFKA_IDEM_SCREENSHOTS`` (relative to the repository root), else
    ``.local/screenshots``."""
    configured = os.environ.get("KAFKA_IDEM_SCREENSHOTS")
    return ROOT / configured if configured else LOCAL_DIR / "screenshots"


def _save_png(browser: WebDriver, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name if name.endswith(".png") else f"{name}.png")
    data = browser.get_screenshot_as_png()
    assert data.startswith(PNG_MAGIC), f"the screenshot is not a PNG: {data[:16]!r}"
    path.write_bytes(data)
    return path


def screenshot(browser: WebDriver, name: str, *, whole: bool = False,
               max_height: int = MAX_SHOT_HEIGHT) -> Path:
    """A PNG of the browser's viewport, saved as ``NAME.png`` in :func:`screenshots_dir`
    (replacing one of that name); returns its path. ``whole``: of the whole page, the
    window made as tall as the page for it (``max_height`` pixels of page at most, the
    width unchanged), then given back its size."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ValueError(f"a screenshot's name is a file name, not {name!r}")
    if not whole:
        return _save_png(browser, screenshots_dir(), name)
    size = browser.get_window_size()
    # The window holds the (invisible, in headless mode) toolbars besides the viewport.
    chrome, page_height = browser.execute_script(
        "return [window.outerHeight - window.innerHeight,"
        " document.documentElement.scrollHeight]")
    browser.set_window_size(size["width"], min(page_height, max_height) + chrome)
    try:
        return _save_png(browser, screenshots_dir(), name)
    finally:
        browser.set_window_size(size["width"], size["height"])


def is_png(path: Path) -> bool:
    """``path`` is a non-empty PNG file (by its magic bytes)."""
    data = path.read_bytes()
    return len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, from its IHDR chunk."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# --- the console server ----------------------------------------------------------------


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class ConsoleServer:
    """A running ``kafka-idem console`` (its output goes to files, never to a pipe)."""

    url: str  # http://127.0.0.1:PORT, no trailing slash
    port: int
    proc: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    killed: bool = field(default=False)

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout_text(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 5) -> tuple[int, bytes]:
        """``GET url+path`` (no proxy): the status and the body, also of an error."""
        try:
            with _NO_PROXY.open(self.url + path, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def stop(self) -> int | None:
        """SIGTERM, wait up to 10 s, then SIGKILL; the exit code (None: it had to be
        killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=CONSOLE_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                self.killed = True
        return None if self.killed else self.proc.returncode


def _console_env(env: Mapping[str, str | None] | None, db: DB | None) -> dict[str, str]:
    merged: dict[str, str | None] = {
        **os.environ,
        "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
        "KAFKA_IDEM_DATABASE_URL": db.dsn if db is not None else ADMIN_DSN,
        **(env or {}),
    }
    # The repository on the path (the apps of tests/apps import), after any folder the
    # test names in its own PYTHONPATH (an app written to tmp_path). The kafka_idem
    # imported is the repository's whatever the path: ``python -m`` puts the working
    # directory, the repository root, first.
    own = env.get("PYTHONPATH") if env else None
    paths = [*(own or "").split(os.pathsep), str(ROOT),
             *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    merged["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return {k: v for k, v in merged.items() if v is not None}


class Consoles:
    """Starts ``kafka-idem console`` subprocesses (their output in files under ``folder``)
    and stops them all with :meth:`stop_all`: the body of the ``console_server`` fixture,
    for fixtures of a wider scope too (one console for a module's tests)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.servers: list[ConsoleServer] = []

    def __call__(self, app_spec: str, *, env: Mapping[str, str | None] | None = None,
                 args: Sequence[str] = (), db: DB | None = None) -> ConsoleServer:
        full_env = _console_env(env, db)
        for attempt in range(3):
            n = len(self.servers)
            port = free_port()
            out, err = self.folder / f"console-{n}.out", self.folder / f"console-{n}.err"
            with out.open("wb") as stdout, err.open("wb") as stderr:
                proc = subprocess.Popen(
                    [*CONSOLE_COMMAND, app_spec, "--port", str(port), *args],
                    cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=stdout,
                    stderr=stderr)
            server = ConsoleServer(f"http://127.0.0.1:{port}", port, proc, out, err)
            self.servers.append(server)
            code = _wait_ready(server)
            if code is None:
                return server
            text = server.stderr_text()
            # Another process may take the free port before the console binds it.
            if "Address already in use" in text and attempt < 2:
                continue
            pytest.fail(f"kafka-idem console {app_spec} exited with {code} before it was "
                        f"ready on {server.url}; its stderr:\n{text[-6000:]}", pytrace=False)
        raise AssertionError("unreachable")

    def stop_all(self) -> None:
        """SIGTERM each console still running; fails if one had to be killed."""
        slow = []
        for server in self.servers:
            if server.proc.poll() is not None:
                continue  # ended already (it failed to start, or the test stopped it)
            if server.stop() is None:
                slow.append(f"{server.url} (pid {server.proc.pid}) did not exit within "
                            f"{CONSOLE_STOP_TIMEOUT:.0f}s of SIGTERM and was killed; its "
                            f"stderr:\n{server.stderr_text()[-4000:]}")
        assert all(s.proc.poll() is not None for s in self.servers)
        if slow:
            pytest.fail("\n".join(slow), pytrace=False)


@pytest.fixture
def console_server(tmp_path: Path) -> Iterator[Callable[..., ConsoleServer]]:
    """A factory: ``console_server(app_spec, *, env=None, args=(), db=None)`` starts
    ``python -m kafka_idem.cli console APP_SPEC --port <free port> ARGS`` from the
    repository root, with ``os.environ``, the test services (the broker, and ``db``'s
    database or the admin one) and ``env`` (a ``None`` value removes a variable), waits
    until ``GET /healthz?ready=1`` answers 200 (60 s; if the process ends first the test
    fails with its stderr) and returns a :class:`ConsoleServer`. At teardown each is sent
    SIGTERM and must exit within 10 s (it is killed otherwise, and the test errors); a
    test may also stop one itself, with :meth:`ConsoleServer.stop`. (:class:`Consoles`
    does the same for a fixture of a wider scope.)"""
    consoles = Consoles(tmp_path)
    yield consoles
    consoles.stop_all()


def _wait_ready(server: ConsoleServer) -> int | None:
    """None once ``/healthz?ready=1`` answers 200; the exit code if the process ends
    first. Fails the test (after stopping it) on timeout."""
    deadline = time.monotonic() + CONSOLE_READY_TIMEOUT
    last = "no answer"
    while time.monotonic() < deadline:
        code = server.proc.poll()
        if code is not None:
            return code
        try:
            status, body = server.get("/healthz?ready=1", timeout=2)
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if status == 200:
                return None
            last = f"{status} {body[:500]!r}"
        time.sleep(0.1)
    server.stop()
    pytest.fail(f"kafka-idem console was not ready on {server.url} within "
                f"{CONSOLE_READY_TIMEOUT:.0f}s (last: {last}); its stderr:\n"
                f"{server.stderr_text()[-6000:]}", pytrace=False)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "start" in TIMINGS:
        terminalreporter.write_line(
            f"console browser: scripts/browser.sh install {TIMINGS['install']:.2f}s, "
            f"chromium session start {TIMINGS['start']:.2f}s")
