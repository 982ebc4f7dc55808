"""The console's records page against the real store: keyset pagination walks every
record exactly once, and each filter (status, namespace, handler, exact key, key prefix,
time range) shows exactly the records a brute-force SQL query over the table selects.
Then the store queries behind it (``browse``, ``browse_prefix``, ``collation_is_bytewise``)
against brute-force ``ORDER BY`` over a table of their own with ties in ``updated_at``,
keys full of LIKE wildcards and code points around the range bounds, under C and ICU
collations.
"""

from __future__ import annotations

import datetime as dt
import html
import random
import re
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg import sql

from kafka_idem.admin.migrate import migrate
from kafka_idem.admin.operations import STATUSES as ORDER
from kafka_idem.store import Store
from tests.conftest import ADMIN_DSN, dsn_for, empty_database, wait_for
from tests.integration.console_support import (
    World,
    console,
    finished,
    get,
    job_of,
    order,
    order_key,
    post,
    state,
    walk,
    world,
)

Rec = tuple[str, str]  # (namespace, key)

OK_ORDERS = [f"o{i:03d}" for i in range(130)]
# Keys whose prefixes hold LIKE's wildcards, the key template's separator (":", which the
# template writes as %3A, and "%", which it writes as %25), non-ASCII, and their
# neighbours in code point order (what a range bound could wrongly let in or out).
PREFIX_ORDERS = ["p%1", "p%2", "px25", "p_1", "pz1", "p:1", "p:2", "pé1", "pé2", "pe1", "pê1",
                 "日本1", "日本2", "日1", "z1", "z2", "{1", "sp ", " sp"]


@pytest.fixture(scope="module")
def w(admin: AdminClient, template_db: str) -> Iterator[World]:
    with world(admin, template_db) as w:
        w.produce(
            orders=[(o.encode(), order("t1", o)) for o in OK_ORDERS + PREFIX_ORDERS]
            + [(f"f{i}".encode(), order("t1", f"f{i}", "permanent")) for i in range(5)],
            refunds=[(f"r{i}".encode(), order("t2", f"r{i}")) for i in range(6)]
            + [(f"rf{i}".encode(), order("t2", f"rf{i}", "permanent")) for i in range(2)])
        w.run(dead_letters=7)
        # Another namespace (another app on the same store): copies of some records.
        with psycopg.connect(w.db.dsn) as conn:
            conn.execute("SET session_replication_role = replica")  # no guard triggers
            conn.execute("CREATE TEMP TABLE x AS SELECT * FROM kafka_idem.task_idempotency "
                          "WHERE idempotency_key LIKE 't1:order:o00%' "
                          "OR idempotency_key LIKE 't2:refund:%'")
            conn.execute("UPDATE x SET namespace = 'other'")
            conn.execute("INSERT INTO kafka_idem.task_idempotency SELECT * FROM x")
        yield w


@pytest.fixture(scope="module")
def client(w: World) -> Iterator[Any]:
    with console(w.app) as c:
        yield c


def in_db(w: World, where: str = "TRUE", params: Any = None) -> list[Rec]:
    """The records ``where`` selects, most recently changed first (the page's order)."""
    rows = w.db.rows(f"SELECT namespace, idempotency_key FROM kafka_idem.task_idempotency "
                     f"WHERE {where} ORDER BY updated_at DESC, namespace DESC, "
                     f"idempotency_key DESC", params)
    return [(r["namespace"], r["idempotency_key"]) for r in rows]


def listed(client: Any, **query: str) -> tuple[list[Rec], int]:
    """Every record the records page lists for ``query``, over every page, in page
    order; and how many pages."""
    pages, _ = walk(client, f"/records?{urlencode(query)}")
    return [rec for p in pages for rec in p.record_links()], len(pages)


