"""The web console end to end, in a real Chromium, through clicks and forms: an operator
finds what failed, re-drives or re-runs it once its cause is fixed, and what they did is
in the store and its audit trail under their name; what must be refused (no token, no
CSRF token, a read-only console) is refused and changes nothing; what producers and
handlers wrote is shown as text and never run; the overview refreshes itself.

One shop for the module (``tests.apps.console_shop``: an order with an amount below one
fails for good until the order is "fixed", a row the test inserts): a fresh database
and topic, one ``kafka-idem run`` member and one ``kafka-idem console`` (actor
``alice``, overview refresh 1 s) that run through all the tests. Each test produces
orders of its own (its own order ids) and asserts on its own keys only, so the tests do
not depend on each other's order; the consoles with other options (a token,
``--read-only``) browse the same shop.

The main flow (the first test) takes the screenshots of docs/how-to/console.md; with
``KAFKA_IDEM_SCREENSHOTS=docs/images/console`` they are written there (docs/development.md).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg import sql
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver import Chrome
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from kafka_idem.console.forms import encode_cursor
from tests.acceptance.conftest import headers_of, read_all
from tests.apps.console_shop import CREATE, encode
from tests.conftest import ADMIN_DSN, DB, ROOT, Members, Topics, member_env, produce
from tests.conftest import wait_for as poll
from tests.console.conftest import (
    Consoles,
    ConsoleServer,
    is_png,
    screenshot,
    wait_for,
    wait_text,
)
from tests.integration.test_metrics import free_port

SHOP = "tests.apps.console_shop:app"
NAMESPACE = "shop"
ACTOR = "alice"
TENANT = "t1"
TOKEN = "e2e-token-0123456789-abcdef"
HOSTILE = "<script>window.__pwned = 1</script><img src=x onerror=window.__pwned=2>"
WRITE_IDS = ("#rerun-picked", "#redrive-picked", "#rerun", "#redrive-one", "#dry-run",
             "#redrive-filter")


def key(order: str) -> str:
    return f"{TENANT}:pay:{order}"


def console_env(topic: str, group: str) -> dict[str, str | None]:
    return {"CONSOLE_SHOP_TOPIC": topic, "KAFKA_IDEM_GROUP_ID": group,
            "KAFKA_IDEM_CONSOLE_TOKEN": None}


# --- the shop ----------------------------------------------------------------------------


@dataclass
class Shop:
    """The module's shop: its database, topic, member and console."""

    db: DB
    topic: str
    dlq: str
    group: str
    console: ConsoleServer
    members: Members

    @property
    def console_env(self) -> dict[str, str | None]:
        """A console's variables: the shop's topic and group, no token."""
        return console_env(self.topic, self.group)

    def order(self, *orders: tuple[str, int] | tuple[str, int, str]) -> list[str]:
        """Produce ``(order_id, amount[, note])``s; their keys."""
        produce(self.topic, [(o[0].encode(), encode(TENANT, *o)) for o in orders])
        return [key(o[0]) for o in orders]

    def fail(self, *orders: tuple[str, int] | tuple[str, int, str]) -> list[str]:
        """Produce orders that fail and wait until each key is failed (permanent) and
        dead-lettered; their keys."""
        keys = self.order(*orders)
        self.wait_failed(keys)
        return keys

    def wait_failed(self, keys: list[str]) -> None:
        poll(lambda: all(self.status(k) == "failed" for k in keys), timeout=60,
             what=f"{keys} failed")
        poll(lambda: set(keys) <= {headers_of(m).get("idem.key") for m in read_all(self.dlq)},
             timeout=30, what=f"{keys} dead-lettered")
        for k in keys:
            assert self.record(k)["error_kind"] == "permanent"

    def wait_status(self, keys: list[str], status: str, timeout: float = 60) -> None:
        poll(lambda: all(self.status(k) == status for k in keys), timeout=timeout,
             what=f"{keys} {status}")

    def fix(self, orders: list[str]) -> None:
        """The cause of these orders' failures is fixed."""
        with psycopg.connect(self.db.dsn, autocommit=True) as conn:
            for o in orders:
                conn.execute("INSERT INTO console_shop.fixed VALUES (%s)", (o,))

    def record(self, k: str) -> dict[str, Any]:
        rows = self.db.rows("SELECT * FROM kafka_idem.task_idempotency WHERE namespace = %s "
                            "AND idempotency_key = %s", (NAMESPACE, k))
        assert len(rows) == 1, (k, rows)
        return rows[0]

    def status(self, k: str) -> str | None:
        rows = self.db.rows("SELECT status FROM kafka_idem.task_idempotency "
                            "WHERE idempotency_key = %s", (k,))
        return rows[0]["status"] if rows else None

    def audit(self, keys: list[str]) -> list[dict[str, Any]]:
        return self.db.rows("SELECT * FROM kafka_idem.admin_audit WHERE idempotency_key = "
                            "ANY(%s) ORDER BY id", (keys,))

    def paid(self, orders: list[str]) -> dict[str, int]:
        rows = self.db.rows("SELECT order_id, count(*) AS n FROM console_shop.paid "
                            "WHERE order_id = ANY(%s) GROUP BY 1", (orders,))
        return {r["order_id"]: r["n"] for r in rows}


