"""Example: a charge sent to a remote payment gateway (leased mode, unknown outcomes).

Two parts, both real:

* :class:`Gateway`, a small HTTP payment gateway on 127.0.0.1 with its own
  idempotency by key (what real payment APIs offer)::

      POST /charges        Idempotency-Key: <key>   {amount, currency, tenant_id, order_id}
                           201 the new charge; 200 the same charge again for a known
                           key; 409 if the key was first used with another body;
                           422 invalid amount; 400 malformed request
      GET  /charges/<key>  200 the charge made with that key, 404 none
      GET  /charges        {"charges": [...]}  every charge
      GET  /_requests      {"requests": [...]} every request received (tests count them)
      POST /_faults        {"drop_after_apply": n, ...} see :data:`FAULTS`

  Run it alone with ``python -m consumers.gateway serve --port 8099``, or in
  process: ``with Gateway() as gw: ... gw.url``.

* The consumer app: ``payments.charge-requested`` (``PAYMENTS_TOPIC``), key
  ``{tenant_id}:charge:{order_id}``, hash over amount and currency, in
  ``mode="leased"`` because its effect lives outside this database. The handler
  passes ``ctx.idempotency_key`` as the ``Idempotency-Key`` header: that is what
  makes the remote effect exactly-once. A request that got no answer (timeout,
  connection reset, closed without a response) may or may not have been applied,
  so it raises :class:`UnknownOutcome`; the next attempt first runs the
  reconciler, which asks the gateway by key (``GET /charges/<key>``) and
  completes the record with the charge found, without charging again.

  =========================================  ==========================
  gateway answer                             handler raises
  =========================================  ==========================
  2xx                                        (success, local row written)
  no answer: timeout, reset, disconnect      UnknownOutcome
  connection refused (nothing was sent)      Retryable
  5xx, 408, 429                              Retryable (same key again)
  other 4xx                                  Permanent (dead-lettered)
  =========================================  ==========================

The local table ``payments.gateway_charges`` has *no* unique constraint on
purpose (like the ledger): a double completion would show as a second row.

    GATEWAY_URL=http://127.0.0.1:8099 kafka-idem migrate --app consumers.gateway:app
    GATEWAY_URL=http://127.0.0.1:8099 kafka-idem run consumers.gateway:app
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import logging
import os
import socket
import struct
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from decimal import Decimal, InvalidOperation
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from consumers import payments
from kafka_idem import App, Context, Done, Permanent, Retryable, RetryPolicy, UnknownOutcome

log = logging.getLogger(__name__)

TOPIC = os.environ.get("PAYMENTS_TOPIC", "payments.charge-requested")
DEFAULT_URL = "http://127.0.0.1:8099"
DEFAULT_TIMEOUT = 2.0

# Fault injection, each a count of upcoming POST /charges requests it applies to
# (the first fault with a count left wins, in this order):
FAULTS = (
    "fail_before_apply",  # 503, nothing applied
    "drop_before_apply",  # connection closed without a response, nothing applied
    "drop_after_apply",  # applied, then the connection closed without a response
    "reset_after_apply",  # applied, then the connection reset (TCP RST)
    "delay_after_apply",  # applied, the response sent after "delay_seconds" (past a timeout)
    "hold_after_apply",  # applied, the response held until POST /_faults {"release": true}
)


# --- the gateway ------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.charges: dict[str, dict[str, Any]] = {}  # by idempotency key
        self.requests: list[dict[str, Any]] = []
        self.faults: dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.delay_seconds = 5.0
        self.release = threading.Event()
        self.held = 0  # responses currently held

    def take_fault(self) -> str | None:
        with self.lock:
            for name in FAULTS:
                if self.faults[name] > 0:
                    self.faults[name] -= 1
                    return name
        return None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("gateway: " + format, *args)

    # --- helpers ---

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw or b"null")

    def _log(self, key: str | None) -> None:
        st = self.server.state
        with st.lock:
            st.requests.append({"method": self.command, "path": self.path,
                                "idempotency_key": key})

    def _drop(self, *, reset: bool) -> None:
        """Close the connection without a response (optionally with a TCP reset)."""
        self.close_connection = True
        if reset:
            # SO_LINGER 0: close() sends RST instead of FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.connection.close()
        else:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    # --- routes ---

    def do_GET(self) -> None:
        st = self.server.state
        path = urllib.parse.urlsplit(self.path).path
        self._log(None)
        if path == "/charges":
            with st.lock:
                self._send(200, {"charges": list(st.charges.values())})
        elif path.startswith("/charges/"):
            key = urllib.parse.unquote(path[len("/charges/"):])
            with st.lock:
                found = st.charges.get(key)
            if found is None:
                self._send(404, {"error": "no charge with this idempotency key"})
            else:
                self._send(200, found)
        elif path == "/_requests":
            with st.lock:
                self._send(200, {"requests": list(st.requests)})
        elif path == "/_faults":
            with st.lock:
                self._send(200, {**st.faults, "held": st.held})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/charges":
            self._charge()
        elif path == "/_faults":
            self._set_faults()
        else:
            self._send(404, {"error": "not found"})

    def _set_faults(self) -> None:
        st = self.server.state
        try:
            body = self._read_json() or {}
            with st.lock:
                for name, value in body.items():
                    if name in FAULTS:
                        st.faults[name] = int(value)
                    elif name == "delay_seconds":
                        st.delay_seconds = float(value)
                    elif name != "release":
                        raise ValueError(f"unknown fault {name!r}")
            if body.get("release"):
                st.release.set()
        except (ValueError, TypeError, AttributeError) as exc:
            self._send(400, {"error": str(exc)})
            return
        with st.lock:
            self._send(200, dict(st.faults))

    def _charge(self) -> None:
        st = self.server.state
        key = self.headers.get("Idempotency-Key")
        self._log(key)
        try:
            body = self._read_json()
            amount = Decimal(str(body["amount"]))
            request: dict[str, Any] = {
                "tenant_id": str(body["tenant_id"]),
                "order_id": str(body["order_id"]),
                "amount": amount,
                "currency": str(body["currency"]),
            }
        except (ValueError, KeyError, TypeError, InvalidOperation):
            self._send(400, {"error": "body must be JSON {amount, currency, tenant_id, order_id}"})
            return
        if not key:
            self._send(400, {"error": "the Idempotency-Key header is required"})
            return
        if not amount.is_finite() or amount <= 0:
            self._send(422, {"error": "amount must be positive"})
            return
        fault = st.take_fault()
        if fault == "fail_before_apply":
            self._send(503, {"error": "injected: unavailable"})
            return
        if fault == "drop_before_apply":
            self._drop(reset=False)
            return
        status, charge = self._apply(key, request)
        if fault == "drop_after_apply":
            self._drop(reset=False)
        elif fault == "reset_after_apply":
            self._drop(reset=True)
        elif fault == "delay_after_apply":
            st.release.wait(st.delay_seconds)
            self._respond_late(status, charge)
        elif fault == "hold_after_apply":
            with st.lock:
                st.held += 1
            st.release.wait(600)
            self._respond_late(status, charge)
        else:
            self._send(status, charge)

    def _respond_late(self, status: int, body: Any) -> None:
        try:
            self._send(status, body)
        except OSError:
            self.close_connection = True  # the client gave up meanwhile

    def _apply(self, key: str, request: dict[str, Any]) -> tuple[int, Any]:
        st = self.server.state
        with st.lock:
            existing = st.charges.get(key)
            if existing is None:
                charge = {
                    "id": f"ch_{uuid.uuid4().hex[:16]}",
                    "idempotency_key": key,
                    "tenant_id": request["tenant_id"],
                    "order_id": request["order_id"],
                    "amount": str(request["amount"]),
                    "currency": request["currency"],
                    "created_at": dt.datetime.now(dt.UTC).isoformat(),
                }
                st.charges[key] = charge
                return 201, charge
        same = (
            Decimal(existing["amount"]) == request["amount"]
            and existing["currency"] == request["currency"]
            and existing["tenant_id"] == request["tenant_id"]
            and existing["order_id"] == request["order_id"]
        )
        if not same:
            return 409, {"error": "idempotency key reused with a different request",
                         "charge_id": existing["id"]}
        return 200, existing


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class Gateway:
    """The payment gateway, in process: ``with Gateway() as gw: requests to gw.url``.

    ``port=0`` picks a free port. Only binds 127.0.0.1.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.server = _Server((host, port), _Handler)
        self.server.state = _State()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> _State:
        return self.server.state

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Gateway:
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="gateway", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.state.release.set()  # let held responses go before shutting down
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # --- for tests (the same answers as the HTTP endpoints) ---

    def faults(self, **faults: float) -> None:
        """Set fault counts (see :data:`FAULTS`) and ``delay_seconds``."""
        with self.state.lock:
            for name, value in faults.items():
                if name == "delay_seconds":
                    self.state.delay_seconds = float(value)
                elif name in FAULTS:
                    self.state.faults[name] = int(value)
                else:
                    raise ValueError(f"unknown fault {name!r}")

    def release(self) -> None:
        self.state.release.set()

    def charges(self) -> list[dict[str, Any]]:
        with self.state.lock:
            return list(self.state.charges.values())

    def requests(self, method: str | None = None, key: str | None = None,
                 path: str | None = None) -> list[dict[str, Any]]:
        with self.state.lock:
            return [r for r in self.state.requests
                    if (method is None or r["method"] == method)
                    and (key is None or r["idempotency_key"] == key)
                    and (path is None or r["path"] == path)]

    # --- as a remote of the test kit (kafka_idem.testing.Remote) ---

    def effects(self) -> list[tuple[str, str, str, str, str]]:
        """The charges made, by key and request (not by their random ids)."""
        return sorted((c["idempotency_key"], c["tenant_id"], c["order_id"], c["amount"],
                       c["currency"]) for c in self.charges())

    def reset(self) -> None:
        """Forget every charge and request (the faults stay as set)."""
        with self.state.lock:
            self.state.charges.clear()
            self.state.requests.clear()

    @property
    def held(self) -> int:
        with self.state.lock:
            return self.state.held