def test_the_next_page_links_walk_every_record_exactly_once(w: World, client: Any) -> None:
    everything = in_db(w)
    assert len(everything) > 150
    got, pages = listed(client)
    assert pages == len(everything) // 50 + 1 > 2
    assert got == everything  # each once, most recently changed first

    succeeded = in_db(w, "status = 'succeeded'")
    got, pages = listed(client, status="succeeded")
    assert (got, pages > 2) == (succeeded, True)


def test_status_namespace_and_handler_filters(w: World, client: Any) -> None:
    cases: list[tuple[dict[str, str], str, tuple[Any, ...]]] = [
        ({"status": "failed"}, "status = 'failed'", ()),
        ({"status": "processing"}, "status = 'processing'", ()),
        ({"namespace": "other"}, "namespace = 'other'", ()),
        ({"handler": "refund"}, "handler = 'refund'", ()),
        ({"namespace": "consoled", "handler": "refund"},
         "namespace = 'consoled' AND handler = 'refund'", ()),
        ({"namespace": "other", "handler": "order"}, "namespace = 'other' AND handler = 'order'",
         ()),
        ({"namespace": "consoled", "handler": "refund", "status": "failed"},
         "namespace = 'consoled' AND handler = 'refund' AND status = 'failed'", ()),
        ({"namespace": "nobody"}, "FALSE", ()),
    ]
    for query, where, params in cases:
        expected = in_db(w, where, params)
        got, _ = listed(client, **query)
        assert got == expected, query
    assert len(in_db(w, "namespace = 'other' AND handler = 'order'")) == 10
    assert len(in_db(w, "namespace = 'consoled' AND handler = 'refund' AND status = 'failed'")) == 2
    r = client.get("/records?status=bogus")
    assert r.status_code == 400


def test_an_exact_key(w: World, client: Any) -> None:
    for key in (order_key("p%1"), order_key("p_1"), order_key("pé1"), order_key("sp "),
                order_key(" sp"), "t2:refund:r1"):
        expected = in_db(w, "idempotency_key = %s", (key,))
        assert expected, key
        got, _ = listed(client, key=key)
        assert sorted(got) == sorted(expected), key
        # the link of each row opens that record
        for ns, k in got:
            page = get(client, f"/record?{urlencode({'ns': ns, 'key': k})}")
            assert page.text("status") in ("succeeded", "failed"), key
    assert listed(client, key="t2:refund:r1", namespace="other")[0] == [("other", "t2:refund:r1")]
    assert listed(client, key="t2:refund:r1", status="failed")[0] == []
    assert listed(client, key="t2:refund:r1", handler="order")[0] == []
    assert listed(client, key=order_key("p%"))[0] == []  # a key, not a prefix


def test_a_key_prefix_is_a_prefix_of_the_text_never_a_pattern(w: World, client: Any) -> None:
    prefixes = ["t1:order:p%25", "t1:order:p%", "t1:order:p_", "t1:order:p%3A", "t1:order:pé",
                "t1:order:pe", "t1:order:日", "t1:order:日本", "t1:order:z", "t1:order:o1",
                "t1:order:sp", "t1:order: ", "t2:", "t", "%", "_", "t1:order:p%251",
                "nothing-like-it"]
    for prefix in prefixes:
        expected = sorted(r for r in in_db(w) if r[1].startswith(prefix))
        got, _ = listed(client, prefix=prefix)
        assert got == expected, prefix  # by namespace and key
    # the wildcards were literal: p%25 is not p<anything>25, p_ is not p<any one character>
    assert [k for _, k in listed(client, prefix="t1:order:p%25")[0]] == [
        order_key("p%1"), order_key("p%2")]
    assert [k for _, k in listed(client, prefix="t1:order:p_")[0]] == [order_key("p_1")]
    assert [k for _, k in listed(client, prefix="t1:order:pé")[0]] == [
        order_key("pé1"), order_key("pé2")]
    # more than a page of them, each once
    got, pages = listed(client, prefix="t1:order:o", namespace="consoled")
    assert (got, pages) == ([("consoled", order_key(o)) for o in OK_ORDERS], 3)
    got, pages = listed(client, prefix="t1:order:o")  # both namespaces: consoled's first
    assert (len(got), len(set(got)), pages) == (140, 140, 3)
    # with the other filters
    got, _ = listed(client, prefix="t2:refund:r", namespace="consoled", status="failed")
    assert got == [("consoled", "t2:refund:rf0"), ("consoled", "t2:refund:rf1")]
    got, _ = listed(client, prefix="t2:", handler="refund", namespace="other")
    assert got == sorted(r for r in in_db(w, "namespace = 'other' AND handler = 'refund'"))


