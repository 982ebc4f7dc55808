"""The browser of the console's tests, on its own: a real Chromium (Debian's, through
chromedriver) against a tiny site served here on 127.0.0.1 fills in a form and submits
it, shows markup-looking text as text, takes a screenshot, and enforces a
Content-Security-Policy (an inline script is refused and reported, the same-origin
script runs): what the console's pages will rely on.
"""

from __future__ import annotations

import html
import os
import signal
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import NoSuchDriverException
from selenium.webdriver import Chrome, ChromeOptions
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.console.conftest import (
    TIMINGS,
    WINDOW,
    is_png,
    no_selenium_manager,
    png_size,
    reset_browser,
    screenshot,
    screenshots_dir,
    start_browser,
    stop_browser,
    wait_for,
    wait_text,
)

HOSTILE = "<script>document.title='pwned'</script>"

FORM = """<!doctype html><html><head><title>form</title></head><body>
<form method="post" action="/submit">
  <label>Name <input id="name" name="name" type="text"></label>
  <button id="send" type="submit">Send</button>
</form></body></html>"""

SENT = """<!doctype html><html><head><title>sent</title></head><body>
<p id="sent">You sent: {value}</p></body></html>"""

ESCAPED = """<!doctype html><html><head><title>escaped</title></head><body>
<p id="shown">{text}</p></body></html>"""

TALL = """<!doctype html><html><head><title>tall</title></head>
<body style="margin:0"><div id="tall" style="height:3000px">tall</div></body></html>"""

# The same-origin script runs first (parser-blocking) and listens for CSP violations, so
# the refusal of the inline script after it is seen by the page itself.
CSP_PAGE = """<!doctype html><html><head><title>csp</title>
<script src="/app.js"></script>
<script>document.documentElement.dataset.inline = "ran";</script>
</head><body><p id="body">csp</p></body></html>"""

APP_JS = """document.documentElement.dataset.external = "ran";
document.addEventListener("securitypolicyviolation", (e) => {
  const seen = document.documentElement.dataset.violations || "";
  document.documentElement.dataset.violations = seen + e.violatedDirective + ";";
});
"""


