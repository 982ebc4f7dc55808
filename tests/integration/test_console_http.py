"""The web console at the HTTP level against the real broker and database: its security
model (headers, CSRF, same-origin, read-only, the token and its login, loopback host
names), markup and untrusted bytes escaped on every page, no secret on any page, and
``/healthz``.

One world per module (``world``): the console tests' app run over fresh topics, with
records and dead letters whose keys, payloads, error texts and headers carry markup,
control characters and bytes that are not UTF-8, some written straight to the DLQ by
hand (anyone who can write to the topic can put anything there). Each test starts its
own console (a TestClient over ``create_app``: its lifespan runs) and asserts on HTTP
status and body and on the store's durable state.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg import sql
from pydantic import SecretStr

from kafka_idem.console import security
from tests.conftest import ADMIN_DSN, DB, wait_for
from tests.integration.console_support import (
    OPERATOR,
    SECURITY_HEADERS,
    Page,
    World,
    assert_no_markup_from_data,
    audit_rows,
    console,
    csrf_of,
    finished,
    get,
    job_of,
    order,
    order_key,
    pick,
    post,
    produce_one,
    state,
    status_of,
    stored,
    world,
)

SCRIPT_ORDER = "x<script>alert(1)</script>"
SCRIPT_NOTE = "<script>alert('note')</script><img src=x onerror=alert(2)>"
SCRIPT_COMMENT = "<script>alert('payload')</script>"
CTL_KEY = "t1:order:ctl\x1b[31m<script>alert(7)</script>"
CTL_MESSAGE = "<script>alert(8)</script>\x07bell"
TOKEN = "console-token-0123456789abcdef"
NOT_UTF8_VALUE = b"\xff\xfe<script>raw</script>"


@pytest.fixture(scope="module")
def w(admin: AdminClient, template_db: str) -> Iterator[World]:
    with world(admin, template_db) as w:
        w.produce(
            orders=[(f"o{i}".encode(), order("t1", f"o{i}")) for i in range(5)] + [
                (b"victim", order("t1", "victim", "permanent", note="victim")),
                (b"login", order("t1", "login", "permanent", note="login")),
                (b"csrf-ok", order("t1", "csrf-ok", "permanent", note="csrf")),
                (b"x", order("t1", SCRIPT_ORDER, "permanent", note=SCRIPT_NOTE,
                             comment=SCRIPT_COMMENT)),
            ],
            refunds=[(b"r1", order("t2", "r1"))],
            with_headers=[(b"u", NOT_UTF8_VALUE,
                           [("trace", b"\xff\x00<script>"), ("ctl", b"a\x1b[31mb")])])
        w.run(dead_letters=5)
        stored(w.db, CTL_KEY, message=CTL_MESSAGE)
        # A dead letter written by hand: every part of it is untrusted.
        w.crafted = produce_one(  # type: ignore[attr-defined]
            w.dlq, b"k\x1b[2J<script>", b"\xff\xfe\x00", partition=0, headers=[
                ("idem.error.kind", b"permanent"),
                ("idem.key", b"t1:order:evil\x1b]0;title\x07<script>alert(4)</script>"),
                ("idem.namespace", b"consoled"),
                ("idem.handler", b"<img src=x onerror=alert(6)>"),
                ("idem.error.class", b"<b>Bold</b>"),
                ("idem.error.message", b"<script>alert(5)</script>\x1b[2J"),
                ("idem.original.topic", w.orders.encode()),
                ("x-binary", b"\x80\x81<script>"),
            ])
        yield w


def letter_url(w: World, partition: int, offset: int) -> str:
    return f"/letter?{urlencode({'topic': w.dlq, 'partition': partition, 'offset': offset})}"


def record_url(key: str, ns: str = "consoled") -> str:
    return f"/record?{urlencode({'ns': ns, 'key': key})}"


def letters_by_key(client: Any, w: World) -> dict[bytes | None, tuple[int, int]]:
    """The DLQ's records by Kafka key (each written once here)."""
    from tests.acceptance.conftest import read_all

    return {m.key(): (m.partition(), m.offset()) for m in read_all(w.dlq)}