def test_a_time_range(w: World, client: Any) -> None:
    times = sorted({r["updated_at"] for r in w.db.rows(
        "SELECT updated_at FROM kafka_idem.task_idempotency")})
    since, until = times[len(times) // 4], times[3 * len(times) // 4]
    for query, where, params in [
        ({"since": since.isoformat()}, "updated_at >= %s", (since,)),
        ({"until": until.isoformat()}, "updated_at < %s", (until,)),
        ({"since": since.isoformat(), "until": until.isoformat()},
         "updated_at >= %s AND updated_at < %s", (since, until)),
        ({"since": since.isoformat(), "status": "succeeded"},
         "updated_at >= %s AND status = 'succeeded'", (since,)),
        ({"since": since.isoformat(), "prefix": "t1:order:o"},
         "updated_at >= %s AND starts_with(idempotency_key, 't1:order:o')", (since,)),
    ]:
        expected = in_db(w, where, params)
        assert 0 < len(expected) < len(in_db(w)), query
        got, _ = listed(client, **query)
        if "prefix" in query:
            expected = sorted(expected)
        assert got == expected, query
    # a time without an offset is UTC (the form's datetime-local)
    naive = since.astimezone(dt.UTC).replace(tzinfo=None).isoformat()
    assert listed(client, since=naive)[0] == in_db(w, "updated_at >= %s", (since,))
    r = client.get("/records?since=yesterday")
    assert (r.status_code, "2026-12-01T10:00" in r.text) == (400, True)


def test_a_damaged_page_link_is_bad_input_not_a_server_error(client: Any) -> None:
    for after in ("not base64!", "WyJ4Il0=", "eyJhIjogMX0=", "WzEsIDIsIDNd", "W10=",
                  "WyIyMDI2LTEyLTA1VDEwOjMwOjAwKzAwOjAwIiwgMSwgMl0="):
        for extra in ({}, {"prefix": "t1:"}):
            r = client.get(f"/records?{urlencode({**extra, 'after': after})}")
            assert r.status_code == 400, (after, extra, r.status_code)


def test_the_bulk_rerun_link_keeps_every_filter_the_rerun_takes(w: World, client: Any) -> None:
    """Namespace, handler, error kind, key prefix, since and until go to the bulk re-run's
    form, from there to its dry run, which selects by them (a dry run: nothing changes)."""
    failed = w.db.rows("SELECT last_failure_at AS at FROM kafka_idem.task_idempotency "
                       "WHERE namespace = 'consoled' AND status = 'failed' AND handler = 'order'")
    assert len(failed) == 5
    first, last = min(r["at"] for r in failed), max(r["at"] for r in failed)
    hour = dt.timedelta(hours=1)
    for since, until, selected in ((first - hour, last + hour, 5), (last + hour, None, 0)):
        shown = {"status": "failed", "namespace": "consoled", "handler": "order",
                 "error_kind": "permanent", "prefix": "t1:order:f",
                 "since": since.isoformat()} | ({"until": until.isoformat()} if until else {})
        link = get(client, f"/records?{urlencode(shown)}").href("bulk-rerun")
        assert link is not None and link.startswith("/rerun?"), link
        carried = dict(parse_qsl(link.split("?", 1)[1]))
        expected = {"namespace": "consoled", "handler": "order", "kind": "permanent",
                    "key_prefix": "t1:order:f", "since": shown["since"]} | (
                        {"until": shown["until"]} if until else {})
        assert carried == expected
        form = get(client, link)
        assert "<option selected>permanent</option>" in form.html
        assert "<option selected>order</option>" in form.html
        fields = {k: form.inputs(k) for k in ("namespace", "key_prefix", "since", "until")}
        assert fields == {k: [carried.get(k, "")] for k in fields}
        before = state(w.db)
        sent = {"kind": "permanent", "handler": "order", **{k: v[0] for k, v in fields.items()}}
        page = finished(client, job_of(post(client, "/rerun/dry-run", sent)))
        assert f"selected {selected} failed key(s)" in page.text("job-summary"), page.html
        title = html.unescape(page.html)
        for k, v in expected.items():
            assert f"{k}={datetime_of(v) if k in ('since', 'until') else v}" in title, (k, v)
        assert state(w.db) == before


def datetime_of(text: str) -> str:
    return dt.datetime.fromisoformat(text).isoformat()


# --- the store queries ---------------------------------------------------------------------

STATUSES = ("processing", "succeeded", "retryable_failed", "failed")
ALPHABET = ["a", "b", "z", "Z", "9", "%", "_", ":", "é", "ê", "日", "{", " ", "\U0010ffff",
            "\ud7ff", "\ue000"]
NAMESPACES = ["a", "b", "ns%", "ns_"]


def fill(conn: Any, schema: str, table: str, n: int = 400, seed: int = 7) -> None:
    """``n`` records written straight into the table (no guard trigger: any status at
    any time), their ``updated_at`` drawn from a dozen instants: many ties."""
    rnd = random.Random(seed)
    base = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)
    instants = [base + dt.timedelta(seconds=s, microseconds=u)
                for s in range(6) for u in (0, 1)]
    t = sql.Identifier(schema, table)
    conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(t))
    seen = set()
    rows = []
    while len(rows) < n:
        ns = rnd.choice(NAMESPACES)
        key = "".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(1, 4)))
        if (ns, key) in seen:
            continue
        seen.add((ns, key))
        status = rnd.choice(STATUSES)
        token = uuid.uuid4()
        rows.append((ns, key, "v1:x", status, token if status == "processing" else None,
                     token if status == "succeeded" else None,
                     base if status == "processing" else None,
                     rnd.choice(["h1", "h2", None]), rnd.choice(instants)))
    with conn.cursor() as cur:
        cur.executemany(sql.SQL(
            "INSERT INTO {} (namespace, idempotency_key, request_hash, status, owner_token, "
            "completed_token, lease_until, handler, updated_at) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)").format(t), rows)
    conn.commit()


