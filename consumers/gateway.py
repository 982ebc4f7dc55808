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
      GET  /_in_flight     {"now": n, "max": m} charges being answered now, and the most
                           at once since the start or the last POST /_in_flight (which
                           resets the most to now): what a consumer's concurrency let in
      POST /_faults        {"drop_after_apply": n, ...} see :data:`FAULTS`

  Run it alone with ``python -m consumers.gateway serve --port 8099
  [--latency-ms 50]``, or in process: ``with Gateway(latency=0.05) as gw: ... gw.url``.
  ``latency`` is how long every charge takes to answer (a remote system's time).

* The consumer app: ``payments.charge-requested`` (``PAYMENTS_TOPIC``), key
  ``{tenant_id}:charge:{order_id}``, hash over amount and currency, in
  ``mode="leased"`` because its effect lives outside this database. The handler
  passes ``ctx.idempotency_key`` as the ``Idempotency-Key`` header: that is what
  makes the remote effect exactly-once. A request that got no answer (timeout,
  connection reset, closed without a response) may or may not have been applied,
  so it raises :class:`UnknownOutcome`; the next attempt first runs the
  reconciler, which asks the gateway by key (``GET /charges/<key>``) and
  completes the record with the charge found, without charging again.
  ``build_app(concurrency=64)`` runs up to 64 charges at once (key-ordered);
  ``build_app(use_async=True)`` registers the same handler and reconciler as
  ``async def`` over :class:`AsyncGatewayClient` (asyncio streams).

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
import asyncio
import contextlib
import datetime as dt
import http
import http.client
import json
import logging
import os
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from consumers import payments
from kafka_idem import (
    App,
    AsyncContext,
    Context,
    Done,
    Permanent,
    Retryable,
    RetryPolicy,
    UnknownOutcome,
)

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
        self.latency = 0.0  # seconds every charge takes
        self.in_flight = 0  # POST /charges being answered now
        self.max_in_flight = 0  # the most at once since the start or the last reset

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Around one POST /charges, from its request read to its answer written."""
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1

    def in_flight_stats(self, *, reset: bool = False) -> dict[str, int]:
        with self.lock:
            if reset:
                self.max_in_flight = self.in_flight
            return {"now": self.in_flight, "max": self.max_in_flight}

    def apply(self, key: str, request: dict[str, Any]) -> tuple[int, Any]:
        """Charge ``request`` under ``key`` once: (201, new charge), (200, the same charge
        again) or (409, the key was first used with another request)."""
        with self.lock:
            existing = self.charges.get(key)
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
                self.charges[key] = charge
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
        elif path == "/_in_flight":
            self._send(200, st.in_flight_stats())
        elif path == "/_faults":
            with st.lock:
                self._send(200, {**st.faults, "held": st.held})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/charges":
            with self.server.state.answering():
                self._charge()
        elif path == "/_in_flight":
            self._send(200, self.server.state.in_flight_stats(reset=True))
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
            raw = self._read_json()
        except ValueError:
            raw = None
        request, refused = _charge_request(key, raw)
        if refused is not None:
            self._send(*refused)
            return
        assert key is not None and request is not None
        if st.latency:
            time.sleep(st.latency)
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
        return self.server.state.apply(key, request)


def _charge_request(
    key: str | None, body: Any
) -> tuple[dict[str, Any] | None, tuple[int, dict[str, str]] | None]:
    """A POST /charges body as a request, or the answer refusing it."""
    try:
        amount = Decimal(str(body["amount"]))
        request: dict[str, Any] = {
            "tenant_id": str(body["tenant_id"]),
            "order_id": str(body["order_id"]),
            "amount": amount,
            "currency": str(body["currency"]),
        }
    except (ValueError, KeyError, TypeError, InvalidOperation):
        return None, (400, {"error": "body must be JSON {amount, currency, tenant_id, order_id}"})
    if not key:
        return None, (400, {"error": "the Idempotency-Key header is required"})
    if not amount.is_finite() or amount <= 0:
        return None, (422, {"error": "amount must be positive"})
    return request, None


async def _charge_async(state: _State, key: str | None, data: bytes) -> tuple[int, Any]:
    try:
        raw = json.loads(data or b"null")
    except ValueError:
        raw = None
    request, refused = _charge_request(key, raw)
    if refused is not None:
        return refused
    assert key is not None and request is not None
    if state.latency:
        await asyncio.sleep(state.latency)
    return state.apply(key, request)


async def serve_asyncio(host: str, port: int, state: _State,
                        on_ready: Any = None) -> None:
    """The gateway's charges on one asyncio thread (``serve --asyncio``): the same
    answers for POST /charges, GET /charges, GET /charges/<key> and /_in_flight, HTTP/1.1 kept
    alive, ``latency`` as an ``asyncio.sleep``; no fault injection. A benchmark's
    remote system: thousands of charges a second on one core, where the threaded
    server spends a thread per connection."""

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                data = await reader.readexactly(int(headers.get("content-length") or 0))
                path = urllib.parse.urlsplit(target).path
                key = headers.get("idempotency-key")
                with state.lock:
                    state.requests.append({"method": method, "path": target,
                                           "idempotency_key": key})
                status, body = 404, {"error": "not found"}
                body_: Any = body
                if method == "POST" and path == "/charges":
                    with state.answering():
                        status, body_ = await _charge_async(state, key, data)
                elif path == "/_in_flight":
                    status, body_ = 200, state.in_flight_stats(reset=method == "POST")
                elif method == "GET" and path == "/charges":
                    with state.lock:
                        status, body_ = 200, {"charges": list(state.charges.values())}
                elif method == "GET" and path.startswith("/charges/"):
                    with state.lock:
                        found = state.charges.get(urllib.parse.unquote(path[len("/charges/"):]))
                    status, body_ = (200, found) if found else (
                        404, {"error": "no charge with this idempotency key"})
                out = json.dumps(body_).encode()
                writer.write(f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(out)}"
                             "\r\n\r\n".encode() + out)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        finally:
            writer.close()

    server = await asyncio.start_server(one, host, port, backlog=1024)
    if on_ready is not None:
        on_ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many clients at once (concurrency=64 and more)
    state: _State


class Gateway:
    """The payment gateway, in process: ``with Gateway() as gw: requests to gw.url``.

    ``port=0`` picks a free port. Only binds 127.0.0.1.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *, latency: float = 0.0) -> None:
        self.server = _Server((host, port), _Handler)
        self.server.state = _State()
        self.server.state.latency = latency
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

    def in_flight(self, *, reset: bool = False) -> dict[str, int]:
        """``{"now": n, "max": m}``: charges being answered now, and the most at once
        since the start or the last reset (``reset=True`` sets it to now)."""
        return self.state.in_flight_stats(reset=reset)


