"""The distributed (Citus) flavour of the store's statements: what Citus would refuse is
not in it, and the statements about one record carry its shard."""

from __future__ import annotations

import re

import pytest

from kafka_idem.store.queries import compile_queries

# each flavour's statements by name (a "<name>_distributed" block is <name> there)
DISTRIBUTED = {name: q.as_string(None) for name, q in compile_queries(
    "kafka_idem", "task_idempotency", distributed=True).items()
    if not name.endswith("_distributed")}
LOCAL = {name: q.as_string(None) for name, q in compile_queries(
    "kafka_idem", "task_idempotency").items() if not name.endswith("_distributed")}
# the statements about one message's record: each must reach exactly its shard
ROUTED = ("claim_lock", "claim_take", "complete", "fail", "extend_lease", "withdraw_claim",
          "exhaust", "dead_again")


def test_no_volatile_clock_in_the_distributed_flavour() -> None:
    """Citus refuses a VOLATILE function in an UPDATE of a distributed table."""
    assert [n for n, text in DISTRIBUTED.items() if "clock_timestamp()" in text] == []


@pytest.mark.parametrize("name", sorted(DISTRIBUTED))
def test_no_clock_inside_a_case_or_coalesce(name: str) -> None:
    """Citus refuses a non-immutable function inside CASE or COALESCE."""
    text = DISTRIBUTED[name]
    for case in re.findall(r"CASE\b.*?\bEND\b", text, re.S):
        assert "_timestamp()" not in case, (name, case)
    for args in re.findall(r"coalesce\(([^()]*(?:\([^()]*\))?[^()]*)\)", text, re.S | re.I):
        assert "_timestamp()" not in args, (name, args)


@pytest.mark.parametrize("name", ROUTED)
def test_a_records_statements_are_routed_by_its_shard(name: str) -> None:
    assert "AND shard_key = %(shard)s" in DISTRIBUTED[name]
    assert "shard_key = %(shard)s" not in LOCAL[name]  # one server: no filter


def test_one_server_keeps_its_own_statements_but_for_the_shard_column() -> None:
    """On one PostgreSQL the shard key is stored (the claim's and the events' inserts) and
    read (inspect), never filtered or joined on; the clock is clock_timestamp() as before."""
    assert [n for n, text in LOCAL.items() if "shard_key" in text] == [
        "claim_insert", "get_record", "record_shard", "lock_record", "batch_claim_insert",
        "batch_insert_done", "batch_copy_done", "failed_selection", "outbox_insert"]
    assert [n for n, text in LOCAL.items() if "shard_key =" in text] == []
    assert "statement_timestamp()" not in "".join(LOCAL.values())


def test_the_distributed_outbox_writes_one_routed_row_an_event() -> None:
    insert = DISTRIBUTED["outbox_insert"]
    assert "VALUES" in insert and "unnest" not in insert
    assert "pg_advisory_xact_lock" in DISTRIBUTED["outbox_lock_slots"]
    assert "outbox_slots" not in DISTRIBUTED["outbox_lock_slots"]
