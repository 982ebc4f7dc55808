"""A handler's ``shard_key=`` (where a store distributed on Citus places a message's
record): one idempotency key must always have one shard, so a template may name only
``key=``'s fields and a function is given the idempotency key, never the payload."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from kafka_idem import App
from kafka_idem.consume.paths.decoding import Decoding
from kafka_idem.errors import ConfigError, MissingKeyField
from kafka_idem.testing import FakeMessage


class Reserve(BaseModel):
    warehouse: str
    sku: str
    order: str


def handler(**options: Any) -> Any:
    app = App("shard-check")

    @app.handler(topic="reserve", model=Reserve, hash_fields=["sku"], **options)
    def h(msg: Reserve, ctx: Any) -> None:
        return None

    return app, app.handlers["reserve"]


def prepared(app: App, h: Any, **payload: str) -> Any:
    decoding = Decoding()
    decoding.settings = app.settings
    msg = FakeMessage("reserve", value=Reserve(**payload).model_dump_json())
    return decoding.prepare(h, msg)


def test_a_function_is_given_the_idempotency_key_not_the_payload() -> None:
    app, h = handler(key="{warehouse}:reserve:{order}", shard_key=lambda key: key.split(":")[0])
    a = prepared(app, h, warehouse="w1", sku="a", order="o9")
    b = prepared(app, h, warehouse="w1", sku="c", order="o9")  # same key, another sku
    assert (a.key, a.shard) == (b.key, b.shard) == ("w1:reserve:o9", "w1")


def test_a_function_of_the_payload_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        handler(key="{warehouse}:reserve:{order}", shard_key=lambda m, extra: m.warehouse)
    assert caught.value.context["setting"] == "shard_key"
    assert "one argument, the idempotency key" in caught.value.message


def test_a_template_with_a_key_function_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        handler(key=lambda m: f"{m.warehouse}:{m.order}", shard_key="{warehouse}")
    assert "function of the idempotency key" in caught.value.message


def test_a_template_naming_a_field_the_key_lacks_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        handler(key="{warehouse}:reserve:{order}", shard_key="{sku}")
    assert "'sku'" in caught.value.message and "one shard" in caught.value.message


def test_a_function_returning_no_string_makes_the_message_undecidable() -> None:
    app, h = handler(key="{warehouse}:reserve:{order}", shard_key=lambda key: None)
    with pytest.raises(MissingKeyField, match="shard_key function returned None"):
        prepared(app, h, warehouse="w1", sku="a", order="o9")
