"""The console's actions (POST, each with its CSRF token): the dry runs and runs of
re-drives and re-runs, as jobs, pausing and resuming a handler, and the login. Each is
one of the CLI's operations (:func:`kafka_idem.replay.replay`,
:func:`~kafka_idem.replay.bulk.bulk_rerun`, :func:`~kafka_idem.replay.single.rerun_key`,
:func:`~kafka_idem.admin.pauses.pause`), run with the operator's name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from kafka_idem import replay
from kafka_idem.admin import pauses
from kafka_idem.console import security
from kafka_idem.console.forms import (
    BadInput,
    filter_of,
    form,
    picked_keys,
    picks_of,
    selection,
    selection_fields,
)
from kafka_idem.console.jobs import Job
from kafka_idem.console.state import Console
from kafka_idem.errors import KafkaIdemError
from kafka_idem.observe.redact import redact
from kafka_idem.replay.bulk import Filter, bulk_rerun
from kafka_idem.replay.single import rerun_key
from kafka_idem.replay.summary import replay_group


def run_replays(console: Console, job: Job, *, dry_run: bool, reason: str | None) -> dict[str, Any]:
    """One replay of the job's records: its filter, or the records picked by hand; a
    confirmed run (``positions`` in its params: what its dry run would send) acts on
    those records only, never on more than the operator saw."""
    p = job.params
    chosen = p["positions"] if p.get("positions") is not None else p["picks"]
    sel = _records(selection(p["filters"]), chosen)
    would: list[dict[str, Any]] = []
    positions: list[list[int]] = []

    def on_action(rec: replay.DlqRecord, target: str, action: str) -> None:
        positions.append([rec.partition, rec.offset])
        if len(would) < 200:
            would.append({"partition": rec.partition, "offset": rec.offset,
                          "key": rec.idempotency_key, "kind": rec.kind, "target": target,
                          "action": action})

    summary = replay.replay(
        console.settings, console.store, p["topic"], sel, dry_run=dry_run,
        actor=job.actor, reason=reason, include_permanent=p["include_permanent"],
        app=console.app, trust_unsigned=console.options.trust_unsigned,
        on_action=on_action if dry_run else None, on_progress=job.report)
    # A confirmation is a replay of the records its dry run would send: a group of its
    # own, named from their positions (not the dry run's, named from the filter).
    confirm_group = None if not (dry_run and positions) else replay_group(
        p["topic"], _records(selection(p["filters"]), positions), None,
        p["include_permanent"], prefix=console.settings.name_prefix)
    return {"summaries": [summary.to_json()], "totals": totals([summary]),
            "would_send": would, "positions": positions, "confirm_group": confirm_group}


def _records(sel: replay.Selection, chosen: list[Any]) -> replay.Selection:
    """``sel`` held to the records at ``chosen`` positions, if any: the filter's fields
    stay (the audit row says them), its range is theirs."""
    if not chosen:
        return sel
    kept = {k: v for k, v in dataclasses.asdict(sel).items()
            if v is not None and k not in ("partition", "from_offset", "to_offset")}
    return replay.Selection.at((tuple(x) for x in chosen), **kept)


def redrive_dry_run(console: Console, request: Request) -> Response:
    data = form(request)
    topic = console.dlq_topic(data)
    sel = selection(data)
    picks = picks_of(data)
    if data.get("by") == "picks" and not picks:
        raise BadInput("tick at least one record")
    fields = selection_fields(sel)
    params = {"topic": topic, "filters": fields, "picks": picks,
              "include_permanent": data.get("include_permanent") == "on"}
    what = (f"{len(picks)} chosen record(s)" if picks else
            ", ".join(f"{k}={v}" for k, v in fields.items()) or "every record")
    if params["include_permanent"]:
        what += "; also keys that failed permanently"
    job = console.jobs.start(
        "redrive-dry-run", f"Dry run: re-drive {topic} ({what})", params,
        console.actor(request), lambda job: run_replays(console, job, dry_run=True, reason=None))
    return RedirectResponse(f"/jobs/{job.id}", status_code=303)


def _confirm(console: Console, request: Request, dry_kind: str, kind: str,
             pin: Callable[[dict[str, Any]], dict[str, Any]],
             run: Callable[..., dict[str, Any]]) -> Response:
    """Start the job a confirmation asks for: its dry run (a finished ``dry_kind`` job)
    and a reason are required; ``pin(dry run's result)`` gives the params that hold
    the run to what the dry run showed; ``run(console, job, dry_run=, reason=)``."""
    data = form(request)
    dry = console.jobs.get(str(data.get("dry_run") or ""))
    if dry is None or dry.kind != dry_kind or dry.state != "done" or dry.result is None:
        raise BadInput("run the dry run first (its job is gone or did not finish)")
    reason = str(data.get("reason") or "").strip()
    if not reason:
        raise BadInput("reason: say why (it is kept in the audit trail)")
    params = {**dry.params, **pin(dry.result)}
    with console.conn() as conn:
        last = console.store.audit_last_id(conn)
    job = console.jobs.start(
        kind, dry.title.replace("Dry run: r", "R", 1), params, console.actor(request),
        lambda job: run(console, job, dry_run=False, reason=reason), audit_after=last)
    return RedirectResponse(f"/jobs/{job.id}", status_code=303)


def _pin_positions(result: dict[str, Any]) -> dict[str, Any]:
    if not result["positions"]:
        raise BadInput("its dry run would send nothing")
    return {"positions": result["positions"]}


def redrive_run(console: Console, request: Request) -> Response:
    return _confirm(console, request, "redrive-dry-run", "redrive", _pin_positions,
                    run_replays)


def run_bulk(console: Console, job: Job, *, dry_run: bool, reason: str | None) -> dict[str, Any]:
    """The bulk re-run of the job's filter; a confirmed run re-runs only the keys its
    dry run selected (``keys`` in its params)."""
    flt = own_filter(console, job.params["filters"])
    if job.params.get("keys") is not None:
        flt = dataclasses.replace(flt, keys=frozenset(tuple(k) for k in job.params["keys"]))
    with console.conn() as conn:
        summary = bulk_rerun(console.settings, conn, console.store, flt, dlq_topic=None,
                             actor=job.actor, reason=reason, dry_run=dry_run,
                             trust_unsigned=console.options.trust_unsigned,
                             on_progress=job.report, app=console.app, via=job.via)
    out = summary.to_json()
    out["selected"] = summary.selected
    out["keys"] = [list(k) for k in summary.keys]
    return out


def own_filter(console: Console, params: Any) -> Filter:
    """A bulk re-run's filter, inside the app's namespace (the console re-runs its own
    app's keys only, as a replay with --app does)."""
    given = {k: str(v) for k, v in params.items()}
    if given.get("namespace", console.app.namespace) not in ("", console.app.namespace):
        raise BadInput(f"namespace: {given['namespace']!r} is another app's (this console's "
                       f"app {console.app.name!r} has namespace {console.app.namespace!r}); "
                       "re-run it from that app's console")
    filter_of(given)  # the operator's own filters: at least one (never every failed key)
    return filter_of({**given, "namespace": console.app.namespace})


def rerun_dry_run(console: Console, request: Request) -> Response:
    data = form(request)
    flt = own_filter(console, data)
    params = {"filters": {k: str(v) for k, v in flt.to_json().items()}}
    what = ", ".join(f"{k}={v}" for k, v in params["filters"].items())
    job = console.jobs.start("rerun-dry-run", f"Dry run: re-run failed records ({what})",
                             params, console.actor(request),
                             lambda job: run_bulk(console, job, dry_run=True, reason=None))
    return RedirectResponse(f"/jobs/{job.id}", status_code=303)


def rerun_run(console: Console, request: Request) -> Response:
    return _confirm(console, request, "rerun-dry-run", "rerun",
                    lambda result: {"keys": result["keys"]}, run_bulk)


def rerun_keys(console: Console, request: Request) -> Response:
    data = form(request)
    picked = picked_keys(data)
    reason = str(data.get("reason") or "").strip()
    if not reason:
        with console.conn() as conn:
            states = {(r["namespace"], r["idempotency_key"]): r for r in
                      console.store.redrive_states(conn, picked)}
        return console.render(request, "rerun_keys.html", title="Re-run chosen records",
                              picked=picked, states=states)
    with console.conn() as conn:
        last = console.store.audit_last_id(conn)

    def work(job: Job) -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        for i, (ns, key) in enumerate(picked):
            job.report(i, len(picked), sum(1 for r in results if r["ok"]))
            try:
                with console.conn() as conn:
                    done = rerun_key(console.settings, conn, console.store, key,
                                     actor=job.actor, reason=reason, namespace=ns,
                                     trust_unsigned=console.options.trust_unsigned,
                                     via=job.via, app=console.app)
                results.append({"namespace": ns, "key": key, "ok": True,
                                "what": f"republished to {done.target} from "
                                f"{done.dlq_topic}[{done.letter.partition}]@"
                                f"{done.letter.offset}"})
            except KafkaIdemError as exc:
                results.append({"namespace": ns, "key": key, "ok": False,
                                "what": redact(str(exc), console.secrets())})
        job.report(len(picked), len(picked), sum(1 for r in results if r["ok"]))
        return {"results": results, "rerun": sum(1 for r in results if r["ok"]),
                "refused": sum(1 for r in results if not r["ok"])}

    title = (f"Re-run {picked[0][1]}" if len(picked) == 1
             else f"Re-run {len(picked)} chosen records")
    job = console.jobs.start("rerun-keys", title, {"picked": picked},
                             console.actor(request), work, audit_after=last)
    return RedirectResponse(f"/jobs/{job.id}", status_code=303)


def pause_handler(console: Console, request: Request) -> Response:
    """Pause one of the app's handlers on every member (``kafka-idem pause``), audited
    with the operator's name; a reason is required."""
    data = form(request)
    name = _handler(console, data)
    reason = str(data.get("reason") or "").strip()
    if not reason:
        raise BadInput("reason: say why the handler is paused (it is kept with the pause "
                       "and in the audit trail)")
    with console.conn() as conn, conn.transaction():
        pauses.pause(conn, console.store.scoped(console.app.namespace), handler=name,
                     actor=console.actor(request), reason=reason)
    return RedirectResponse("/#handlers", status_code=303)


def resume_handler(console: Console, request: Request) -> Response:
    """Resume a paused handler (``kafka-idem resume``), audited with the operator's name."""
    data = form(request)
    name = _handler(console, data)
    reason = str(data.get("reason") or "").strip() or None
    with console.conn() as conn, conn.transaction():
        pauses.resume(conn, console.store.scoped(console.app.namespace), handler=name,
                      actor=console.actor(request), reason=reason)
    return RedirectResponse("/#handlers", status_code=303)


def _handler(console: Console, data: Any) -> str:
    name = str(data.get("handler") or "")
    known = pauses.handler_names(console.app)
    if name not in known:
        raise BadInput(f"handler: {name!r} is none of this app's ({', '.join(known)})")
    return name


def login(console: Console, request: Request) -> Response:
    data = form(request)
    target = security.safe_next(str(data.get("next") or "/"))
    operator = security.clean_operator(str(data.get("operator") or ""))
    if console.guard.token is None:
        return RedirectResponse("/", status_code=303)
    if not console.guard.check_token(str(data.get("token") or "")) or not operator:
        why = "wrong token" if operator else "give your name (it goes in the audit trail)"
        return console.render(request, "login.html", 401, title="Log in", error=why,
                              next=target)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(console.guard.session_name, console.guard.session_cookie(operator),
                        max_age=security.SESSION_SECONDS, httponly=True, samesite="strict",
                        path="/")
    return response


def logout(console: Console, request: Request) -> Response:
    cookie = request.cookies.get(console.guard.session_name)
    if cookie:
        console.guard.revoked.add(cookie)  # the cookie is refused from now on, kept or not
    response = RedirectResponse("/login" if console.guard.token else "/", status_code=303)
    response.delete_cookie(console.guard.session_name, path="/")
    return response


def totals(summaries: list[replay.ReplaySummary]) -> dict[str, Any]:
    """Several replays' counts added up (the records picked by hand: one replay each)."""
    by_kind: dict[str, dict[str, int]] = {}
    untrusted: dict[str, int] = {}
    for s in summaries:
        for kind, per in s.by_kind.items():
            mine = by_kind.setdefault(kind, {})
            for outcome, n in per.items():
                mine[outcome] = mine.get(outcome, 0) + n
        for why, n in s.untrusted.items():
            untrusted[why] = untrusted.get(why, 0) + n
    return {"scanned": sum(s.scanned for s in summaries),
            "matched": sum(s.matched for s in summaries),
            "sent": sum(s.sent for s in summaries),
            "would_send": sum(s.would_send for s in summaries),
            "by_kind": by_kind, "untrusted": untrusted,
            "unsendable": [u for s in summaries for u in s.unsendable],
            "groups": [s.group for s in summaries], "runs": [s.run for s in summaries],
            "outcomes": [o for o in replay.OUTCOMES
                         if any(per.get(o) for per in by_kind.values())]}