# --- the client the handler uses -----------------------------------------------------------

class GatewayClient:
    """Calls the gateway; maps "no answer" to :class:`UnknownOutcome`.

    HTTP/1.1 connections are kept open and reused, one per thread (a key-ordered
    handler runs on many threads at once): a new connection per request would cost
    a TCP handshake and its set-up CPU on every charge. A failure after the request
    was written is an unknown outcome whether the connection was new or reused (the
    reconciler asks the gateway by key). No proxies: ``http.client`` never reads
    ``HTTP(S)_PROXY``, so a local call is never turned into a remote one."""

    def __init__(self, url: str | None = None, timeout: float | None = None) -> None:
        self._url = url
        self._timeout = timeout
        self._local = threading.local()  # this thread's connection and what it is for

    @property
    def url(self) -> str:
        return (self._url or os.environ.get("GATEWAY_URL") or DEFAULT_URL).rstrip("/")

    @property
    def timeout(self) -> float:
        if self._timeout is not None:
            return self._timeout
        return float(os.environ.get("GATEWAY_TIMEOUT_SECONDS", DEFAULT_TIMEOUT))

    def _http(self) -> tuple[http.client.HTTPConnection, str]:
        """This thread's connection to the gateway (opened when first used) and the
        URL's path prefix."""
        parts = urllib.parse.urlsplit(self.url)
        target = (parts.scheme, parts.netloc, self.timeout)
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or self._local.target != target:
            if conn is not None:
                conn.close()
            cls = http.client.HTTPSConnection if parts.scheme == "https" else (
                http.client.HTTPConnection)
            conn = self._local.conn = cls(parts.netloc, timeout=self.timeout)
            self._local.target = target
        return conn, parts.path

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
        conn, prefix = self._http()
        try:
            if conn.sock is None:
                conn.connect()  # nothing sent yet: a refusal is surely not applied
        except ConnectionRefusedError as exc:
            conn.close()
            raise Retryable(f"gateway refused the connection: {exc}") from exc
        except (TimeoutError, OSError) as exc:
            conn.close()
            raise UnknownOutcome(f"no answer from the gateway: {type(exc).__name__}: {exc}"
                                 ) from exc
        try:
            conn.request(method, prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            # Timeout, reset, or closed without a response: it may have been applied.
            conn.close()
            raise UnknownOutcome(f"no answer from the gateway: {type(exc).__name__}: {exc}",
                                 ) from exc
        if resp.will_close:
            conn.close()  # the next request opens a new one
        status = int(resp.status)
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            if status < 400:
                raise
            return status, None  # an error page that is not JSON

    def charge(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        status, answer = self._call("POST", "/charges", key=key, body=request)
        return self._charged(status, answer)

    def _charged(self, status: int, answer: Any) -> dict[str, Any]:
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
        return self._found(status, answer)

    def _found(self, status: int, answer: Any) -> dict[str, Any] | None:
        if status == 200:
            return dict(answer)
        if status == 404:
            return None
        raise UnknownOutcome(f"gateway could not be asked about the charge ({status})")


class AsyncGatewayClient(GatewayClient):
    """:class:`GatewayClient` for ``async def`` handlers: asyncio streams, HTTP/1.1
    connections kept open and reused (one per request in flight); the same answers,
    the same errors. A failure after the request was written is an unknown outcome
    (the reconciler asks the gateway by key), whether the connection was new or not."""

    def __init__(self, url: str | None = None, timeout: float | None = None) -> None:
        super().__init__(url, timeout)
        # idle connections, each with the event loop it belongs to
        self._idle: list[tuple[Any, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        while self._idle:
            owner, reader, writer = self._idle.pop()
            if owner is loop and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        parts = urllib.parse.urlsplit(self.url)
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port), self.timeout)
        except ConnectionRefusedError as exc:
            raise Retryable(f"gateway refused the connection: {exc}") from exc
        except (TimeoutError, OSError) as exc:
            raise Retryable(f"gateway not reached: {type(exc).__name__}: {exc}") from exc

    async def _acall(self, method: str, path: str, *, key: str | None = None,
                     body: Any = None) -> tuple[int, Any]:
        parts = urllib.parse.urlsplit(self.url)
        data = json.dumps(body).encode() if body is not None else b""
        head = [f"{method} {parts.path.rstrip('/')}{path} HTTP/1.1",
                f"Host: {parts.netloc}", "Accept: application/json",
                f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        if key is not None:
            head.append(f"Idempotency-Key: {key}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + data
        reader, writer = await self._connection()
        keep = False
        try:
            writer.write(request)
            async with asyncio.timeout(self.timeout):  # no task per call, as wait_for makes
                status, raw, keep = await self._response(reader)
        except (TimeoutError, OSError, EOFError, ValueError, asyncio.LimitOverrunError) as exc:
            raise UnknownOutcome(f"no answer from the gateway: {type(exc).__name__}: {exc}"
                                 ) from exc
        finally:
            if keep:
                self._idle.append((asyncio.get_running_loop(), reader, writer))
            else:
                writer.close()
        try:
            return status, json.loads(raw or b"null")
        except ValueError as exc:
            raise UnknownOutcome(f"no answer from the gateway: a cut response ({exc})") from exc

    @staticmethod
    async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        """(status, body, whether the connection may be reused)."""
        head = await reader.readuntil(b"\r\n\r\n")  # IncompleteReadError is an EOFError
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        if "content-length" not in headers:
            return status, await reader.read(), False  # the body ends with the connection
        body = await reader.readexactly(int(headers["content-length"]))
        return status, body, headers.get("connection", "").lower() != "close"

    async def charge_async(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        status, answer = await self._acall("POST", "/charges", key=key, body=request)
        return self._charged(status, answer)

    async def find_async(self, key: str) -> dict[str, Any] | None:
        try:
            status, answer = await self._acall(
                "GET", "/charges/" + urllib.parse.quote(key, safe=""))
        except Retryable as exc:  # can't ask: still unknown
            raise UnknownOutcome(str(exc)) from exc
        return self._found(status, answer)


# --- the consumer app ---------------------------------------------------------------------


def create_tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS payments")
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS payments.gateway_charges (
            id              bigserial,
            -- the handler's shard key (its default: the idempotency key) first: on Citus
            -- the table is distributed by it with the records (co_locate below)
            idempotency_key text          NOT NULL,
            charge_id       text          NOT NULL,
            amount          numeric(18,2) NOT NULL,
            currency        text          NOT NULL,
            created_at      timestamptz   NOT NULL DEFAULT now(),
            PRIMARY KEY (idempotency_key, id)
        )
        """
    )


def co_locate(app: App) -> Any:
    """The migration that, on a store distributed on Citus, distributes the charges table
    by idempotency key with the store's records (the handler's default shard key): a
    charge's row and its record are then one shard's transaction. Nothing on one
    PostgreSQL."""
    def co_locate_charges(conn: Any) -> None:
        app.co_locate(conn, "payments.gateway_charges", "idempotency_key")

    return co_locate_charges


def _record_args(ctx: Context, charge: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT INTO payments.gateway_charges (idempotency_key, charge_id, amount, currency)"
        " VALUES (%s, %s, %s, %s)",
        (ctx.idempotency_key, charge["id"], Decimal(charge["amount"]), charge["currency"]),
    )


def _record(ctx: Context, charge: dict[str, Any]) -> dict[str, Any]:
    ctx.tx.execute(*_record_args(ctx, charge))
    return {"charge_id": charge["id"]}


async def _record_async(ctx: AsyncContext, charge: dict[str, Any]) -> dict[str, Any]:
    await ctx.tx.execute(*_record_args(ctx, charge))
    return {"charge_id": charge["id"]}


def _request(msg: payments.ChargeRequested) -> dict[str, Any]:
    return {"tenant_id": msg.tenant_id, "order_id": msg.order_id,
            "amount": str(msg.amount), "currency": msg.currency}


def build_app(
    *,
    topic: str = TOPIC,
    gateway_url: str | None = None,
    timeout: float | None = None,
    retry: RetryPolicy | None = None,
    name: str = "gateway",
    concurrency: int | None = None,
    ordering_key: str | None = None,
    use_async: bool | None = None,
    **settings: Any,
) -> App:
    """The gateway app on ``topic``; ``gateway_url`` defaults to ``$GATEWAY_URL``,
    ``timeout`` to ``$GATEWAY_TIMEOUT_SECONDS`` (2 s); ``retry`` is the handler's own
    policy (default: from the settings); ``concurrency`` (``$GATEWAY_CONCURRENCY``, 1),
    ``ordering_key`` (``$GATEWAY_ORDERING_KEY``) and ``use_async``
    (``$GATEWAY_ASYNC=1``) choose how charges run; ``settings`` override Settings fields."""
    settings.setdefault("schemas_dir", payments.SCHEMAS_DIR)
    if concurrency is None:
        concurrency = int(os.environ.get("GATEWAY_CONCURRENCY") or 1)
    if ordering_key is None:
        ordering_key = os.environ.get("GATEWAY_ORDERING_KEY") or None
    if use_async is None:
        use_async = os.environ.get("GATEWAY_ASYNC", "") in ("1", "true", "yes")
    # No group_id here: KAFKA_IDEM_GROUP_ID (or run --group-id) chooses it, else the name.
    client = AsyncGatewayClient(gateway_url, timeout)
    application = App(name, **settings)
    application.migration(create_tables)
    application.migration(co_locate(application))  # on Citus: with the records, by key
    register = application.handler(
        topic=topic,
        model=payments.ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"),
        schema=payments.SCHEMA,
        mode="leased",
        retry=retry,
        concurrency=concurrency,
        ordering_key=ordering_key,
    )
    if use_async:

        @register
        async def charge_async(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
            found = await client.charge_async(ctx.idempotency_key, _request(msg))
            return await _record_async(ctx, found)

        @charge_async.reconciler
        async def reconcile_async(msg: payments.ChargeRequested,
                                  ctx: AsyncContext) -> Done | None:
            found = await client.find_async(ctx.idempotency_key)
            if found is None:
                return None  # never applied: the handler runs again with the same key
            return Done(await _record_async(ctx, found))

        return application

    @register
    def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
        found = client.charge(ctx.idempotency_key, _request(msg))
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
    serve.add_argument("--latency-ms", type=float, default=0.0,
                       help="how long every charge takes to answer")
    serve.add_argument("--asyncio", action="store_true",
                       help="serve charges on one asyncio thread (no fault injection)")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.asyncio:
        state = _State()
        state.latency = args.latency_ms / 1000

        def ready(port: int) -> None:
            print(f"payment gateway listening on http://127.0.0.1:{port}", flush=True)

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_asyncio("127.0.0.1", args.port, state, ready))
        return
    if args.command == "serve":
        gw = Gateway(port=args.port, latency=args.latency_ms / 1000)
        print(f"payment gateway listening on {gw.url}", flush=True)
        try:
            gw.server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            gw.server.server_close()


if __name__ == "__main__":
    main()
