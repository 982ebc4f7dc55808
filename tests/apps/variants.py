"""The payments example with fault hooks, for tests that run real member processes.

Behaviour is chosen by environment variables so ``kafka-idem run
tests.apps.variants:app`` can be started with different faults:

* ``SLOW_SECONDS`` / ``SLOW_ORDERS`` ("*" or comma list): after the business
  write, sleep (only on ``ctx.attempt <= SLOW_ATTEMPTS``, default 1).
* ``RETRYABLE_ORDERS`` / ``RETRYABLE_ATTEMPTS``: raise Retryable on the first N attempts.
* ``PERMANENT_ORDERS``: raise Permanent (a bug or bad data, "fixed" by restarting without it).
* ``KILL_AFTER_WRITE_ORDERS``: SIGKILL this process right after the business
  write, on the first attempt (crash before the success state).
* ``BLOCK_FILE`` / ``BLOCK_ORDERS``: before the business write, wait while the file
  exists (a handler stuck on something slow; delete the file to let it go on);
  ``BLOCK_FILE.waiting`` is created when a handler starts waiting.
* ``CRASH_BEFORE_OFFSET_COMMIT=1``: SIGKILL this process right after the database
  commit, before the Kafka offset commit.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from consumers import payments
from kafka_idem import Context, Permanent, Retryable
from kafka_idem.consume.runner import Runner


def _orders(var: str) -> set[str] | None:
    raw = os.environ.get(var, "")
    if not raw:
        return set()
    return None if raw == "*" else set(raw.split(","))


def _hit(var: str, order: str) -> bool:
    chosen = _orders(var)
    return chosen is None or order in chosen


def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    if _hit("PERMANENT_ORDERS", msg.order_id):
        raise Permanent("injected permanent failure")
    if _hit("RETRYABLE_ORDERS", msg.order_id) and ctx.attempt <= int(
        os.environ.get("RETRYABLE_ATTEMPTS", "1")
    ):
        raise Retryable(f"injected transient failure on attempt {ctx.attempt}")
    block = os.environ.get("BLOCK_FILE")
    if block and _hit("BLOCK_ORDERS", msg.order_id):
        if os.path.exists(block):
            open(f"{block}.waiting", "w").close()
        while os.path.exists(block):
            time.sleep(0.05)
    result = payments.charge(msg, ctx)
    if _hit("KILL_AFTER_WRITE_ORDERS", msg.order_id) and ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if _hit("SLOW_ORDERS", msg.order_id) and ctx.attempt <= int(
        os.environ.get("SLOW_ATTEMPTS", "1")
    ):
        time.sleep(float(os.environ.get("SLOW_SECONDS", "0")))
    return result


if os.environ.get("CRASH_BEFORE_OFFSET_COMMIT") == "1":
    _original = Runner._commit_pending

    def _crash(self: Runner, *, sync: bool = False) -> None:
        if any(st.to_commit is not None for st in self.parts.values()):
            os.kill(os.getpid(), signal.SIGKILL)
        _original(self, sync=sync)

    Runner._commit_pending = _crash  # type: ignore[method-assign]


app = payments.build_app(name="variants")
app.handlers[payments.TOPIC].fn = charge

# The fault hooks live in the per-message handler above; the example's bulk handler
# (used on the batch path) would bypass them. With any hook set, run without it.
_HOOKS = ("BLOCK_ORDERS", "SLOW_ORDERS", "RETRYABLE_ORDERS", "PERMANENT_ORDERS",
          "KILL_AFTER_WRITE_ORDERS")
if any(os.environ.get(var) for var in _HOOKS):
    app.handlers[payments.TOPIC].bulk = None
