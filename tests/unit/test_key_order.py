"""Writes that take several records at once take them in one order, the keys' byte
order: the SQL statements sort by the "C" collation, the COPY of a large batch's records
is sent in the order Python sorts ``str`` (code points: UTF-8's byte order). Two batches
with keys in common then wait for each other in that order and cannot deadlock,
whatever the database's own collation. (That the database agrees is
tests/integration/test_batch_claim.py's ``..._in_byte_order``.)"""

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
    copies = sorted(name for name, text in FLAVOURS["local"].items()
                    if re.search(r'COPY "kafka_idem"\."task_idempotency"', text))
    assert copies == ["batch_copy_done"]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("name", MULTI_KEY)
def test_each_sorts_its_keys_in_sql_in_byte_order(flavour: str, name: str) -> None:
    text = FLAVOURS[flavour][name]
    assert re.search(r'ORDER BY (i\.key|idempotency_key) COLLATE "C"\s*$', text, re.M), text


@pytest.mark.parametrize("keys", [
    ["b", "B", "a", "A", "_", "1"],
    ["\u00e9", "e", "f", "E", "\u0100", "z"],
    ["\U0001f600", "\uffff", "\ud7ff", "\ue000", "x"],
])
def test_code_point_order_is_utf8_byte_order(keys: list[str]) -> None:
    assert sorted(keys) == sorted(keys, key=lambda k: k.encode())