@pytest.fixture(scope="module")
def shop_db(template_db: str) -> Iterator[DB]:
    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    db = DB(name)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
    yield db
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


@pytest.fixture(scope="module")
def shop(shop_db: DB, admin: AdminClient,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    """The module's shop, its member running and its console up (no token, actor
    ``alice``, the overview sampled every second)."""
    tmp = tmp_path_factory.mktemp("console-e2e")
    topics = Topics(admin)
    members = Members(tmp)
    consoles = Consoles(tmp)
    try:
        # Names like the how-to's (shop.orders, group shop), fresh for each run.
        topic = topics(partitions=2, prefix="shop.orders")
        group = f"shop-{uuid.uuid4().hex[:6]}"
        members.start(SHOP, member_env(shop_db, topic, CONSOLE_SHOP_TOPIC=topic), group=group)
        console = consoles(SHOP, db=shop_db, args=("--actor", ACTOR, "--refresh", "1"),
                           env=console_env(topic, group))
        yield Shop(shop_db, topic, f"{topic}.dlq", group, console, members)
    finally:
        consoles.stop_all()
        members.stop_all()
        topics.delete_all()


@pytest.fixture(scope="module")
def token_console(shop: Shop, tmp_path_factory: pytest.TempPathFactory,
                  ) -> Iterator[ConsoleServer]:
    """A console of the shop on 0.0.0.0 with a token (the overview sampled every second)."""
    consoles = Consoles(tmp_path_factory.mktemp("console-token"))
    try:
        yield consoles(SHOP, db=shop.db, args=("--addr", "0.0.0.0", "--refresh", "1"),
                       env={**shop.console_env, "KAFKA_IDEM_CONSOLE_TOKEN": TOKEN})
    finally:
        consoles.stop_all()


@pytest.fixture
def member_alive(shop: Shop) -> Iterator[None]:
    """The member must still run after the test (a crash would fail it, with its log)."""
    yield
    proc = shop.members.procs[0]
    assert proc.poll() is None, f"the member ended ({proc.returncode}):\n{shop.members.logs()}"


# --- browsing ------------------------------------------------------------------------------


def until(page: Chrome, check: Callable[[], Any], what: str, timeout: float = 30,
          reload: bool = False) -> Any:
    """Poll ``check`` (reloading the page first each time if ``reload``) until it gives
    something truthy; fail with ``what`` and the page on timeout."""
    def attempt(_: Any) -> Any:
        if reload:
            page.refresh()
        try:
            return check()
        except WebDriverException:  # the page changed under the check (stale, or gone)
            return None

    try:
        return WebDriverWait(page, timeout, poll_frequency=0.25).until(attempt)
    except TimeoutException:
        body = page.find_element(By.TAG_NAME, "body").text[:3000]
        pytest.fail(f"timed out after {timeout}s waiting for {what}, at "
                    f"{page.current_url}:\n{body}", pytrace=False)


def click(page: Chrome, css: str) -> None:
    """Click what does not leave the page (a checkbox, a summary)."""
    wait_for(page, css).click()


def go(page: Chrome, target: str | WebElement, timeout: float = 20) -> None:
    """Click a link or a submit button (``target``: it, or its CSS selector) and wait
    until the page it leads to replaced this one and is loaded."""
    page.execute_script("document.documentElement.dataset.left = 'not yet'")
    (wait_for(page, target) if isinstance(target, str) else target).click()
    try:
        # Asked while the page changes, the browser may answer with an error: ask again.
        WebDriverWait(page, timeout, ignored_exceptions=(WebDriverException,)).until(
            lambda _: page.execute_script("return document.readyState === 'complete'"
                                          " && !document.documentElement.dataset.left"))
    except TimeoutException:
        pytest.fail(f"clicking {target} led nowhere within {timeout}s, at "
                    f"{page.current_url}", pytrace=False)


def choose(page: Chrome, css: str, text: str) -> None:
    Select(wait_for(page, css)).select_by_visible_text(text)


def type_into(page: Chrome, css: str, text: str) -> None:
    field = wait_for(page, css)
    field.clear()
    field.send_keys(text)


def row_of(page: Chrome, table: str, text: str) -> WebElement:
    """The row of ``table`` one of whose links reads ``text``."""
    for tr in page.find_elements(By.CSS_SELECTOR, f"{table} tbody tr"):
        if any(a.text == text for a in tr.find_elements(By.TAG_NAME, "a")):
            return tr
    pytest.fail(f"no row of {table} links {text!r}; the table reads:\n"
                f"{page.find_element(By.CSS_SELECTOR, table).text}", pytrace=False)


def log_in(page: Chrome, operator: str) -> None:
    """On the login form: log in as ``operator``, with the right token."""
    type_into(page, "#operator", operator)
    type_into(page, "#token", TOKEN)
    go(page, "#login")


def who(page: Chrome) -> tuple[str, bool]:
    """Who the header says is logged in, and whether it offers to log out."""
    name = page.find_element(By.CSS_SELECTOR, "header .who").text.removesuffix("log out")
    return name.strip(), bool(page.find_elements(By.CSS_SELECTOR, "header .who form"))


def links(page: Chrome, css: str) -> list[str]:
    return [a.text for a in page.find_elements(By.CSS_SELECTOR, css)]


def ids_present(page: Chrome, ids: tuple[str, ...]) -> list[str]:
    return [i for i in ids if page.find_elements(By.CSS_SELECTOR, i)]


def forge_post(page: Chrome, action: str, fields: dict[str, str]) -> None:
    """Submit a form the test builds in the page (as a script of the page could): a POST
    of ``fields`` to ``action``."""
    page.execute_script(
        "const f = document.createElement('form'); f.method = 'post'; f.action = arguments[0];"
        "for (const [n, v] of Object.entries(arguments[1])) {"
        "  const i = document.createElement('input'); i.type = 'hidden'; i.name = n;"
        "  i.value = v; f.appendChild(i); }"
        "document.body.appendChild(f); f.submit();", action, fields)


def response_status(page: Chrome) -> int:
    """The HTTP status of the page the browser shows (the Navigation Timing entry)."""
    status: int = page.execute_script(
        "return performance.getEntriesByType('navigation')[0].responseStatus")
    return status


def wait_job_done(page: Chrome, timeout: float = 60) -> None:
    """On a job's page: its end (the page reloads itself when the job ends)."""
    until(page, lambda: page.find_elements(By.CSS_SELECTOR, "#job-state")
          and page.find_element(By.CSS_SELECTOR, "#job-state").text != "running"
          and page.find_elements(By.CSS_SELECTOR, "#job-state + [data-final]")
          and not page.find_elements(By.CSS_SELECTOR, "#job[data-refresh-url]"),
          "the job's end", timeout=timeout)
    state = page.find_element(By.CSS_SELECTOR, "#job-state").text
    assert state == "done", page.find_element(By.TAG_NAME, "main").text


def health(page: Chrome, label: str) -> str | None:
    """The overview's number labelled ``label`` (None while it is not there)."""
    value: str | None = page.execute_script(
        "for (const tr of document.querySelectorAll('#health tr')) {"
        "  if (tr.querySelector('th').textContent === arguments[0])"
        "    return tr.querySelector('td').textContent.trim(); }"
        "return null;", label)
    return value


def table_rows(page: Chrome, css: str) -> list[list[str]]:
    rows: list[list[str]] = page.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0] + ' tbody tr'))"
        ".map(tr => Array.from(tr.cells).map(td => td.textContent.trim()));", css)
    return rows


