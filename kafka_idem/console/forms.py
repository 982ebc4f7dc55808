"""Reading the console's query strings and forms: filters, cursors, picked records.

Every value comes from the browser: a bad one is :class:`BadInput` (the page says
which field and why, status 400), never an exception from deeper down.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request

from kafka_idem import replay
from kafka_idem.admin import operations as admin
from kafka_idem.deadletters.dead_letter import ERROR_KINDS
from kafka_idem.errors import KafkaIdemError
from kafka_idem.replay.bulk import Filter

MAX_PICKS = 500


class BadInput(KafkaIdemError):
    """A filter or form field the console cannot use (shown on the page, status 400)."""



def when(value: Any) -> str:
    """A time as the pages show it (UTC, to the second)."""
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return "" if value is None else str(value)


def encode_cursor(value: Any) -> str:
    raw = json.dumps(value, default=lambda v: v.isoformat()).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii")


def decode_cursor(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(base64.urlsafe_b64decode(text.encode("ascii")))
    except ValueError as exc:
        raise BadInput("the page link is damaged (cursor)") from exc


def exact(params: Any, name: str) -> str | None:
    """A key or key prefix as given (a key may start or end with spaces), ``None``
    when empty."""
    value = params.get(name)
    if value is None or value == "":
        return None
    if "\x00" in str(value):  # no text column can hold it: a bad field, not a database error
        raise BadInput(f"{name}: contains a NUL character")
    return str(value)


def opt(params: Any, name: str) -> str | None:
    """A text field, stripped (``None``: absent or empty)."""
    value = params.get(name)
    if value is None:
        return None
    value = str(value).strip()
    if "\x00" in value:  # no text column can hold it: a bad field, not a database error
        raise BadInput(f"{name}: contains a NUL character")
    return value or None


def time_param(params: Any, name: str) -> dt.datetime | None:
    value = opt(params, name)
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{name}: {value!r} is not a date-time like 2026-12-01T10:00 "
                       "(UTC unless it has an offset)") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def int_param(params: Any, name: str) -> int | None:
    value = opt(params, name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise BadInput(f"{name}: {value!r} is not a whole number from 0 to 10^18")
    return int(value)


def status_param(params: Any) -> str | None:
    value = opt(params, "status")
    if value is not None and value not in admin.STATUSES:
        raise BadInput(f"status must be one of {', '.join(admin.STATUSES)}")
    return value


SELECTION_FIELDS = ("key", "kind", "error_class", "handler", "namespace", "since", "until",
                    "partition", "from_offset", "to_offset")


def selection(params: Any) -> replay.Selection:
    """The ``dlq list`` filters given as query or form fields."""
    kind = opt(params, "kind")
    if kind is not None and kind not in ERROR_KINDS:
        raise BadInput(f"kind must be one of {', '.join(ERROR_KINDS)}")
    sel = dict(key=exact(params, "key"), kind=kind, error_class=opt(params, "error_class"),
               handler=opt(params, "handler"), namespace=opt(params, "namespace"),
               since=time_param(params, "since"), until=time_param(params, "until"),
               partition=int_param(params, "partition"),
               from_offset=int_param(params, "from_offset"),
               to_offset=int_param(params, "to_offset"))
    try:
        return replay.Selection(**sel)  # type: ignore[arg-type]
    except KafkaIdemError as exc:
        raise BadInput(str(exc)) from exc


def selection_fields(sel: replay.Selection) -> dict[str, str]:
    """A selection as the form fields that give it back."""
    out = {}
    for name, value in sel.to_json().items():
        out[name] = str(value)
    return out


def filter_of(params: Any) -> Filter:
    """The bulk re-run's filters (``rerun`` without KEY)."""
    kind = opt(params, "kind")
    if kind is not None and kind not in ("exhausted", "permanent"):
        raise BadInput("kind must be exhausted or permanent")
    flt = Filter(kind=kind, handler=opt(params, "handler"), since=time_param(params, "since"),
                 until=time_param(params, "until"), key_prefix=exact(params, "key_prefix"),
                 limit=int_param(params, "limit"), namespace=opt(params, "namespace"))
    if not flt.to_json() or list(flt.to_json()) == ["limit"]:
        raise BadInput("give at least one filter (kind, handler, namespace, since, until, "
                       "key prefix) to re-run in bulk")
    return flt




def form(request: Request) -> FormData:
    """The POST's form (read once, by the security middleware)."""
    data: FormData = request.state.form
    return data


def picks_of(data: FormData) -> list[tuple[int, int]]:
    out = []
    for value in data.getlist("pick"):
        part, _, off = str(value).partition(":")
        if not (part.isdigit() and off.isdigit()):
            raise BadInput("a picked record is not PARTITION:OFFSET")
        out.append((int(part), int(off)))
    if len(out) > MAX_PICKS:
        raise BadInput(f"at most {MAX_PICKS} records at once")
    return out


def picked_keys(data: FormData) -> list[tuple[str, str]]:
    """The (namespace, key) of each record ticked on a page."""
    picked = []
    for value in data.getlist("pick"):
        pair = decode_cursor(str(value))
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(x, str) for x in pair) and pair[1]):
            raise BadInput("a picked record is not NAMESPACE and KEY")
        picked.append((pair[0], pair[1]))
    if not picked:
        raise BadInput("pick at least one record")
    if len(picked) > MAX_PICKS:
        raise BadInput(f"at most {MAX_PICKS} records at once")
    return picked
