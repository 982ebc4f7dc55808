"""Throwaway databases on a Citus cluster, for the tests and the chaos run: a database is
made on the coordinator and every worker (``citus.enable_create_database_propagation``),
the extension created in each, the workers registered with the coordinator, exactly as
``scripts/citus.sh`` sets up the cluster's ``kafka_idem`` database; dropped on every node.

The cluster is the one ``url`` (a superuser's connection to the coordinator) names; its
workers are read from the coordinator's ``pg_dist_node`` and reached as it lists them.
"""

from __future__ import annotations

import time

import psycopg
from psycopg import sql


def nodes(url: str) -> tuple[tuple[str, int], list[tuple[str, int]]]:
    """The coordinator's and the workers' (host, port), from ``url``'s database."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT nodename, nodeport, groupid FROM pg_dist_node "
                            "WHERE noderole = 'primary' ORDER BY groupid").fetchall()
    coordinator = [(str(h), int(p)) for h, p, g in rows if g == 0]
    workers = [(str(h), int(p)) for h, p, g in rows if g != 0]
    if not coordinator or not workers:
        raise RuntimeError(f"{url} is not a Citus coordinator with workers (pg_dist_node)")
    return coordinator[0], workers


def create_database(url: str, name: str) -> str:
    """A new database ``name`` on the cluster, ready for a distributed store; its URL."""
    (chost, cport), workers = nodes(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET citus.enable_create_database_propagation = on")
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    made = psycopg.conninfo.make_conninfo(url, dbname=name)
    for host, port in [(chost, cport), *workers]:
        node = psycopg.conninfo.make_conninfo(made, host=host, port=str(port))
        with psycopg.connect(node, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
    with psycopg.connect(made, autocommit=True) as conn:
        conn.execute("SELECT citus_set_coordinator_host(%s, %s)", (chost, cport))
        for host, port in workers:
            conn.execute("SELECT citus_add_node(%s, %s)", (host, port))
    return made


def drop_database(url: str, name: str) -> None:
    """Drop ``name`` on every node, whoever is still connected. A worker can still hold
    a session for a moment after the coordinator's sessions are ended (the coordinator's
    connection to it closing): tried again a few times then."""
    for attempt in range(10):
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SET citus.enable_create_database_propagation = on")
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))
            return
        except psycopg.errors.ObjectInUse:
            if attempt == 9:
                raise
            time.sleep(0.5)