def browser_errors(page: Chrome) -> list[str]:
    """What the browser logged since the last call (the page's script errors, refused
    content, failed requests), but the favicon the console does not have."""
    return [e["message"] for e in page.get_log("browser") if "/favicon.ico " not in e["message"]]


def shot(page: Chrome, name: str) -> Path:
    path = screenshot(page, name, whole=True)
    assert is_png(path), path
    return path


# --- the main flow -------------------------------------------------------------------------


def test_failed_orders_fixed_and_redriven_from_the_console(
        page: Chrome, shop: Shop, member_alive: None) -> None:
    """Orders fail for good and are dead-lettered; the cause is fixed; an operator sees
    them on the overview, finds them in the dead letters (kind=permanent), reads one,
    re-drives every letter the filter matches (permanent keys included) after its dry
    run, with a reason: the keys succeed once each, audited with the operator's name."""
    # The letters of this test only, whichever tests ran before it.
    since = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%S")
    amounts = {"o-1": 12, "o-2": 0, "o-3": 30, "o-4": -5, "o-5": 7, "o-6": 0, "o-7": 18,
               "o-8": -1}
    bad = [o for o, amount in amounts.items() if amount < 1]
    bad_keys = [key(o) for o in bad]
    shop.order(*amounts.items())
    shop.wait_failed(bad_keys)
    shop.wait_status([key(o) for o in amounts if o not in bad], "succeeded")
    shop.fix(bad)

    # The overview: the failed count and the DLQ topic (the page samples by itself). Run
    # first (as for the docs' screenshots), the counts are this test's; else they also
    # count the failures of the tests before, as the store and the DLQ do.
    failed = shop.db.value("SELECT count(*) FROM kafka_idem.task_idempotency "
                           "WHERE status = 'failed' AND error_kind = 'permanent'")
    letters = len(read_all(shop.dlq))  # all of the last hour, all permanent
    assert failed >= len(bad) and letters >= len(bad)
    page.get(shop.console.url + "/")
    until(page, lambda: health(page, "failed: permanent") == str(failed),
          f"the overview counting {failed} permanent failures")
    until(page, lambda: f"permanent {letters}" in page.find_element(
        By.CSS_SELECTOR, "#dlq-recent").text, "the DLQ's letters of the last hour")
    assert shop.dlq in links(page, "#dlq-recent a")
    until(page, lambda: page.find_element(By.CSS_SELECTOR, "#group-state").text == "stable"
          and page.find_element(By.CSS_SELECTOR, "#total-lag").text == "0",
          "the group stable and caught up")
    shot(page, "overview")

    # The records, then those that failed (the filter form).
    go(page, "#nav-records")
    wait_for(page, "#records")
    assert set(map(key, amounts)) <= set(links(page, "#records td.key a"))
    shot(page, "records")
    choose(page, "#f-status", "failed")
    go(page, "#search")
    until(page, lambda: "status=failed" in page.current_url, "the failed records")
    assert set(bad_keys) <= set(links(page, "#records td.key a"))
    for row in table_rows(page, "#records"):
        assert row[3] == "failed" and row[6].startswith(
            "permanent: Permanent: amount must be positive, not "), row

    # The dead letters, filtered by kind.
    go(page, "#nav-dlq")
    go(page, f"#dlq-topics a[href='/dlq?topic={shop.dlq}']")
    choose(page, "#f-kind", "permanent")
    type_into(page, "#f-since", since)
    go(page, "#filter")
    until(page, lambda: "kind=permanent" in page.current_url, "the filtered letters")
    until(page, lambda: set(bad_keys) <= set(links(page, "#letters td.key a")),
          "every failed key's letter indexed", reload=True)
    rows = table_rows(page, "#letters")
    assert len(rows) == len(bad), rows
    assert {r[3] for r in rows} == {"permanent"}
    assert all(r[9].startswith("amount must be positive") for r in rows), rows
    shot(page, "dead-letters")
    filtered = page.current_url

    # One letter: its payload decoded, its key's record failed.
    order = "o-4"
    go(page, row_of(page, "#letters", key(order)).find_element(By.CSS_SELECTOR, "a.letter-link"))
    payload = wait_for(page, "#payload").text
    assert f'"order_id": "{order}"' in payload and '"amount": -5' in payload, payload
    assert wait_for(page, "#record-status").text == "failed"
    assert "inside the app's" in page.find_element(By.CSS_SELECTOR, "#trust").text
    headers = dict(table_rows(page, "#headers"))  # type: ignore[arg-type]
    assert headers["idem.key"] == key(order)
    assert headers["idem.error.kind"] == "permanent"
    shot(page, "letter")
    go(page, "#record-link")
    assert wait_for(page, "#status").text == "failed"
    assert page.find_elements(By.CSS_SELECTOR, "#rerun")
    assert table_rows(page, "#audit") == [["no admin action on this key"]]
    shot(page, "record")
    page.back()
    page.back()
    until(page, lambda: page.current_url == filtered, "back on the filtered letters")

    # Re-drive what the filter matches: the dry run, then the run with a reason.
    go(page, "#redrive-filter")
    assert Select(wait_for(page, "#r-kind")).first_selected_option.text == "permanent"
    click(page, "#include-permanent")
    go(page, "#dry-run")
    wait_job_done(page)
    summary = page.find_element(By.CSS_SELECTOR, "#job-summary").text
    assert f"would send {len(bad)}" in summary and f"matched {len(bad)}" in summary, summary
    by_kind = table_rows(page, "#by-kind")
    heads = [th.text for th in page.find_elements(By.CSS_SELECTOR, "#by-kind thead th")]
    assert by_kind == [["permanent", str(len(bad))]] and heads == ["kind", "rerun"], (
        heads, by_kind)
    click(page, "#job details summary")  # what would be sent, opened for the screenshot
    would = table_rows(page, "#job details table")
    assert sorted(r[1] for r in would) == sorted(bad_keys), would
    assert {(r[2], r[3], r[4]) for r in would} == {("permanent", "rerun", shop.topic)}, would
    assert all(shop.status(k) == "failed" for k in bad_keys)  # a dry run changes nothing
    assert shop.audit(bad_keys) == []
    reason = "INC-42: amounts below one are refunds now"
    type_into(page, "#reason", reason)
    shot(page, "dry-run")
    go(page, "#confirm")
    until(page, lambda: "/jobs/" in page.current_url and not page.find_elements(
        By.CSS_SELECTOR, "#confirm"), "the re-drive's job")
    wait_job_done(page)
    assert f"sent {len(bad)}" in page.find_element(By.CSS_SELECTOR, "#job-summary").text
    audit = table_rows(page, "#job-audit")
    reruns = [r for r in audit if r[2] == "rerun"]
    assert sorted(r[4] for r in reruns) == sorted(bad_keys), audit
    assert {(r[1], r[5], r[6]) for r in reruns} == {(f"{ACTOR} (console)", reason, "failed")}
    assert [(r[1], r[5]) for r in audit if r[2] == "replay"] == [
        (f"{ACTOR} (console)", reason)], audit
    shot(page, "redrive-done")

    # The member takes them: they succeed, once each.
    go(page, "#nav-records")
    choose(page, "#f-status", "succeeded")
    go(page, "#search")
    until(page, lambda: set(bad_keys) <= set(links(page, "#records td.key a")),
          "the re-driven keys succeeded", reload=True, timeout=60)
    shop.wait_status(bad_keys, "succeeded")
    assert shop.paid(list(amounts)) == dict.fromkeys(amounts, 1)
    rows = shop.audit(bad_keys)
    assert sorted(r["idempotency_key"] for r in rows) == sorted(bad_keys)
    for r in rows:
        assert (r["action"], r["actor"], r["reason"], r["previous_status"]) == (
            "rerun", f"{ACTOR} (console)", reason, "failed")
        assert r["previous_error"].startswith("permanent: ")
    assert browser_errors(page) == []  # no script error, no refused content on any page


