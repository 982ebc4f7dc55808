"""Pausing and resuming a handler from the web console, at the HTTP level: the overview
shows the app's handlers, paused or running (who, why, since); Pause (a reason
required) and Resume are audited with the console's operator, behind its CSRF check,
refused by a read-only console; a script's (Authorization: Bearer) audited under
``--actor``. That members honour a pause is
``tests/integration/test_pause.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from pydantic import SecretStr

from tests.integration.console_support import (
    OPERATOR,
    World,
    audit_rows,
    console,
    csrf_of,
    get,
    post,
    world,
)


@pytest.fixture(scope="module")
def w(admin: AdminClient, template_db: str) -> Iterator[World]:
    with world(admin, template_db) as w:
        yield w


def pauses(w: World) -> list[dict[str, Any]]:
    return w.db.rows("SELECT namespace, handler, reason, actor FROM kafka_idem.handler_pauses "
                     "ORDER BY handler")


def handler_row(page_text: str, name: str) -> str:
    start = page_text.index(f'<tr data-handler="{name}">')
    return page_text[start:page_text.index("</tr>", start)]


def test_the_overview_pauses_and_resumes_a_handler_audited_with_the_operator(w: World) -> None:
    with console(w.app, ready=False) as client:
        page = get(client, "/")
        assert page.has("handlers")
        assert "running" in handler_row(page.html, "order")
        assert "/handlers/pause" in page.post_forms()

        for form, why in (({"handler": "order", "reason": "  "}, "reason"),
                          ({"handler": "nope", "reason": "x"}, "none of this app")):
            r = post(client, "/handlers/pause", form)
            assert r.status_code == 400 and why in r.text
        r = post(client, "/handlers/pause", {"handler": "order", "reason": "x"}, csrf=False)
        assert r.status_code == 403
        assert pauses(w) == [] and audit_rows(w.db, "pause") == []

        r = post(client, "/handlers/pause", {"handler": "order", "reason": "PSP <down>"})
        assert r.status_code == 303 and r.headers["location"] == "/#handlers"
        assert pauses(w) == [{"namespace": "consoled", "handler": "order",
                              "reason": "PSP <down>", "actor": OPERATOR}]
        [row] = audit_rows(w.db, "pause")
        assert (row["actor"], row["reason"], row["selection"]) == (
            OPERATOR, "PSP <down>", {"handler": "order"})

        page = get(client, "/")
        shown = handler_row(page.html, "order")
        assert "paused" in shown and "PSP &lt;down&gt;" in shown and OPERATOR in shown
        assert "/handlers/resume" in page.post_forms()
        assert "running" in handler_row(page.html, "refund")

        r = post(client, "/handlers/resume", {"handler": "order"})
        assert r.status_code == 303
        assert pauses(w) == []
        [row] = audit_rows(w.db, "resume")
        assert row["actor"] == OPERATOR and row["selection"]["handler"] == "order"


def test_a_read_only_console_shows_the_pauses_and_refuses_to_change_them(w: World) -> None:
    with console(w.app, ready=False) as client:
        assert post(client, "/handlers/pause", {"handler": "refund", "reason": "r"}
                    ).status_code == 303
    try:
        with console(w.app, ready=False, read_only=True) as client:
            page = get(client, "/")
            assert "paused" in handler_row(page.html, "refund")
            assert page.post_forms() == []
            token = csrf_of(client)
            for path in ("/handlers/resume", "/handlers/pause"):
                r = client.post(path, data={"handler": "refund", "reason": "x", "csrf": token})
                assert (r.status_code, "read-only" in r.text) == (403, True), path
            assert [p["handler"] for p in pauses(w)] == ["refund"]
    finally:
        with console(w.app, ready=False) as client:
            post(client, "/handlers/resume", {"handler": "refund"})


def test_a_pause_sent_with_the_bearer_token_is_audited_under_the_actor(w: World) -> None:
    """No one logs in with a bearer token: ``--actor`` (kafka-idem console --help) names it."""
    token = "pause-token-0123456789abcdef"
    settings = w.app.settings.model_copy(update={"console_token": SecretStr(token)})
    bearer = {"authorization": f"Bearer {token}"}
    with console(w.app, settings, ready=False) as client:
        r = client.post("/handlers/pause", data={"handler": "refund", "reason": "by script"},
                        headers=bearer)  # no CSRF token: a browser never sends the header
        assert r.status_code == 303, r.text
        try:
            assert [(p["handler"], p["actor"]) for p in pauses(w)] == [("refund", OPERATOR)]
            [row] = [r for r in audit_rows(w.db, "pause") if r["reason"] == "by script"]
            assert row["actor"] == OPERATOR
        finally:
            r = client.post("/handlers/resume", data={"handler": "refund"}, headers=bearer)
            assert r.status_code == 303, r.text
    assert pauses(w) == []
