"""An app with an ``async def`` leased handler (and its async reconciler), written as
a user would, for the test kit's own tests; ``MISTAKE`` (set by a test, reset to
"none") makes it wrong:

* ``event_random_id``: the booked event carries a random id made for each emit (the
  check leaves it out, said);
* ``own_connection``: the pickup row is written through a second (autocommit)
  connection, which no rollback undoes;
* ``not_json``: the handler returns what is not JSON (so no delivery succeeds);
* ``forgot_await``: ``ctx.emit(...)`` is called without ``await`` (a slip, not a
  mistake: the event is registered at the call).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
from pydantic import BaseModel

from kafka_idem import App, AsyncContext, Done
from kafka_idem.testing import FakeService

BOOK = "x.book"
BOOKED = "x.booked"
MISTAKE = {"now": "none"}
carrier = FakeService("carrier")


class Booking(BaseModel):
    warehouse: str
    pickup_id: str
    carrier: str
    note: str = ""  # per send, not hashed


app = App("pickups")
app.event_topic(BOOKED, format="json")
# Each event loop that ran the handler, when the kit closed it (app.on_loop_close).
CLOSED_LOOPS: list[int] = []


@app.on_loop_close
async def _closed() -> None:
    CLOSED_LOOPS.append(id(asyncio.get_running_loop()))


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS pickups")
    conn.execute("CREATE TABLE IF NOT EXISTS pickups.booked (key text NOT NULL,"
                 " pickup_id text NOT NULL, carrier text NOT NULL, booking text NOT NULL)")


async def _record(msg: Booking, ctx: AsyncContext, booking: dict[str, Any]) -> dict[str, Any]:
    row = (ctx.idempotency_key, msg.pickup_id, msg.carrier, booking["id"])
    insert = ("INSERT INTO pickups.booked (key, pickup_id, carrier, booking)"
              " VALUES (%s, %s, %s, %s)")
    if MISTAKE["now"] == "own_connection":
        async with await psycopg.AsyncConnection.connect(ctx.tx.info.dsn,
                                                         autocommit=True) as conn:
            await conn.execute(insert, row)
    else:
        await ctx.tx.execute(insert, row)
    event: dict[str, Any] = {"pickup_id": msg.pickup_id, "booking": booking["id"]}
    if MISTAKE["now"] == "event_random_id":
        event["event_id"] = uuid.uuid4().hex
    if MISTAKE["now"] == "forgot_await":
        ctx.emit(BOOKED, event, key=msg.pickup_id)
    else:
        await ctx.emit(BOOKED, event, key=msg.pickup_id)
    if MISTAKE["now"] == "not_json":
        return {"at": object()}  # type: ignore[dict-item]
    return {"ok": True, "booking": booking["id"]}


@app.handler(topic=BOOK, model=Booking, key="{warehouse}:pickup:{pickup_id}",
             hash_fields=("carrier",), mode="leased", concurrency=4)
async def book(msg: Booking, ctx: AsyncContext) -> dict[str, Any]:
    await asyncio.sleep(0.01)  # the carrier's API, awaited
    booking = carrier.call("book", key=ctx.idempotency_key, pickup=msg.pickup_id)
    return await _record(msg, ctx, booking)


@book.reconciler
async def find_booking(msg: Booking, ctx: AsyncContext) -> Done | None:
    found = carrier.find(ctx.idempotency_key)
    return None if found is None else Done(await _record(msg, ctx, found))