@pytest.fixture(scope="module")
def records_q(template_db: str) -> Iterator[tuple[str, str, str, str]]:
    """A database with the store in a schema of its own, twice: keys collated as C
    (the database's), and keys collated by ICU (a column collation)."""
    with empty_database("kafka_idem_cq") as name:
        dsn = dsn_for(name)
        migrate(dsn, "cq", "records")
        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE SCHEMA cq_icu; "
                         "CREATE TABLE cq_icu.records (LIKE cq.records INCLUDING ALL); "
                         'ALTER TABLE cq_icu.records ALTER COLUMN idempotency_key '
                         'TYPE text COLLATE "en-x-icu"')
            conn.commit()
            fill(conn, "cq", "records")
            fill(conn, "cq_icu", "records")
        yield dsn, "cq", "cq_icu", "records"


def brute(conn: Any, schema: str, where: str, params: dict[str, Any], order: str,
          table: str = "records") -> list[Rec]:
    rows = conn.execute(sql.SQL(f"SELECT namespace, idempotency_key FROM {{}} WHERE {where} "
                                f"ORDER BY {order}").format(sql.Identifier(schema, table)),
                        params).fetchall()
    return [(r[0], r[1]) for r in rows]


BROWSE_CASES: list[dict[str, Any]] = [
    {}, {"statuses": ["failed"]}, {"statuses": ["processing", "succeeded"]},
    {"namespace": "ns%"}, {"namespace": "a", "handler": "h1"}, {"handler": "h2"},
    {"since": dt.datetime(2026, 12, 1, 10, 0, 2, tzinfo=dt.UTC)},
    {"until": dt.datetime(2026, 12, 1, 10, 0, 3, 1, tzinfo=dt.UTC)},
    {"since": dt.datetime(2026, 12, 1, 10, 0, 1, 1, tzinfo=dt.UTC),
     "until": dt.datetime(2026, 12, 1, 10, 0, 4, tzinfo=dt.UTC), "statuses": ["failed"]},
]