# --- headers ------------------------------------------------------------------------------


def test_every_response_carries_the_security_headers(w: World) -> None:
    """CSP without inline script (the console's own files only), no framing, no sniffing,
    nothing cached: on pages, error pages, redirects and refusals alike."""
    with console(w.app) as client:
        p, o = letters_by_key(client, w)[b"x"]
        urls = ["/", "/?fragment=1", "/records", "/records?status=failed",
                record_url(order_key("victim")), "/dlq", f"/dlq?topic={quote(w.dlq)}",
                letter_url(w, p, o), f"/redrive?topic={quote(w.dlq)}", "/rerun", "/jobs",
                "/login", "/record?key=no-such-key", "/records?status=bogus",
                "/dlq?topic=not-a-dlq", "/jobs/no-such-job", "/rerun/keys", "/healthz"]
        responses = [(u, client.get(u)) for u in urls]
        responses.append(("POST /rerun/keys", client.post("/rerun/keys", data={"x": "1"})))
        responses.append(("Host evil", client.get("/", headers={"host": "evil.example"})))
        seen = {u: r.status_code for u, r in responses}
        assert {seen["/record?key=no-such-key"], seen["/records?status=bogus"],
                seen["/rerun/keys"], seen["POST /rerun/keys"], seen["Host evil"]} == {
            404, 400, 405, 403}
        for url, r in responses:
            csp = r.headers.get("content-security-policy", "")
            directives = dict(([*d.strip().split(" ", 1), ""])[:2] for d in csp.split(";"))
            assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, url
            assert directives.get("default-src") == "'none'", (url, csp)
            assert directives.get("script-src") == "'self'", (url, csp)
            assert directives.get("frame-ancestors") == "'none'", (url, csp)
            assert directives.get("form-action") == "'self'", (url, csp)
            for name, value in SECURITY_HEADERS.items():
                assert r.headers.get(name) == value, (url, name, r.headers.get(name))


# --- CSRF, same-origin, GET -----------------------------------------------------------------


def test_a_post_without_the_right_csrf_token_or_from_another_site_is_refused(w: World) -> None:
    """A forged re-run of a failed key: no CSRF field, a wrong one, another browser's,
    another site's Origin: each a 403 that changes nothing; then the same form done
    right works (so the refusals were the checks', not the form's)."""
    key = order_key("victim")
    form = {"pick": pick("consoled", key), "reason": "forged"}
    with console(w.app) as client:
        before = state(w.db)
        assert client.post("/rerun/keys", data=form).status_code == 403
        assert post(client, "/rerun/keys", form, csrf=False).status_code == 403
        r = client.post("/rerun/keys", data={**form, "csrf": "0" * 64})
        assert (r.status_code, "CSRF" in r.text) == (403, True)

        # another browser's token: bound to its cookie, not to this one's
        theirs = csrf_of(client)
        client.cookies.clear()
        assert csrf_of(client) != theirs
        assert client.post("/rerun/keys", data={**form, "csrf": theirs}).status_code == 403

        # the right token, from another site
        mine = csrf_of(client)
        r = client.post("/rerun/keys", data={**form, "csrf": mine},
                        headers={"origin": "http://evil.example"})
        assert (r.status_code, "another site" in r.text) == (403, True)
        # an opaque origin (a sandboxed or privacy-stripped page): not this site either
        r = client.post("/rerun/keys", data={**form, "csrf": mine}, headers={"origin": "null"})
        assert (r.status_code, "another site" in r.text) == (403, True)
        assert state(w.db) == before
        assert status_of(w.db, key) == "failed"

        # the same form, right: it writes (same-origin Origin header and all)
        ok = {"pick": pick("consoled", order_key("csrf-ok")), "reason": "done right",
              "csrf": mine}
        r = client.post("/rerun/keys", data=ok, headers={"origin": "http://127.0.0.1"})
        page = finished(client, job_of(r))
        assert page.text("job-sent") == "1", page.html
        [row] = [a for a in audit_rows(w.db, "rerun")
                 if a["idempotency_key"] == order_key("csrf-ok")]
        assert (row["actor"], row["reason"]) == (OPERATOR, "done right")