# --- re-running chosen records ---------------------------------------------------------------


def test_failed_records_ticked_and_rerun_by_hand(page: Chrome, shop: Shop,
                                                 member_alive: None) -> None:
    """Two failed records ticked on the records page (status=failed) and re-run with a
    reason: the job lists both as re-run with its audit rows, and the keys, fixed,
    succeed."""
    orders = ["hand-1", "hand-2"]
    keys = shop.fail(("hand-1", 0), ("hand-2", -3))
    others = shop.fail(("hand-3", 0))  # failed too, not ticked: left as it is
    shop.fix([*orders, "hand-3"])

    page.get(shop.console.url + "/records")
    choose(page, "#f-status", "failed")
    go(page, "#search")
    until(page, lambda: "status=failed" in page.current_url, "the failed records")
    for k in keys:
        row_of(page, "#records", k).find_element(By.CSS_SELECTOR, "input[name=pick]").click()
    go(page, "#rerun-picked")
    picked = table_rows(page, "#picked")
    assert sorted(picked) == [[NAMESPACE, k, "failed"] for k in keys], picked
    assert shop.audit(keys) == []  # nothing done before the reason is given
    reason = "INC-43: refunds allowed"
    type_into(page, "#reason", reason)
    go(page, "#confirm")
    until(page, lambda: "/jobs/" in page.current_url, "the re-run's job")
    wait_job_done(page)
    assert page.find_element(By.CSS_SELECTOR, "#job-summary").text == "re-ran 2, refused 0"
    results = table_rows(page, "#results")
    assert sorted(r[1] for r in results) == keys, results
    assert all(r[2].startswith(f"re-run: republished to {shop.topic} from {shop.dlq}")
               for r in results), results
    audit = table_rows(page, "#job-audit")
    assert sorted((r[1], r[2], r[4], r[5], r[6]) for r in audit) == [
        (f"{ACTOR} (console)", "rerun", k, reason, "failed") for k in keys], audit

    assert {shop.status(k) for k in keys} <= {"retryable_failed", "processing", "succeeded"}
    shop.wait_status(keys, "succeeded")
    assert shop.paid(orders) == dict.fromkeys(orders, 1)
    rows = shop.audit([*keys, *others])
    assert sorted((r["idempotency_key"], r["action"], r["actor"], r["reason"]) for r in rows) == [
        (k, "rerun", f"{ACTOR} (console)", reason) for k in keys]
    assert rows[0]["selection"]["via"].startswith("console job ")
    assert shop.status(others[0]) == "failed"
    assert browser_errors(page) == []


