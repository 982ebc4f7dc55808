"""A small in-test Schema Registry on 127.0.0.1 that follows Confluent's documented
REST API (https://docs.confluent.io/platform/current/schema-registry/develop/api.html)
for what kafka_idem's client calls:

* ``GET /schemas/ids/{id}`` -> ``{"schema": ..., "schemaType": ...}`` (no type for AVRO),
  404 ``{"error_code": 40403}`` for an unknown id;
* ``POST /subjects/{subject}/versions`` ``{"schema", "schemaType"}`` -> ``{"id": n}``
  (the same schema text gets the same id, as in Confluent's registry);
* ``POST /subjects/{subject}`` (lookup) and ``GET /subjects/{subject}/versions/latest``.

Schemas are returned as they were registered, whatever ``?format=`` asks: a
Protobuf schema registered by ``ProtobufSerializer`` is the base64 serialized
``FileDescriptorProto`` that ``format=serialized`` asks for.

The registry tests run against a real one (Apicurio Registry, ``scripts/registry.sh``,
the ``schema_registry`` fixture); this one is for what a real registry cannot do on
demand: ``down = True`` answers 503 to everything (an outage), ``requests`` lists
what a codec asked (its cache), and the unit tests need no service.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class Registry:
    def __init__(self) -> None:
        self.schemas: dict[int, tuple[str, str]] = {}  # id -> (schema text, type)
        self.subjects: dict[str, list[int]] = {}
        self.requests: list[str] = []
        self.down = False
        self.lock = threading.Lock()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                path = urllib.parse.urlsplit(self.path).path
                registry.requests.append(f"{method} {path}")
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                if registry.down:
                    self._answer(503, {"error_code": 50301, "message": "unavailable"})
                    return
                status, answer = registry.answer(method, path.strip("/").split("/"), body)
                self._answer(status, answer)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def register(self, subject: str, schema: str, schema_type: str = "AVRO") -> int:
        with self.lock:
            known = [i for i, entry in self.schemas.items() if entry == (schema, schema_type)]
            sid = known[0] if known else 100 + len(self.schemas)
            self.schemas[sid] = (schema, schema_type)
            versions = self.subjects.setdefault(subject, [])
            if sid not in versions:
                versions.append(sid)
            return sid

    def _schema(self, sid: int) -> dict[str, Any]:
        text, kind = self.schemas[sid]
        out: dict[str, Any] = {"schema": text}
        if kind != "AVRO":
            out["schemaType"] = kind
        return out

    def answer(self, method: str, parts: list[str], body: Any) -> tuple[int, Any]:
        not_found = (404, {"error_code": 40403, "message": "Schema not found"})
        if method == "GET" and parts[:2] == ["schemas", "ids"] and len(parts) == 3:
            sid = int(parts[2]) if parts[2].isdigit() else -1
            return (200, self._schema(sid)) if sid in self.schemas else not_found
        if parts[:1] == ["subjects"] and len(parts) >= 2:
            subject = urllib.parse.unquote(parts[1])
            if method == "POST" and len(parts) == 3 and parts[2] == "versions":
                sid = self.register(subject, body["schema"], body.get("schemaType") or "AVRO")
                return 200, {"id": sid}
            versions = self.subjects.get(subject, [])
            if method == "POST" and len(parts) == 2:  # lookup
                kind = body.get("schemaType") or "AVRO"
                for n, sid in enumerate(versions, 1):
                    if self.schemas[sid] == (body["schema"], kind):
                        return 200, {"subject": subject, "version": n, "id": sid,
                                     **self._schema(sid)}
                return 404, {"error_code": 40403, "message": "Schema not found"}
            if method == "GET" and parts[2:] == ["versions", "latest"] and versions:
                return 200, {"subject": subject, "version": len(versions), "id": versions[-1],
                             **self._schema(versions[-1])}
            return 404, {"error_code": 40401, "message": "Subject not found"}
        return 404, {"error_code": 404, "message": "HTTP 404 Not Found"}

    def __enter__(self) -> Registry:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
