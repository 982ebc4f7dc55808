"""Statements that take several records at once take them in one order, the keys' code
point order, whatever the database's collation: two batches with keys in common then
wait for each other in that order and cannot deadlock."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from kafka_idem.store import Delivery, Store
from kafka_idem.store.batch import Done
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
def test_each_takes_its_keys_in_code_point_order(flavour: str, name: str) -> None:
    text = FLAVOURS[flavour][name]
    if name == "batch_insert_done":  # in the order of the arrays, which the caller sorts
        assert re.search(r"ORDER BY i\.n\b", text), text
    else:
        assert re.search(r'ORDER BY \S+ COLLATE "C"', text), text


class _Recording:
    def __init__(self) -> None:
        self.params: dict[str, Any] = {}

    def execute(self, query: Any, params: dict[str, Any]) -> None:
        self.params = params


def test_the_batch_insert_is_given_its_keys_in_code_point_order() -> None:
    """Upper case before lower case, and ``é`` after ``z``: what a ``C`` collation says,
    where ``en_US`` would say otherwise."""
    keys = ["b", "é", "B", "a", "Z", "z"]
    done = [Done(k, "h", uuid.uuid4(), Delivery("t", 0, i, "charge"), None, {"k": k})
            for i, k in enumerate(keys)]
    conn = _Recording()
    Store(schema="kafka_idem", table="task_idempotency", namespace="app").insert_done(
        conn, done)  # type: ignore[arg-type]
    assert conn.params["keys"] == ["B", "Z", "a", "b", "z", "é"]
    assert conn.params["offs"] == [2, 4, 3, 0, 5, 1]  # each key's own row, in that order
    assert conn.params["results"].obj == [{"k": k} for k in conn.params["keys"]]