# --- the token -------------------------------------------------------------------------------


def test_a_console_on_another_address_needs_a_token_to_start(shop: Shop) -> None:
    """Without ``KAFKA_IDEM_CONSOLE_TOKEN``, ``--addr 0.0.0.0`` is refused before anything
    is served: exit 2, naming the setting."""
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_IDEM_CONSOLE_TOKEN"}
    env.update({"KAFKA_IDEM_DATABASE_URL": shop.db.dsn, "CONSOLE_SHOP_TOPIC": shop.topic,
                "PYTHONPATH": str(ROOT)})
    done = subprocess.run(
        [sys.executable, "-m", "kafka_idem.cli", "console", SHOP, "--addr", "0.0.0.0",
         "--port", str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "console_token" in done.stderr and "KAFKA_IDEM_CONSOLE_TOKEN" in done.stderr


def test_a_console_with_a_token_logs_in_and_audits_the_operator(
        page: Chrome, shop: Shop, token_console: ConsoleServer, member_alive: None) -> None:
    """On 0.0.0.0 with a token: the browser is sent to the login form; a wrong token is
    refused; the right one and a name open the page asked for, and a re-run done then
    is audited with that name."""
    [k] = shop.fail(("tok-1", 0))
    shop.fix(["tok-1"])
    console = token_console
    page.get(console.url + "/records?status=failed")
    wait_for(page, "#login-form")
    assert page.current_url.startswith(console.url + "/login?next=")
    assert not page.find_elements(By.CSS_SELECTOR, "#records")
    assert who(page) == ("", False)  # nobody is logged in
    type_into(page, "#operator", "bob")
    type_into(page, "#token", TOKEN[:-1] + "X")
    go(page, "#login")
    assert wait_text(page, "#login-error", "wrong token").text == "wrong token"
    assert response_status(page) == 401
    assert page.get_cookie(f"kafka_idem_session_{console.port}") is None

    log_in(page, "bob")
    wait_for(page, "#records")
    assert page.current_url == console.url + "/records?status=failed"
    assert who(page) == ("bob", True)
    session = page.get_cookie(f"kafka_idem_session_{console.port}")
    assert session is not None and session["httpOnly"] and session["sameSite"] == "Strict"

    go(page, row_of(page, "#records", k).find_element(By.CSS_SELECTOR, "td.key a"))
    reason = "INC-44: checked with the customer"
    type_into(page, "#rerun-reason", reason)
    go(page, "#rerun")
    until(page, lambda: "/jobs/" in page.current_url, "the re-run's job")
    wait_job_done(page)
    audit = table_rows(page, "#job-audit")
    assert [(r[1], r[2], r[4], r[5]) for r in audit] == [("bob (console)", "rerun", k, reason)]
    shop.wait_status([k], "succeeded")
    [row] = shop.audit([k])
    assert (row["actor"], row["reason"], row["previous_status"]) == (
        "bob (console)", reason, "failed")

    # Logged out, the pages are closed again.
    go(page, page.find_element(By.CSS_SELECTOR, "header form[action='/logout'] button"))
    wait_for(page, "#login-form")
    assert who(page) == ("", False)
    page.get(console.url + "/records")
    wait_for(page, "#login-form")


def test_a_page_that_refreshes_itself_goes_to_the_login_when_the_session_ends(
        page: Chrome, token_console: ConsoleServer) -> None:
    """The overview, open when the session ends (it expired, or the console restarted:
    its cookies' key is new): its next refresh loads the login page as a page (not the
    login page inside the overview), and the login brings the overview back."""
    console = token_console
    page.get(console.url + "/")
    log_in(page, "carol")
    assert page.current_url == console.url + "/"
    until(page, lambda: health(page, "processing, live lease") is not None, "the first sample")
    page.execute_cdp_cmd("Network.clearBrowserCookies", {})  # the session ends
    until(page, lambda: page.current_url.startswith(console.url + "/login?next=")
          and page.find_elements(By.CSS_SELECTOR, "#login-form"),
          "the login page after the session ended")
    assert len(page.find_elements(By.TAG_NAME, "header")) == 1
    assert page.find_element(By.CSS_SELECTOR, "#login-form input[name=next]").get_attribute(
        "value") == "/"
    log_in(page, "carol")
    assert page.current_url == console.url + "/"
    wait_for(page, "#overview")
    assert len(page.find_elements(By.TAG_NAME, "header")) == 1
    assert page.find_elements(By.CSS_SELECTOR, "#login-form") == []


# --- CSRF ------------------------------------------------------------------------------------


def test_a_write_without_its_csrf_token_is_refused_and_changes_nothing(
        page: Chrome, shop: Shop) -> None:
    """The re-run form of a failed record, its hidden csrf field removed (then given
    another value): 403, and the record is still failed, with no audit row and no job."""
    [k] = shop.fail(("csrf-1", 0))
    page.get(shop.console.url + f"/records?key={k}")
    go(page, row_of(page, "#records", k).find_element(By.CSS_SELECTOR, "td.key a"))
    record_url = page.current_url
    # Removed; then another value of the same shape (another browser's token, say).
    for forge in ("el.remove()", "el.value = [...el.value].map(c => c === '0' ? '1' : '0')"
                                 ".join('')"):
        page.get(record_url)
        wait_for(page, "#rerun-form")
        page.execute_script(
            f"const el = document.querySelector('#rerun-form input[name=csrf]'); {forge};")
        type_into(page, "#rerun-reason", "forged")
        go(page, "#rerun")
        wait_text(page, "body", "refused: missing or wrong CSRF token")
        assert response_status(page) == 403
        assert page.current_url == shop.console.url + "/rerun/keys"
    assert shop.status(k) == "failed"
    assert shop.audit([k]) == []
    page.get(shop.console.url + "/jobs")
    assert not [t for t in links(page, "#jobs a") if "csrf-1" in t]


# --- markup in what producers and handlers wrote -----------------------------------------


def test_markup_in_a_payload_an_error_and_a_key_is_shown_as_text_and_never_run(
        page: Chrome, shop: Shop, member_alive: None) -> None:
    """A payload and an error message holding a script and an image with a handler, and
    a key holding an image: the records, record, letter, dead-letter, job and overview
    pages show them as text, no element is made of them, nothing of them ran
    (``window.__pwned`` unset) and the browser logged no refused script and no image
    request."""
    hostile_order = "xss-2<img src=x onerror=window.__pwned=3>"
    k, k2 = shop.fail(("xss-1", 0, HOSTILE), (hostile_order, 0))
    visited = []

    def nothing_ran(what: str) -> None:
        visited.append(what)
        assert page.execute_script("return typeof window.__pwned") == "undefined", what
        # The console's pages have no image and no script in their body: any is markup
        # from the data.
        assert page.find_elements(By.CSS_SELECTOR, "body script, body img") == [], what
        # What a refused inline script or handler (CSP) or an image's request would log.
        logged = [e["message"] for e in page.get_log("browser")]
        assert not [m for m in logged if "Content Security Policy" in m or "__pwned" in m
                    or "/x " in m or m.endswith("/x")], (what, logged)

    page.get(shop.console.url + "/records")
    type_into(page, "#f-prefix", f"{TENANT}:pay:xss-")
    go(page, "#search")
    until(page, lambda: sorted(links(page, "#records td.key a")) == [k, k2],
          "the records found by prefix")
    nothing_ran("records")

    go(page, row_of(page, "#records", k).find_element(By.CSS_SELECTOR, "td.key a"))
    wait_for(page, "#fields")
    nothing_ran("record")
    fields = dict(r for r in table_rows(page, "#fields") if len(r) == 2)
    assert HOSTILE in fields["error_message"], fields

    go(page, page.find_element(By.CSS_SELECTOR, "#letters a"))
    wait_for(page, "#payload")
    nothing_ran("letter")
    assert f'"note": "{HOSTILE}"' in page.find_element(By.CSS_SELECTOR, "#payload").text
    headers = dict(table_rows(page, "#headers"))  # type: ignore[arg-type]
    assert HOSTILE in headers["idem.error.message"]
    assert HOSTILE in page.find_element(By.CSS_SELECTOR, "#state").text

    page.get(shop.console.url + f"/dlq?topic={shop.dlq}&handler=pay&kind=permanent")
    until(page, lambda: {k, k2} <= set(links(page, "#letters td.key a")),
          "the letters in the DLQ list", reload=True)
    nothing_ran("dead letters")
    messages = {r[5]: r[9] for r in table_rows(page, "#letters")}
    assert "<script>window.__pwned = 1</script>" in messages[k], messages

    # The hostile key: its letter, its record, its re-run's job and the overview's
    # latest jobs show it as text.
    go(page, row_of(page, "#letters", k2).find_element(By.CSS_SELECTOR, "a.letter-link"))
    wait_for(page, "#headers")
    nothing_ran("letter of the hostile key")
    assert dict(table_rows(page, "#headers"))["idem.key"] == k2  # type: ignore[arg-type]
    assert page.find_element(By.CSS_SELECTOR, "#letter td.key").text == hostile_order
    go(page, "#record-link")
    wait_for(page, "#rerun-form")
    nothing_ran("record of the hostile key")
    assert page.find_element(By.TAG_NAME, "h1").text == f"Record {k2}"
    shop.fix([hostile_order])
    type_into(page, "#rerun-reason", "INC-45: <b>not bold</b>")
    go(page, "#rerun")
    until(page, lambda: "/jobs/" in page.current_url, "the re-run's job")
    wait_job_done(page)
    nothing_ran("job")
    assert page.find_element(By.TAG_NAME, "h1").text == f"Re-run {k2}"
    audit = table_rows(page, "#job-audit")
    assert [(r[4], r[5]) for r in audit] == [(k2, "INC-45: <b>not bold</b>")], audit
    go(page, "#nav-overview")
    until(page, lambda: f"Re-run {k2}" in links(page, "#overview li a"), "the latest jobs")
    nothing_ran("overview")
    assert visited == ["records", "record", "letter", "dead letters",
                       "letter of the hostile key", "record of the hostile key", "job",
                       "overview"]
    shop.wait_status([k2], "succeeded")  # settled before the next test


# --- read-only -------------------------------------------------------------------------------


def test_a_read_only_console_has_no_write_button_and_refuses_a_forged_write(
        page: Chrome, shop: Shop, console_server: Callable[..., ConsoleServer]) -> None:
    """``--read-only`` (with a token, as the how-to's console for other people): no write
    form or button on the overview, records, a failed key's record, the dead letters or
    a letter, the badge on each; writes forged in the page with the page's own valid
    CSRF value (the log-out form's) are refused (403, read-only) and change nothing."""
    [k] = shop.fail(("ro-1", 0))
    console = console_server(SHOP, db=shop.db, args=("--read-only",),
                             env={**shop.console_env, "KAFKA_IDEM_CONSOLE_TOKEN": TOKEN})

    def no_write_button(what: str) -> None:
        assert wait_for(page, "#read-only").text == "read-only", what
        assert ids_present(page, WRITE_IDS) == [], what
        assert page.find_elements(By.CSS_SELECTOR, "main form[method=post], main "
                                  "button[type=submit]:not(#search):not(#filter)") == [], what

    page.get(console.url + "/")
    log_in(page, "rita")
    wait_for(page, "#overview")
    no_write_button("overview")
    go(page, "#nav-records")
    choose(page, "#f-status", "failed")
    go(page, "#search")
    until(page, lambda: k in links(page, "#records td.key a"), "the failed record")
    assert page.find_elements(By.CSS_SELECTOR, "#records input[type=checkbox]") == []
    no_write_button("records")
    go(page, row_of(page, "#records", k).find_element(By.CSS_SELECTOR, "td.key a"))
    assert wait_for(page, "#status").text == "failed"
    no_write_button("record of a failed key")
    go(page, "#nav-dlq")
    go(page, f"#dlq-topics a[href='/dlq?topic={shop.dlq}']")
    until(page, lambda: k in links(page, "#letters td.key a"), "the letter", reload=True)
    no_write_button("dead letters")
    go(page, row_of(page, "#letters", k).find_element(By.CSS_SELECTOR, "a.letter-link"))
    assert wait_for(page, "#record-status").text == "failed"
    no_write_button("letter")

    # Writes forged in the page, with the page's own csrf value: refused.
    csrf = page.find_element(By.CSS_SELECTOR, "header form[action='/logout'] input[name=csrf]"
                             ).get_attribute("value")
    assert csrf
    for action, fields in [
            ("/rerun/keys", {"pick": encode_cursor([NAMESPACE, k]), "reason": "forged"}),
            ("/redrive/dry-run", {"topic": shop.dlq, "key": k, "include_permanent": "on"})]:
        forge_post(page, action, {**fields, "csrf": csrf})
        wait_text(page, "body", "refused: this console is read-only")
        assert response_status(page) == 403
        page.back()
    assert shop.status(k) == "failed"
    assert shop.audit([k]) == []
    page.get(console.url + "/jobs")
    assert table_rows(page, "#jobs") == [["no job since the console started"]]
    # The value was good: the one POST a read-only console takes from a logged-in
    # browser, the logout, takes it.
    forge_post(page, "/logout", {"csrf": csrf})
    wait_for(page, "#login-form")
    assert page.current_url == console.url + "/login"


# --- the overview refreshes itself ---------------------------------------------------------


def test_the_overview_shows_new_failures_without_a_reload(page: Chrome, shop: Shop) -> None:
    page.get(shop.console.url + "/")
    until(page, lambda: health(page, "processing, live lease") is not None, "the first sample")
    # Nothing of this module is on its way (each test waits for its own outcome): the
    # count is steady.
    before = int(health(page, "failed: permanent") or 0)
    page.execute_script("window.__same_page = 'yes'")
    keys = shop.fail(("ov-1", 0), ("ov-2", -2))
    until(page, lambda: health(page, "failed: permanent") == str(before + len(keys)),
          f"the overview counting {before + len(keys)} permanent failures")
    assert page.execute_script("return window.__same_page") == "yes"  # not reloaded
    assert page.current_url == shop.console.url + "/"
