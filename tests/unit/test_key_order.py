"""Statements that take several records at once take them in one order, the keys' order
in the database's collation (each sorts in SQL): two batches with keys in common then
wait for each other in that order and cannot deadlock."""

from __future__ import annotations

import re

import pytest

from kafka_idem.store.queries import compile_queries

FLAVOURS = {flavour: {name: q.as_string(None) for name, q in compile_queries(
    "kafka_idem", "task_idempotency", distributed=flavour == "distributed").items()}
    for flavour in ("local", "distributed")}
# every statement given a batch's keys that inserts or locks their records
MULTI_KEY = sorted(name for name, text in FLAVOURS["local"].items()
                   if "%(keys)b" in text and ("FOR UPDATE" in text or re.search(
                       r'INSERT INTO "kafka_idem"\."task_idempotency"', text)))


def test_the_multi_key_statements_are_the_ones_expected() -> None:
    assert MULTI_KEY == ["batch_claim_insert", "batch_insert_done", "batch_lock"]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("name", MULTI_KEY)
def test_each_sorts_its_keys_in_sql_by_the_same_collation(flavour: str, name: str) -> None:
    """In SQL, by the column's collation, and never by another (a ``COLLATE`` here, or
    the order a client sorted the arrays in, would let two statements disagree)."""
    text = FLAVOURS[flavour][name]
    assert re.search(r"ORDER BY (i\.key|idempotency_key)\s*$", text, re.M), text
    assert "COLLATE" not in text
