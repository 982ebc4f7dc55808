"""The console's web application: its routes, their error pages, its lifespan.

Every page reads through the same functions as the CLI (:mod:`kafka_idem.admin`,
:mod:`kafka_idem.replay`, the store's queries); every action is one of the CLI's
operations, run with the operator's name in the audit trail:

========================  =======================================================
GET  /                    overview (``?fragment=1``: the part that refreshes itself),
                          with the app's handlers, paused or not
GET  /records             records by key, prefix, namespace, handler, status, time
GET  /record              one record: every field, audit trail, dead letters
GET  /dlq                 the app's DLQ topics; ``?topic=`` its records, filtered
GET  /letter              one dead letter: headers, decoded payload, the key's state
GET  /redrive             the re-drive form (a ``dlq replay``) for a filter
POST /redrive/dry-run     the replay's dry run, as a job
POST /redrive/run         the replay itself (after its dry run), as a job
GET  /rerun               the bulk re-run form (``rerun`` with filters)
POST /rerun/dry-run       the bulk re-run's dry run, as a job
POST /rerun/run           the bulk re-run (after its dry run), as a job
POST /rerun/keys          re-run chosen keys (``rerun KEY`` for each), as a job
POST /handlers/pause      pause a handler (``kafka-idem pause``), with a reason
POST /handlers/resume     resume a paused handler (``kafka-idem resume``)
GET  /jobs, /jobs/{id}    the jobs, one job's progress and result
GET  /login, POST /login  the token form (when the console has a token)
GET  /healthz             200 when up (``?ready=1``: once the DLQ index caught up)
========================  =======================================================
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kafka_idem.admin import operations as admin
from kafka_idem.app import App
from kafka_idem.console import actions, pages, security
from kafka_idem.console.forms import BadInput
from kafka_idem.console.state import Console, Options
from kafka_idem.errors import KafkaIdemError
from kafka_idem.observe.redact import redact
from kafka_idem.settings import Settings

log = logging.getLogger(__name__)

Handler = Callable[[Console, Request], Response]


def _page(console: Console, fn: Handler) -> Callable[[Request], Any]:
    """``fn`` as an endpoint: run on a worker thread (the store and Kafka calls block),
    bad input, refusals and outages shown as a page with their status."""
    async def endpoint(request: Request) -> Response:
        if request.method == "POST" and getattr(request.state, "form", None) is None:
            request.state.form = await request.form()
        try:
            return await run_in_threadpool(fn, console, request)
        except BadInput as exc:
            return console.render(request, "error.html", 400, title="Bad input",
                                  message=str(exc))
        except admin.Refused as exc:
            return console.render(request, "error.html", 409, title="Refused",
                                  message=redact(str(exc), console.secrets()))
        except KafkaIdemError as exc:
            log.warning("console: %s", redact(str(exc), console.secrets()))
            return console.render(request, "error.html", 503, title="Not available",
                                  message=redact(f"{type(exc).__name__}: {exc}",
                                                 console.secrets()))
    return endpoint


async def no_icon(request: Request) -> Response:
    """No icon (a browser asks for one on every first visit)."""
    return Response(status_code=204)


def build(console: Console) -> Starlette:
    """The Starlette application of ``console``."""
    def page(fn: Handler) -> Callable[[Request], Any]:
        return _page(console, fn)

    async def healthz(request: Request) -> Response:  # no thread: it must answer at once
        return pages.healthz(console, request)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(console.start)
        try:
            yield
        finally:
            await run_in_threadpool(console.stop)

    static = StaticFiles(directory=str(resources.files("kafka_idem.console") / "static"))
    routes = [
        Route("/", page(pages.overview)),
        Route("/records", page(pages.records)),
        Route("/record", page(pages.record)),
        Route("/dlq", page(pages.dlq)),
        Route("/letter", page(pages.letter)),
        Route("/redrive", page(pages.redrive_form)),
        Route("/redrive/dry-run", page(actions.redrive_dry_run), methods=["POST"]),
        Route("/redrive/run", page(actions.redrive_run), methods=["POST"]),
        Route("/rerun", page(pages.rerun_form)),
        Route("/rerun/dry-run", page(actions.rerun_dry_run), methods=["POST"]),
        Route("/rerun/run", page(actions.rerun_run), methods=["POST"]),
        Route("/rerun/keys", page(actions.rerun_keys), methods=["POST"]),
        Route("/handlers/pause", page(actions.pause_handler), methods=["POST"]),
        Route("/handlers/resume", page(actions.resume_handler), methods=["POST"]),
        Route("/jobs", page(pages.jobs)),
        Route("/jobs/{job_id}", page(pages.job_page)),
        Route("/login", page(pages.login_page)),
        Route("/login", page(actions.login), methods=["POST"]),
        Route("/logout", page(actions.logout), methods=["POST"]),
        Route("/healthz", healthz),
        Route("/favicon.ico", no_icon),
        Mount("/static", app=static, name="static"),
    ]
    web = Starlette(routes=routes, lifespan=lifespan)
    web.add_middleware(security.GuardMiddleware, guard=console.guard)
    return web


def create_app(app: App, settings: Settings, options: Options) -> Starlette:
    """The console of ``app`` (its handlers name the DLQ topics it shows) as an ASGI
    application: serve it with any ASGI server, or mount it in another application."""
    token = settings.console_token.get_secret_value() if settings.console_token else None
    guard = security.Guard(token=token, read_only=options.read_only, actor=options.actor,
                           port=options.port)
    return build(Console(app, settings, options, guard))