# --- the client the handler uses -----------------------------------------------------------

# No proxies: the gateway is on 127.0.0.1, and an HTTP(S)_PROXY in the environment
# must not turn a local call into a remote one.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class GatewayClient:
    """Calls the gateway; maps "no answer" to :class:`UnknownOutcome`."""

    def __init__(self, url: str | None = None, timeout: float | None = None) -> None:
        self._url = url
        self._timeout = timeout

    @property
    def url(self) -> str:
        return (self._url or os.environ.get("GATEWAY_URL") or DEFAULT_URL).rstrip("/")

    @property
    def timeout(self) -> float:
        if self._timeout is not None:
            return self._timeout
        return float(os.environ.get("GATEWAY_TIMEOUT_SECONDS", DEFAULT_TIMEOUT))

    def _call(self, method: str, path: str, *, key: str | None = None,
              body: Any = None) -> tuple[int, Any]:
        """(status, JSON body). Raises UnknownOutcome when the request may have been
        applied but no answer came back, Retryable when it was surely not sent."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if key is not None:
            headers["Idempotency-Key"] = key
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return int(resp.status), json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                answer = json.loads(exc.read() or b"null")
            except (ValueError, OSError):
                answer = None
            return int(exc.code), answer
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                raise Retryable(f"gateway refused the connection: {exc.reason}") from exc
            raise UnknownOutcome(f"no answer from the gateway: {exc.reason}") from exc
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            # Timeout, reset, or closed without a response: it may have been applied.
            raise UnknownOutcome(f"no answer from the gateway: {type(exc).__name__}: {exc}",
                                 ) from exc

    def charge(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        status, answer = self._call("POST", "/charges", key=key, body=request)
        if 200 <= status < 300:
            return dict(answer)
        reason = (answer or {}).get("error") if isinstance(answer, dict) else None
        if status >= 500 or status in (408, 429):
            raise Retryable(f"gateway answered {status}: {reason}")
        raise Permanent(f"gateway refused the charge ({status}): {reason}")

    def find(self, key: str) -> dict[str, Any] | None:
        """The charge made with ``key``, or None. UnknownOutcome if the gateway can't say."""
        try:
            status, answer = self._call("GET", "/charges/" + urllib.parse.quote(key, safe=""))
        except Retryable as exc:  # can't ask: still unknown
            raise UnknownOutcome(str(exc)) from exc
        if status == 200:
            return dict(answer)
        if status == 404:
            return None
        raise UnknownOutcome(f"gateway could not be asked about the charge ({status})")