class Handler(BaseHTTPRequestHandler):
    def _send(self, body: str, ctype: str = "text/html; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/form":
            self._send(FORM, headers={"Set-Cookie": "visited=1; Path=/"})
        elif path == "/escaped":
            self._send(ESCAPED.format(text=html.escape(HOSTILE)))
        elif path == "/csp":
            self._send(CSP_PAGE, headers={"Content-Security-Policy": "script-src 'self'"})
        elif path == "/nocsp":  # the control: the same page without the policy
            self._send(CSP_PAGE)
        elif path == "/tall":
            self._send(TALL)
        elif path == "/app.js":
            self._send(APP_JS, "text/javascript; charset=utf-8")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        form = urllib.parse.parse_qs(self.rfile.read(length).decode())
        self._send(SENT.format(value=html.escape(form.get("name", [""])[0])))

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_a_form_is_filled_in_submitted_and_its_value_shown(page: Chrome, site: str) -> None:
    page.get(f"{site}/form")
    field = wait_for(page, "#name")
    value = 'Zoë <b>&"quotes"'
    field.send_keys(value)
    page.find_element(By.CSS_SELECTOR, "#send").click()
    shown = wait_text(page, "#sent", "You sent:")
    assert shown.text == f"You sent: {value}"
    assert page.title == "sent"
    assert page.current_url == f"{site}/submit"
    assert is_png(screenshot(page, "browser-smoke-form"))


def test_markup_in_text_is_shown_as_text_and_not_run(page: Chrome, site: str) -> None:
    page.get(f"{site}/escaped")
    assert wait_for(page, "#shown").text == HOSTILE
    assert page.title == "escaped"
    assert page.find_elements(By.CSS_SELECTOR, "#shown script") == []


def test_a_screenshot_is_a_png_of_the_window(page: Chrome, site: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    page.get(f"{site}/escaped")
    wait_for(page, "#shown")
    path = screenshot(page, "browser-smoke")
    assert path == screenshots_dir() / "browser-smoke.png"
    assert is_png(path)
    # The viewport: new headless Chromium keeps room for the browser's own (invisible)
    # toolbars inside the window, so it is less tall than the window.
    viewport = page.execute_script("return [window.innerWidth, window.innerHeight]")
    assert png_size(path) == tuple(viewport)
    assert viewport[0] == WINDOW[0]
    with pytest.raises(ValueError):
        screenshot(page, "../outside")
    monkeypatch.setenv("KAFKA_IDEM_SCREENSHOTS", str(tmp_path / "docs-images"))
    assert screenshot(page, "x.png") == tmp_path / "docs-images" / "x.png"
    assert is_png(tmp_path / "docs-images" / "x.png")


def test_a_screenshot_of_the_whole_page_is_as_tall_as_the_page_up_to_a_cap(
        page: Chrome, site: str) -> None:
    page.get(f"{site}/tall")
    wait_for(page, "#tall")
    assert png_size(screenshot(page, "browser-smoke-tall", whole=True, max_height=1200)) == (
        WINDOW[0], 1200)
    assert page.get_window_size() == {"width": WINDOW[0], "height": WINDOW[1]}  # given back
    page.get(f"{site}/escaped")  # shorter than the window: the viewport
    wait_for(page, "#shown")
    viewport = page.execute_script("return [window.innerWidth, window.innerHeight]")
    assert png_size(screenshot(page, "browser-smoke-short", whole=True)) == tuple(viewport)


def test_selenium_manager_is_never_run() -> None:
    """Without a driver path selenium would run Selenium Manager (a downloader): the guard
    around every start refuses it."""
    with no_selenium_manager(), pytest.raises(NoSuchDriverException) as caught:
        Chrome(service=Service(), options=ChromeOptions())
    assert "Selenium Manager" in str(caught.value.__cause__)


def test_the_content_security_policy_refuses_inline_scripts_and_reports_it(
        page: Chrome, site: str) -> None:
    page.get(f"{site}/nocsp")
    wait_for(page, "#body")
    root = page.find_element(By.TAG_NAME, "html")
    assert root.get_attribute("data-inline") == "ran"  # without the policy, both run
    assert root.get_attribute("data-external") == "ran"
    assert root.get_attribute("data-violations") is None
    page.get_log("browser")

    page.get(f"{site}/csp")
    wait_for(page, "#body")
    root = page.find_element(By.TAG_NAME, "html")
    WebDriverWait(page, 10).until(lambda _: root.get_attribute("data-violations"))
    assert root.get_attribute("data-external") == "ran"  # same-origin: allowed
    assert root.get_attribute("data-inline") is None  # inline: refused
    assert root.get_attribute("data-violations") == "script-src-elem;"
    console = [e["message"] for e in page.get_log("browser")]
    # Chromium's words have changed over the versions ("Refused to execute inline
    # script because it violates ...", now "Executing inline script violates ...").
    assert any("inline script" in m and "Content Security Policy" in m
               and "script-src 'self'" in m for m in console), console


def test_reset_clears_the_cookies_of_every_site(page: Chrome, site: str) -> None:
    page.get(f"{site}/form")
    assert page.get_cookie("visited") is not None
    reset_browser(page)
    assert page.current_url == "about:blank"
    page.get(f"{site}/escaped")
    assert page.get_cookies() == []


def test_waiting_for_what_never_comes_fails_and_says_where(page: Chrome, site: str) -> None:
    page.get(f"{site}/escaped")
    with pytest.raises(pytest.fail.Exception, match=r"no element '#nope' after 0.3s at http"):
        wait_for(page, "#nope", timeout=0.3)
    with pytest.raises(pytest.fail.Exception, match="the page reads:\n<script>"):
        wait_text(page, "#shown", "absent", timeout=0.3)


def test_the_browser_started_from_debians_packages(page: Chrome) -> None:
    caps = page.capabilities
    assert caps["browserName"] in ("chrome", "chromium")
    driver_major = caps["chrome"]["chromedriverVersion"].split(".")[0]
    assert driver_major == caps["browserVersion"].split(".")[0]
    assert page.get_window_size() == {"width": WINDOW[0], "height": WINDOW[1]}
    assert page.timeouts.implicit_wait == 0 and page.timeouts.page_load == 30
    assert set(TIMINGS) == {"install", "start"}
    assert Path(page.service.path).name == "chromedriver"  # type: ignore[attr-defined]


def test_a_browser_whose_driver_died_is_still_ended(
        tmp_path: Path, browser_install: tuple[str, str]) -> None:
    """If quitting fails (here chromedriver was killed), Chromium's processes, now
    orphans, are found by their profile folder and ended by pid."""
    profile = tmp_path / "profile"
    profile.mkdir()
    driver = start_browser(profile)
    driver.get("about:blank")
    os.kill(driver.service.process.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    ours = with_marker(str(profile))
    assert ours, "no Chromium process carries the profile folder"
    signalled = stop_browser(driver, str(profile))
    assert signalled  # (a short-lived helper process may end by itself meanwhile)
    assert with_marker(str(profile)) == []


def with_marker(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (marker.encode() in (entry / "cmdline").read_bytes()
                        and " Z " not in (entry / "stat").read_text().rsplit(")", 1)[1][:3]):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found
