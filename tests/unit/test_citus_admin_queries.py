"""The admin queries' distributed flavour (a store on Citus): statements about one record
name its shard, and the multi-shard ones avoid what Citus refuses; one PostgreSQL keeps
its own forms (tests/integration/test_citus_admin.py runs them on a cluster)."""

from __future__ import annotations

from kafka_idem.store.queries import compile_queries


def text(distributed: bool) -> dict[str, str]:
    return {name: q.as_string(None)
            for name, q in compile_queries("s", "t", distributed=distributed).items()}


def test_one_record_statements_name_its_shard_on_citus_only() -> None:
    on_citus, single = text(True), text(False)
    for name in ("lock_record", "rerun"):
        assert "AND shard_key = %(shard)s" in on_citus[name]
        assert "shard_key = %(shard)s" not in single[name]
    assert "FOR UPDATE" in on_citus["lock_record"]
    assert "FOR UPDATE" not in on_citus["record_shard"]


def test_multi_shard_admin_statements_avoid_what_citus_refuses() -> None:
    on_citus, single = text(True), text(False)
    assert "RECURSIVE" not in on_citus["namespaces"] and "RECURSIVE" in single["namespaces"]
    assert "ctid" not in on_citus["purge_batch"] and "FOR UPDATE" not in on_citus["purge_batch"]
    assert "ctid" in single["purge_batch"] and "SKIP LOCKED" in single["purge_batch"]
    assert "clock_timestamp()" not in on_citus["rerun"]