def test_get_never_changes_state(w: World) -> None:
    """Every write is a POST: the same fields on a GET are refused (405), as is any other
    method, and nothing changes."""
    key = order_key("victim")
    with console(w.app) as client:
        token = csrf_of(client)
        fields = {"pick": pick("consoled", key), "reason": "by GET", "csrf": token,
                  "topic": w.dlq, "kind": "permanent", "dry_run": "1-x"}
        before = state(w.db)
        for path in ("/rerun/keys", "/redrive/dry-run", "/redrive/run", "/rerun/dry-run",
                     "/rerun/run", "/logout"):
            r = client.get(f"{path}?{urlencode(fields)}")
            assert r.status_code == 405, (path, r.status_code)
        for method in ("PUT", "DELETE", "PATCH"):
            r = client.request(method, "/rerun/keys", data=fields)
            assert r.status_code == 405, (method, r.status_code)
        assert client.get("/jobs").text.count('href="/jobs/') == 0  # no job started
        assert state(w.db) == before


# --- read-only -----------------------------------------------------------------------------

WRITE_IDS = ("rerun", "rerun-form", "rerun-picked", "records-form", "bulk-rerun",
             "redrive-filter", "redrive-picked", "redrive-one", "letter-redrive", "dlq-form",
             "confirm", "dry-run")


def test_a_read_only_console_shows_no_write_control_and_refuses_forged_writes(
        w: World) -> None:
    with console(w.app, read_only=True) as client:
        p, o = letters_by_key(client, w)[b"victim"]
        pages = {u: get(client, u) for u in (
            "/records", "/records?status=failed", record_url(order_key("victim")),
            f"/dlq?topic={quote(w.dlq)}", letter_url(w, p, o), "/", "/rerun?kind=permanent",
            f"/redrive?topic={quote(w.dlq)}&kind=permanent")}
        for url, page in pages.items():
            assert page.post_forms() == [], (url, page.post_forms())
            assert page.inputs("pick") == [], url
            assert not [i for i in WRITE_IDS if page.has(i)], url
            assert page.has("read-only"), url
        # the data is there all the same
        assert (("consoled", order_key("victim")) in pages["/records?status=failed"]
                .record_links())
        assert pages[f"/dlq?topic={quote(w.dlq)}"].letter_links()
        assert pages["/rerun?kind=permanent"].has("read-only-note")

        before = state(w.db)
        token = csrf_of(client)  # a valid token: refused for being a write, not for it
        forged = [
            ("/rerun/keys", {"pick": pick("consoled", order_key("victim")), "reason": "x"}),
            ("/redrive/dry-run", {"topic": w.dlq, "kind": "permanent"}),
            ("/rerun/dry-run", {"kind": "permanent"}),
            ("/redrive/run", {"dry_run": "1-x", "reason": "x"}),
            ("/rerun/run", {"dry_run": "1-x", "reason": "x"}),
        ]
        for path, form in forged:
            r = client.post(path, data={**form, "csrf": token})
            assert (r.status_code, "read-only" in r.text) == (403, True), path
        assert "no job since the console started" in get(client, "/jobs").html
        assert state(w.db) == before


# --- the token ---------------------------------------------------------------------------


def with_token(w: World) -> Any:
    return w.app.settings.model_copy(update={"console_token": SecretStr(TOKEN)})


