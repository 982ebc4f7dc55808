"""Registering key-ordered and async handlers: what is accepted, what names its setting."""

from __future__ import annotations

from typing import Any

import pytest

from kafka_idem import App, AsyncContext, ConfigError, Context, Done


def app() -> App:
    return App("t", database_url="postgresql://x@127.0.0.1:1/x")


def register(a: App, fn: Any, **options: Any) -> Any:
    options.setdefault("mode", "leased")
    return a.handler(topic="orders", key="{order_id}", hash_fields=("order_id",),
                     **options)(fn)


def sync_handler(msg: Any, ctx: Context) -> None:
    return None


async def async_handler(msg: Any, ctx: AsyncContext) -> None:
    return None


def test_a_sync_leased_handler_with_concurrency_is_key_ordered_and_a_plain_one_is_not() -> None:
    assert register(app(), sync_handler, concurrency=8, ordering_key="{tenant_id}").keyed
    plain = register(app(), sync_handler)
    assert not plain.keyed and plain.concurrency == 1 and plain.ordering is None


def test_an_async_handler_is_always_key_ordered() -> None:
    h = register(app(), async_handler)
    assert h.is_async and h.keyed and h.concurrency == 1


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_concurrency_must_be_a_whole_number_of_at_least_one(value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        register(app(), sync_handler, concurrency=value)
    assert err.value.context.get("setting") == "concurrency"


def test_concurrency_needs_leased_mode() -> None:
    with pytest.raises(ConfigError, match="mode='leased'") as err:
        register(app(), sync_handler, mode="local", concurrency=4)
    assert "(setting=concurrency)" in str(err.value)
    assert "handler of topic 'orders'" in str(err.value)  # which handler


def test_an_ordering_key_orders_a_local_handlers_retries_without_making_it_key_ordered() -> None:
    h = register(app(), sync_handler, mode="local", ordering_key="{tenant_id}")
    assert h.ordering is not None and not h.keyed and not h.retry_blocks_partition


def test_an_async_handler_needs_leased_mode() -> None:
    with pytest.raises(ConfigError, match="async handlers run in mode='leased'") as err:
        register(app(), async_handler, mode="local")
    assert err.value.context.get("setting") == "mode"


def test_a_reconciler_is_async_exactly_when_its_handler_is() -> None:
    h = register(app(), async_handler)

    def sync_reconcile(msg: Any, ctx: Any) -> Done | None:
        return None

    with pytest.raises(ConfigError, match="must be async def too"):
        h.reconciler(sync_reconcile)

    async def async_reconcile(msg: Any, ctx: Any) -> Done | None:
        return None

    assert h.reconciler(async_reconcile) is async_reconcile
    s = register(app(), sync_handler)
    with pytest.raises(ConfigError, match="must be def too"):
        s.reconciler(async_reconcile)


@pytest.mark.parametrize(("ordering_key", "says"), [
    ("no fields here", "ordering_key template 'no fields here' names no payload field"),
    ("", "ordering_key template '' names no payload field"),
    (123, "ordering_key must be a template string or a callable"),
])
def test_a_bad_ordering_key_fails_at_registration_naming_that_setting(
    ordering_key: Any, says: str
) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        register(app(), sync_handler, concurrency=2, ordering_key=ordering_key)
    assert "(setting=ordering_key)" in str(err.value)


def test_a_concurrency_above_the_members_limit_is_said_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kafka_idem.consume.runner import Runner

    a = App("t", database_url="postgresql://x@127.0.0.1:1/x", max_concurrency=16)
    register(a, async_handler, concurrency=100)
    with caplog.at_level("WARNING", logger="kafka_idem"):
        Runner(a)
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "config"]
    assert ("concurrency=100 is above max_concurrency=16 (KAFKA_IDEM_MAX_CONCURRENCY): "
            "at most 16 of its calls run at once") in record.getMessage()
