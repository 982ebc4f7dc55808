"""Mistakes in a handler's definition are a ConfigError naming the handler when it is
registered, not a TypeError retried at every message."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from kafka_idem import App, Context, Done
from kafka_idem.errors import ConfigError, ResultNotJSON
from kafka_idem.store.protocol import result_dumps


class Loan(BaseModel):
    branch: str
    copy_id: str


def _app() -> App:
    return App("library", database_url="postgresql://u@127.0.0.1:1/none")


def test_a_handler_that_does_not_take_msg_and_ctx_is_refused_by_name() -> None:
    app = _app()
    with pytest.raises(ConfigError) as caught:
        @app.handler(topic="loans", model=Loan, key="{branch}:loan:{copy_id}",
                     hash_fields=("copy_id",))
        def checkout(msg: Loan) -> None: ...
    assert str(caught.value) == (
        "handler 'checkout' must take two arguments (msg, ctx); checkout(msg) cannot: too "
        "many positional arguments (setting=handler)")
    assert "loans" not in app.handlers


def test_handlers_with_defaults_varargs_or_callables_are_accepted() -> None:
    app = _app()

    class Callable_:
        def __call__(self, msg: Any, ctx: Any) -> None: ...

    app.handler(topic="a", model=Loan, key="{branch}:a:{copy_id}", hash_fields=("copy_id",))(
        lambda msg, ctx, extra=1: None)
    app.handler(topic="b", model=Loan, key="{branch}:b:{copy_id}", hash_fields=("copy_id",),
                name="b")(lambda *args: None)
    app.handler(topic="c", model=Loan, key="{branch}:c:{copy_id}", hash_fields=("copy_id",),
                name="c")(Callable_())
    assert sorted(app.handlers) == ["a", "b", "c"]


def test_a_registered_handler_given_again_is_refused_naming_its_function() -> None:
    """``@app.handler`` returns a Handler: given to ``app.handler(...)`` again (the same
    function on a second topic or app) it is refused as a ConfigError saying what to
    register, not an AttributeError; its function registers fine."""
    app, other = _app(), _app()

    @app.handler(topic="loans", model=Loan, key="{branch}:loan:{copy_id}",
                 hash_fields=("copy_id",))
    def checkout(msg: Loan, ctx: Context) -> None: ...

    with pytest.raises(ConfigError) as caught:
        other.handler(topic="loans2", model=Loan, key="{branch}:loan:{copy_id}",
                      hash_fields=("copy_id",))(checkout)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "'checkout' is a registered handler already (of topic 'loans'), not a function: "
        "register its function, app.handler(..., name=...)(checkout.fn) (a name of its own "
        "keeps its metrics and pauses apart; its bulk handler or reconciler again on what "
        "that returns) (setting=handler)")
    assert other.handlers == {}
    again = other.handler(topic="loans2", model=Loan, key="{branch}:loan:{copy_id}",
                          hash_fields=("copy_id",))(checkout.fn)
    assert (again.name, again.topic, again.fn) == ("checkout", "loans2", checkout.fn)


def test_a_callable_without_a_name_needs_name() -> None:
    class Nameless:
        def __call__(self, msg: Any, ctx: Any) -> None: ...

    with pytest.raises(ConfigError, match=r"has no __name__: give it one with name= "
                       r"\(setting=name\)$"):
        _app().handler(topic="a", model=Loan, key="{branch}:a:{copy_id}",
                       hash_fields=("copy_id",))(Nameless())


def test_a_reconciler_or_bulk_form_with_the_wrong_arguments_is_refused() -> None:
    app = _app()

    @app.handler(topic="loans", model=Loan, key="{branch}:loan:{copy_id}",
                 hash_fields=("copy_id",), mode="leased")
    def remind(msg: Loan, ctx: Context) -> None: ...

    with pytest.raises(ConfigError, match=r"^handler 'remind''s reconciler must take two "
                       r"arguments \(msg, ctx\); find\(ctx\) cannot: .*\(setting=reconciler\)$"):
        @remind.reconciler
        def find(ctx: Any) -> Done | None: ...
    with pytest.raises(ConfigError, match=r"^handler 'remind''s bulk handler must take two "
                       r"arguments \(batch, tx\); <lambda>\(batch\) cannot: "
                       r".*\(setting=bulk_handler\)$"):
        remind.bulk_handler(lambda batch: [])
    assert remind.reconcile is None and remind.bulk is None


def test_empty_hash_fields_are_refused_naming_the_handler() -> None:
    with pytest.raises(ConfigError) as caught:
        @_app().handler(topic="returns", model=Loan, key="{branch}:return:{copy_id}",
                        hash_fields=())
        def return_book(msg: Loan, ctx: Context) -> None: ...
    assert str(caught.value) == (
        "handler 'return_book': hash_fields must name at least one payload field (what "
        "makes two requests with one key the same) (setting=hash_fields)")


def test_a_result_that_is_not_json_says_what_to_return() -> None:
    assert result_dumps({"due": "2026-12-20", "n": [1, None]}) == (
        '{"due": "2026-12-20", "n": [1, null]}')
    with pytest.raises(ResultNotJSON) as caught:
        result_dumps({"tags": {"x"}})
    assert str(caught.value) == (
        "the handler's result is not JSON-serialisable (Object of type set is not JSON "
        "serializable): return only dict, list, str, int, float, bool or None (it is stored "
        "in result_json and given back to every duplicate)")
    assert isinstance(caught.value, TypeError)


def test_a_result_is_stored_as_json_dumps_writes_it_and_a_cycle_is_refused() -> None:
    """result_dumps keeps one C encoder for every call: its text must be json.dumps's,
    byte for byte, and a result it cannot encode (a cycle, a set) must be refused as
    json.dumps refuses it, also right after such a failure."""
    import json

    looped: dict[str, object] = {"a": 1}
    looped["self"] = looped
    values: list[object] = [
        None, True, 0, -7, 2**80, 1.5, 1e300, -0.0, "plain",
        "quote \" backslash \\ newline \n tab \t", "é 漢字 😀 \u2028", [], {}, (1, "x"),
        {"n": [1, {"deep": [None, False]}], "z": 1, "a": "b"}, {1: "int key", None: 0},
        "a backslash and u0000: \\u0000, \\ud800",
    ]
    for value in values:
        assert result_dumps(value) == json.dumps(value)
    with pytest.raises(ResultNotJSON, match="Circular reference detected"):
        result_dumps(looped)
    with pytest.raises(ResultNotJSON, match="Object of type set"):
        result_dumps([1, {2}])
    for value in values:  # nothing of a failure stays behind
        assert result_dumps(value) == json.dumps(value)


@pytest.mark.parametrize(("result", "why"), [
    (float("nan"), "Out of range float values are not JSON compliant"),
    ({"n": [float("inf")]}, "Out of range float values are not JSON compliant"),
    (-float("inf"), "Out of range float values are not JSON compliant"),
    ({"note": "a\x00b"}, "a string holds U+0000, which PostgreSQL's jsonb cannot store"),
    ({"a\x00": 1}, "a string holds U+0000, which PostgreSQL's jsonb cannot store"),
    (["ok", "\ud800"], "a string holds a lone surrogate, which is not Unicode text"),
    ({"k": "x\udc00"}, "a string holds a lone surrogate, which is not Unicode text"),
    ({"\udbff": 0}, "a string holds a lone surrogate, which is not Unicode text"),
])
def test_a_result_jsonb_cannot_hold_is_refused_as_the_handlers(result: object, why: str) -> None:
    """json.dumps writes NaN and the infinities, U+0000 and lone surrogates; PostgreSQL's
    jsonb refuses each, which would blame the message's data: the handler's result is at
    fault, so it is refused as not JSON, before any statement."""
    with pytest.raises(ResultNotJSON) as caught:
        result_dumps(result)
    assert str(caught.value) == (
        f"the handler's result is not JSON-serialisable ({why}): return only dict, list, "
        "str, int, float, bool or None (it is stored in result_json and given back to "
        "every duplicate)")
    assert result_dumps({"pair": "😀", "nul as text": "\\u0000"}) == (
        '{"pair": "\\ud83d\\ude00", "nul as text": "\\\\u0000"}')