def test_with_a_token_every_page_needs_it(w: World) -> None:
    with console(w.app, with_token(w), ready=False) as client:
        # open: the health check, the login form, the static files
        assert client.get("/healthz").status_code == 200
        assert client.get("/login").status_code == 200
        assert client.get("/static/console.js").status_code == 200
        for url in ("/", "/records", record_url(order_key("victim")),
                    f"/dlq?topic={quote(w.dlq)}", "/jobs", "/rerun"):
            r = client.get(url)
            assert (r.status_code, r.headers.get("www-authenticate")) == (401, "Bearer"), url
            assert "victim" not in r.text
            r = client.get(url, headers={"accept": "text/html,application/xhtml+xml"})
            assert r.status_code == 303, url
            assert r.headers["location"] == f"/login?next={quote(url)}"
            r = client.get(url, headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200, url
            r = client.get(url, headers={"authorization": f"Bearer {TOKEN}x"})
            assert r.status_code == 401, url
            r = client.get(url, headers={"authorization": TOKEN})  # not a bearer
            assert r.status_code == 401, url
        # the open paths open nothing else
        for url in ("/static/%2e%2e/records", "/login/%2e%2e/records", "/healthz/%2e%2e/records",
                    "/static/..%2frecords", "/loginx", "//records", "/Records"):
            r = client.get(url)
            assert r.status_code in (401, 404), (url, r.status_code)
            assert 'id="records"' not in r.text
        # a write without the token: refused before anything is read
        before = state(w.db)
        r = client.post("/rerun/keys", data={"pick": pick("consoled", order_key("victim")),
                                             "reason": "x", "csrf": csrf_of(client)})
        assert r.status_code == 401
        assert state(w.db) == before
        # with a token, a host name other than loopback is served (the token guards it)
        r = client.get("/records", headers={"host": "console.example:8088",
                                            "authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


def login(client: Any, operator: str, token: str, next_: str = "/") -> Any:
    form = get(client, f"/login?{urlencode({'next': next_})}")
    return client.post("/login", data={"operator": operator, "token": token,
                                       "next": form.inputs("next")[0], "csrf": form.csrf})


SESSION = security.cookie_names(8088)[0]  # the console's port: Options' default


def test_the_login_form_sets_a_session_whose_writes_are_audited_with_the_name_typed(
        w: World) -> None:
    key = order_key("login")
    with console(w.app, with_token(w)) as client:
        before = state(w.db)
        r = login(client, "Ada", "wrong-token-0123456789")
        assert r.status_code == 401
        assert Page(r.text).text("login-error") == "wrong token"
        assert SESSION not in client.cookies
        assert client.get("/records").status_code == 401
        r = login(client, "  ", TOKEN)  # no name: nothing to put in the audit trail
        assert r.status_code == 401
        assert SESSION not in client.cookies

        r = login(client, "Ada <b>Lovelace</b>", TOKEN, "/records?status=failed")
        assert (r.status_code, r.headers["location"]) == (303, "/records?status=failed")
        set_cookie = r.headers["set-cookie"]
        assert SESSION in set_cookie
        assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower()
        page = get(client, "/records?status=failed")
        assert "Ada &lt;b&gt;Lovelace&lt;/b&gt;" in page.html  # who is logged in, escaped
        assert state(w.db) == before

        r = post(client, "/rerun/keys", {"pick": pick("consoled", key), "reason": "login"})
        page = finished(client, job_of(r))
        assert page.text("job-sent") == "1", page.html
        [row] = [a for a in audit_rows(w.db, "rerun") if a["idempotency_key"] == key]
        assert (row["actor"], row["reason"]) == ("Ada <b>Lovelace</b> (console)", "login")

        # logging out forgets the session
        r = post(client, "/logout", {})
        assert (r.status_code, r.headers["location"]) == (303, "/login")
        assert SESSION not in client.cookies
        assert client.get("/records").status_code == 401

        # a session cookie whose signature does not hold is no session
        assert login(client, "Ada", TOKEN).status_code == 303
        [cookie] = [c for c in client.cookies.jar if c.name == SESSION]
        assert client.get("/records").status_code == 200
        client.cookies.set(cookie.name, cookie.value[:-4] + "0000", domain=cookie.domain)
        assert client.get("/records").status_code == 401
        name = cookie.value.split(".")[0]  # nor is one naming someone else
        other = cookie.value.replace(name, security.base64.urlsafe_b64encode(b"Eve").decode())
        client.cookies.set(cookie.name, other, domain=cookie.domain)
        assert client.get("/records").status_code == 401


def test_after_the_login_next_never_leaves_the_site(w: World) -> None:
    with console(w.app, with_token(w), ready=False) as client:
        for target in ("//evil.example", "https://evil.example", "/\\evil.example",
                       "\\\\evil.example", "http:/evil.example", "javascript:alert(1)",
                       "evil.example/"):
            form = get(client, f"/login?{urlencode({'next': target})}")
            assert form.inputs("next") == ["/"], target
            r = client.post("/login", data={"operator": "Ada", "token": TOKEN, "next": target,
                                            "csrf": form.csrf})
            assert (r.status_code, r.headers["location"]) == (303, "/"), target
        # a path of the console is where the login goes back to
        form = get(client, "/login?next=/records%3Fstatus%3Dfailed")
        assert form.inputs("next") == ["/records?status=failed"]


# --- host names ----------------------------------------------------------------------------

SERVED = ("127.0.0.1", "127.0.0.1:8088", "localhost", "localhost:8088", "[::1]:8088", "[::1]",
          "127.1.2.3:8088")
REFUSED = ("evil.example", "evil.example:8088", "10.0.0.5:8088", "0.0.0.0:8088",
           # names an attacker controls that start like a loopback one
           "127.0.0.1.evil.example", "127.0.0.1.evil.example:8088",
           "localhost.evil.example:8088", "")


def test_without_a_token_only_loopback_host_names_are_served(w: World) -> None:
    """DNS rebinding: a page of another site whose name now resolves to 127.0.0.1 sends
    its own name as Host; the console serves loopback names only, so it reads nothing."""
    with console(w.app, ready=False) as client:
        for host in SERVED:
            assert client.get("/records", headers={"host": host}).status_code == 200, host
        for host in REFUSED:
            r = client.get("/records", headers={"host": host})
            assert (r.status_code, "loopback" in r.text) == (403, True), host
            assert order_key("victim") not in r.text
            r = client.post("/rerun/keys", headers={"host": host}, data={
                "pick": pick("consoled", order_key("victim")), "reason": "rebound"})
            assert r.status_code == 403, host
        assert status_of(w.db, order_key("victim")) == "failed"


# --- escaping ------------------------------------------------------------------------------


def test_markup_in_keys_payloads_and_errors_is_escaped_on_every_page(w: World) -> None:
    script_key = order_key(SCRIPT_ORDER)
    with console(w.app) as client:
        p, o = letters_by_key(client, w)[b"x"]
        pages = {
            "records": get(client, "/records"),
            "failed": get(client, "/records?status=failed"),
            "by prefix": get(client, "/records?prefix=t1%3Aorder%3Ax"),
            "by key": get(client, f"/records?{urlencode({'key': script_key})}"),
            "record": get(client, record_url(script_key)),
            "dlq": get(client, f"/dlq?topic={quote(w.dlq)}"),
            "dlq by key": get(client, f"/dlq?{urlencode({'topic': w.dlq, 'key': script_key})}"),
            "letter": get(client, letter_url(w, p, o)),
        }
        escaped_key = html.escape(script_key, quote=False)
        for name, page in pages.items():
            assert_no_markup_from_data(page.html)
            assert escaped_key in page.html, name
        for name in ("record", "dlq", "dlq by key", "letter"):
            assert "rejected: &lt;script&gt;alert(" in pages[name].html, name
            assert "&lt;img src=x onerror=alert(2)&gt;" in pages[name].html, name
        # the payload, decoded by the handler: its fields escaped
        assert "&lt;script&gt;alert(&#39;payload&#39;)&lt;/script&gt;" in pages["letter"].html
        assert SCRIPT_COMMENT in pages["letter"].text("payload")  # as text, not markup
        assert pages["letter"].text("record-status") == "failed"

        # re-run it: its confirmation page and its job's page escape it too
        r = post(client, "/rerun/keys", {"pick": pick("consoled", script_key)})
        assert r.status_code == 200
        assert_no_markup_from_data(r.text)
        assert escaped_key in r.text
        job = finished(client, job_of(post(client, "/rerun/keys", {
            "pick": pick("consoled", script_key), "reason": "<script>alert('r')</script>"})))
        assert_no_markup_from_data(job.html)
        assert "&lt;script&gt;alert(&#39;r&#39;)&lt;/script&gt;" in job.html
        for url in ("/jobs", "/"):
            assert_no_markup_from_data(get(client, url).html)


def test_control_characters_and_bytes_that_are_not_utf8_are_shown_escaped(w: World) -> None:
    """Untrusted bytes: a key with terminal escapes (a record written by hand), the DLQ
    record the consumer wrote for a value that is not UTF-8 (its headers neither), and a
    dead letter written to the topic by hand, every header of it hostile."""
    with console(w.app) as client:
        by_key = letters_by_key(client, w)
        undecodable = get(client, letter_url(w, *by_key[b"u"]))
        crafted = get(client, letter_url(w, *w.crafted))  # type: ignore[attr-defined]
        pages = {
            "records": get(client, "/records?status=failed"),
            "record": get(client, record_url(CTL_KEY)),
            "dlq": get(client, f"/dlq?topic={quote(w.dlq)}"),
            "undecodable": undecodable, "crafted": crafted,
            "job": finished(client, job_of(post(client, "/rerun/keys", {
                "pick": pick("consoled", CTL_KEY), "reason": "ctl"}))),
            "jobs": get(client, "/jobs"), "overview": get(client, "/"),
        }
        for name, page in pages.items():
            assert_no_markup_from_data(page.html)
            raw = [c for c in page.html if (ord(c) < 32 and c not in "\n\t") or ord(c) == 127]
            assert raw == [], (name, raw)
        shown_key = html.escape(CTL_KEY.replace("\x1b", "\\x1b"), quote=False)
        for name in ("records", "record", "job"):
            assert shown_key in pages[name].html, name
        assert "&lt;script&gt;alert(8)&lt;/script&gt;\\x07bell" in pages["record"].html

        # the value is not UTF-8: its bytes in base64; so is the header that is not
        assert undecodable.text("payload-base64") == "//48c2NyaXB0PnJhdzwvc2NyaXB0Pg=="
        assert base64_of(NOT_UTF8_VALUE) == undecodable.text("payload-base64")
        headers = header_cells(undecodable)
        assert headers["trace"] == "base64:" + base64_of(b"\xff\x00<script>")
        assert headers["ctl"] == "a\\x1b[31mb"
        assert undecodable.text("no-record").startswith("the dead letter names no key")

        # the crafted one: every part shown as text
        c = header_cells(crafted)
        assert c["idem.key"] == "t1:order:evil\\x1b]0;title\\x07<script>alert(4)</script>"
        assert c["idem.handler"] == "<img src=x onerror=alert(6)>"
        assert c["idem.error.message"] == "<script>alert(5)</script>\\x1b[2J"
        assert c["x-binary"] == "base64:" + base64_of(b"\x80\x81<script>")
        assert crafted.text("payload-base64") == base64_of(b"\xff\xfe\x00")
        assert "k\\x1b[2J&lt;script&gt;" in crafted.html  # its Kafka key
        assert "&lt;b&gt;Bold&lt;/b&gt;" in pages["dlq"].html
        assert "&lt;script&gt;alert(5)&lt;/script&gt;\\x1b[2J" in pages["dlq"].html


def base64_of(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


def header_cells(page: Page) -> dict[str, str]:
    """The letter page's headers table, as its text (name -> value)."""
    import re

    table = page.html[page.html.index('id="headers"'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr><td>(.*?)</td><td class=\"value\">(.*?)</td></tr>", table)
    return {html.unescape(k): html.unescape(v) for k, v in rows}


# --- secrets -------------------------------------------------------------------------------

PASSWORD = "S3cret-pw-7Zq"


@pytest.fixture
def password_db(template_db: str) -> Iterator[tuple[DB, str]]:
    """A database of its own, and a URL for it with a password (the local server trusts
    local connections: it ignores the password, which the console must never show)."""
    import uuid

    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    url = (f"postgresql://{info['user']}:{PASSWORD}@{info.get('host', '127.0.0.1')}:"
           f"{info.get('port', '5432')}/{name}")
    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1")  # the server takes it
    try:
        yield DB(name), url
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def test_no_page_shows_the_database_password(
        w: World, password_db: tuple[DB, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages, error pages with the store unreachable, the overview's store error, a job
    that fails: the password is on none of them."""
    from kafka_idem.console import state as console_state

    monkeypatch.setattr(console_state, "POOL_TIMEOUT", 1.0)
    db, url = password_db
    settings = w.app.settings.model_copy(update={"database_url": SecretStr(url)})
    assert settings.dsn == url
    bodies: list[str] = []

    def seen(r: Any) -> Any:
        bodies.append(r.text)
        return r

    with console(w.app, settings) as client:
        for u in ("/", "/records", "/records?status=failed", f"/dlq?topic={quote(w.dlq)}",
                  "/jobs", "/record?key=nope"):
            seen(client.get(u))
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
                sql.Identifier(db.name)))
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s", (db.name,))
        for u in ("/records", "/records?status=failed", record_url(order_key("victim")),
                  "/records"):
            r = seen(client.get(u))
            assert r.status_code == 503, (u, r.status_code, r.text[-500:])
            assert "StoreUnavailable" in Page(r.text).text("error")
        wait_for(lambda: "StoreUnavailable" in seen(client.get("/?fragment=1")).text,
                 timeout=30, what="the overview to show the store's error")
        job = finished(client, job_of(post(client, "/rerun/dry-run", {"kind": "permanent"})))
        bodies.append(job.html)
        assert "StoreUnavailable" in job.text("job-error")
        seen(client.get("/jobs"))
    for body in bodies:
        assert PASSWORD not in body
        assert quote(PASSWORD, safe="") not in body


# --- health --------------------------------------------------------------------------------


def test_healthz_is_up_at_once_and_ready_once_the_dlq_index_caught_up(w: World) -> None:
    with console(w.app, ready=False) as client:
        r = client.get("/healthz")
        assert (r.status_code, r.text) == (200, "ok")
        wait_for(lambda: client.get("/healthz?ready=1").status_code == 200, timeout=60,
                 what="ready", interval=0.05)
        # ready means caught up: every record on the DLQ is in the index
        page = get(client, "/dlq")
        from tests.acceptance.conftest import read_all

        total = len(read_all(w.dlq))
        assert f'<td class="num">{total}</td><td class="num">0</td>' in page.html


def test_healthz_is_not_ready_while_the_broker_is_unreachable(w: World) -> None:
    settings = w.app.settings.model_copy(update={"bootstrap_servers": "127.0.0.1:1"})
    with console(w.app, settings, ready=False) as client:
        assert client.get("/healthz").status_code == 200
        for _ in range(5):
            r = client.get("/healthz?ready=1")
            assert (r.status_code, r.text) == (503, "indexing the dead-letter topics")