# --- the consumer app ---------------------------------------------------------------------


def create_tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS payments")
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS payments.gateway_charges (
            id              bigserial PRIMARY KEY,
            idempotency_key text          NOT NULL,
            charge_id       text          NOT NULL,
            amount          numeric(18,2) NOT NULL,
            currency        text          NOT NULL,
            created_at      timestamptz   NOT NULL DEFAULT now()
        )
        """
    )


def _record(ctx: Context, charge: dict[str, Any]) -> dict[str, Any]:
    ctx.tx.execute(
        "INSERT INTO payments.gateway_charges (idempotency_key, charge_id, amount, currency)"
        " VALUES (%s, %s, %s, %s)",
        (ctx.idempotency_key, charge["id"], Decimal(charge["amount"]), charge["currency"]),
    )
    return {"charge_id": charge["id"]}


def build_app(
    *,
    topic: str = TOPIC,
    gateway_url: str | None = None,
    timeout: float | None = None,
    retry: RetryPolicy | None = None,
    name: str = "gateway",
    **settings: Any,
) -> App:
    """The gateway app on ``topic``; ``gateway_url`` defaults to ``$GATEWAY_URL``,
    ``timeout`` to ``$GATEWAY_TIMEOUT_SECONDS`` (2 s); ``retry`` is the handler's own
    policy (default: from the settings); ``settings`` override Settings fields."""
    settings.setdefault("schemas_dir", payments.SCHEMAS_DIR)
    # No group_id here: KAFKA_IDEM_GROUP_ID (or run --group-id) chooses it, else the name.
    client = GatewayClient(gateway_url, timeout)
    application = App(name, **settings)
    application.migration(create_tables)

    @application.handler(
        topic=topic,
        model=payments.ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"),
        schema=payments.SCHEMA,
        mode="leased",
        retry=retry,
    )
    def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
        found = client.charge(ctx.idempotency_key, {
            "tenant_id": msg.tenant_id,
            "order_id": msg.order_id,
            "amount": str(msg.amount),
            "currency": msg.currency,
        })
        return _record(ctx, found)

    @charge.reconciler
    def reconcile(msg: payments.ChargeRequested, ctx: Context) -> Done | None:
        found = client.find(ctx.idempotency_key)
        if found is None:
            return None  # never applied: the handler runs again with the same key
        return Done(_record(ctx, found))

    return application


app = build_app()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m consumers.gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the payment gateway on 127.0.0.1")
    serve.add_argument("--port", type=int, default=8099, help="port (0 = any free port)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        gw = Gateway(port=args.port)
        print(f"payment gateway listening on {gw.url}", flush=True)
        try:
            gw.server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            gw.server.server_close()


if __name__ == "__main__":
    main()