def where_of(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    parts, params = ["status = ANY(%(statuses)s)"], {
        "statuses": list(case.get("statuses", STATUSES))}
    for name, cond in (("namespace", "namespace = %(namespace)s"),
                       ("handler", "handler = %(handler)s"), ("since", "updated_at >= %(since)s"),
                       ("until", "updated_at < %(until)s")):
        if name in case:
            parts.append(cond)
            params[name] = case[name]
    return " AND ".join(parts), params


@pytest.mark.parametrize("icu", [False, True], ids=["C", "ICU"])
def test_browse_pages_are_the_brute_force_order_cut_in_pieces(
        records_q: tuple[str, str, str, str], icu: bool) -> None:
    dsn, c_schema, icu_schema, table = records_q
    schema = icu_schema if icu else c_schema
    store = Store(schema=schema, table=table)
    with psycopg.connect(dsn) as conn:
        for case in BROWSE_CASES:
            where, params = where_of(case)
            expected = brute(conn, schema, where, params,
                             "updated_at DESC, namespace DESC, idempotency_key DESC")
            args = {"statuses": list(STATUSES), **case}
            for limit in (1, 7, 50):
                got: list[Rec] = []
                after = None
                while True:
                    rows = store.browse(conn, after=after, limit=limit, **args)
                    got += [(r["namespace"], r["idempotency_key"]) for r in rows]
                    if len(rows) < limit:
                        break
                    last = rows[-1]
                    after = (last["updated_at"], last["namespace"], last["idempotency_key"])
                assert got == expected, (case, limit)
        assert store.browse(conn, statuses=[]) == []


PREFIXES = ["", "a", "z", "Z", "9", "%", "_", ":", "é", "日", "{", " ", "a%", "z_", "\U0010ffff",
            "a\U0010ffff", "\ud7ff", "\ue000", "zz", "nothing"]


@pytest.mark.parametrize("icu", [False, True], ids=["C", "ICU"])
def test_browse_prefix_pages_are_the_brute_force_order_cut_in_pieces(
        records_q: tuple[str, str, str, str], icu: bool) -> None:
    dsn, c_schema, icu_schema, table = records_q
    schema = icu_schema if icu else c_schema
    store = Store(schema=schema, table=table)
    with psycopg.connect(dsn) as conn:
        ranged = store.collation_is_bytewise(conn)
        assert ranged is not icu
        for prefix in PREFIXES:
            for spaces, statuses, handler in [
                    (NAMESPACES, list(STATUSES), None), (["a", "ns_"], ["failed"], None),
                    (["b"], list(STATUSES), "h1"), ([], list(STATUSES), None)]:
                where = ("namespace = ANY(%(nss)s) AND starts_with(idempotency_key, %(p)s) "
                         "AND status = ANY(%(statuses)s)"
                         + (" AND handler = %(handler)s" if handler else ""))
                expected = brute(conn, schema, where, {
                    "nss": spaces, "p": prefix, "statuses": statuses, "handler": handler},
                    "namespace, idempotency_key")
                for limit in (1, 6, 500):
                    got: list[Rec] = []
                    after = None
                    while True:
                        rows = store.browse_prefix(
                            conn, prefix=prefix, namespaces=spaces, statuses=statuses,
                            handler=handler, after=after, limit=limit, ranged=ranged)
                        got += [(r["namespace"], r["idempotency_key"]) for r in rows]
                        if len(rows) < limit:
                            break
                        after = (rows[-1]["namespace"], rows[-1]["idempotency_key"])
                    assert got == expected, (prefix, spaces, statuses, handler, limit)


def test_a_database_whose_default_collation_is_icu_is_not_taken_for_bytewise() -> None:
    """PostgreSQL 15+ can make ICU a database's default collation while its LC_COLLATE
    still says C.UTF-8: keys then sort by ICU's rules, where a prefix is no range (a key
    that starts with "z" sorts after "{", the range's upper bound), so the prefix search
    must test every key."""
    name = f"kafka_idem_icu_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 LOCALE_PROVIDER icu "
                             "ICU_LOCALE 'en' LOCALE 'C.UTF-8'").format(sql.Identifier(name)))
    try:
        dsn = dsn_for(name)
        migrate(dsn, "kafka_idem", "task_idempotency")
        store = Store(schema="kafka_idem", table="task_idempotency")
        with psycopg.connect(dsn) as conn:
            fill(conn, "kafka_idem", "task_idempotency", n=100)
            ranged = store.collation_is_bytewise(conn)
            assert ranged is False
            expected = brute(conn, "kafka_idem", "starts_with(idempotency_key, 'z')", {},
                             "namespace, idempotency_key", table="task_idempotency")
            assert expected
            rows = store.browse_prefix(conn, prefix="z", namespaces=NAMESPACES,
                                       statuses=list(STATUSES), limit=1000, ranged=ranged)
            assert [(r["namespace"], r["idempotency_key"]) for r in rows] == expected
            # what taking it for bytewise did: the range [z, {) holds none of them
            assert store.browse_prefix(conn, prefix="z", namespaces=NAMESPACES,
                                       statuses=list(STATUSES), limit=1000, ranged=True) == []
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def test_the_migrated_stores_collation_is_bytewise(w: World) -> None:
    """The test server's databases collate as C.UTF-8: the console's prefix search is a
    range of the primary key there (the fast path the pages above went through)."""
    store = Store(schema="kafka_idem", table="task_idempotency")
    with psycopg.connect(w.db.dsn) as conn:
        assert store.collation_is_bytewise(conn) is True


def table_rows(html_text: str, ident: str) -> list[list[str]]:
    """The text of each cell of each body row of table ``ident``."""
    table = html_text[html_text.index(f'id="{ident}"'):]
    body = table[table.index("<tbody>"):table.index("</tbody>")]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)]


def test_the_overview_counts_the_records_per_namespace_handler_and_status(
        w: World, client: Any) -> None:
    def sampled() -> str | None:
        text = client.get("/?fragment=1").text
        return text if 'id="by-namespace"' in text else None

    text = wait_for(sampled, timeout=30, what="the overview's first sample")
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for r in w.db.rows("SELECT namespace, coalesce(handler, '') AS handler, status, "
                       "count(*) AS n FROM kafka_idem.task_idempotency GROUP BY 1, 2, 3"):
        for key in ((r["namespace"], "all"), (r["namespace"], r["handler"])):
            per = counts.setdefault(key, dict.fromkeys(ORDER, 0))
            per[r["status"]] += r["n"]
    shown: dict[tuple[str, str], dict[str, int]] = {}
    ns = ""
    for cells in table_rows(text, "by-namespace"):
        ns = cells[0].split()[0] if cells[0] else ns  # "consoled (this app)"
        shown[(ns, cells[1])] = dict(zip(ORDER, map(int, cells[2:]), strict=True))
    assert shown == counts
