"""Markdown tables from a results file: ``python -m bench.report [bench/results.json]``.

For ``docs/PERFORMANCE.md`` and ``bench/HISTORY.md``: the same figures as the run's console tables,
copied without retyping a number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if v is None else fmt.format(v)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def main_table(d: dict[str, Any]) -> list[str]:
    out = [
        _row(["path", "messages", "msgs/s", "x raw", "x SQL limit", "x naive",
              "CPU s/1k: consumer", "PG", "broker", "p50 ms", "p99 ms", "at msgs/s",
              "peak RSS MB", "exactly-once check"]),
        _row(["---", *(["---:"] * 12), "---"]),
    ]
    paths = {p["path"]: p for p in d["paths"]}

    def path_row(p: dict[str, Any]) -> None:
        lat = (p.get("latency") or {}).get("latency_ms") or {}
        prod = (p.get("latency") or {}).get("producer") or {}
        cpu = p["cpu_s_per_1k"]
        ok = "ok" if p["throughput"].get("ok") else "FAILED"
        out.append(_row([
            p["label"], f"{p['messages']:,}", f"{p['msgs_per_s']:,.0f}",
            _f(p.get("ratio_to_raw")),
            _f(p.get("ratio_to_sql_limit") if p["path"] != "raw" else None, "{:.2f}"),
            _f(p.get("ratio_to_naive") if p["path"] != "naive" else None, "{:.1f}"),
            _f(cpu.get("consumer")), _f(cpu.get("postgres")), _f(cpu.get("broker")),
            _f(lat.get("p50"), "{:.1f}"), _f(lat.get("p99"), "{:.1f}"),
            _f(prod.get("rate"), "{:,.0f}"),
            _f(p["throughput"].get("peak_rss_mb"), "{:.0f}"), ok,
        ]))

    if "raw" in paths:
        path_row(paths["raw"])
    for r in d.get("pgbench", []):
        n = r["transactions"] * r["messages_per_tx"]

        def per_1k(v: float | None, n: int = n) -> str:
            return _f(v / n * 1000 if v is not None and n else None)

        out.append(_row([
            f"pgbench {r['script'].replace('_', '-')} -c {r['clients']}", f"{n:,}",
            f"{r['msgs_per_s']:,.0f}", "—", "—", "—",
            per_1k(r["cpu"].get("consumer")) + " (pgbench)", per_1k(r["cpu"].get("postgres")),
            per_1k(r["cpu"].get("broker")), "—", "—", "—", "—",
            r.get("error") or f"{r['tps']:,.1f} tx/s, {r['latency_ms']:.2f} ms/tx",
        ]))
    if k := d.get("keyed_sql"):  # the minimal keyed SQL (issue 38)
        def kper_1k(v: float | None, n: int = k["messages"]) -> str:
            return _f(v / n * 1000 if v is not None and n else None)

        out.append(_row([
            k["label"], f"{k['messages']:,}", _f(k["msgs_per_s"] or None, "{:,.0f}"), "—", "—",
            "—", kper_1k(k["cpu"].get("consumer")) + " (psycopg)",
            kper_1k(k["cpu"].get("postgres")), kper_1k(k["cpu"].get("broker")), "—", "—", "—",
            "—", "ok" if k["ok"] else "FAILED",
        ]))
    for name, p in paths.items():
        if name != "raw":
            path_row(p)
    rss = d.get("rss")
    if rss:
        out.append(_row([
            "kafka_idem batch, RSS run", f"{rss['messages']:,}",
            _f(rss.get("msgs_per_s"), "{:,.0f}"), "—", "—", "—",
            _f(rss.get("cpu_consumer_per_1k")), _f(rss.get("cpu_postgres_per_1k")),
            _f(rss.get("cpu_broker_per_1k")), "—", "—", "—", _f(rss.get("peak_mb"), "{:.0f}"),
            "ok" if rss.get("ok") else "FAILED",
        ]))
    return out


def cpu_table(d: dict[str, Any]) -> list[str]:
    out = [_row(["path", "wall s", "consumer", "postgres", "broker", "other", "machine busy"]),
           _row(["---", *(["---:"] * 6)])]
    for p in d["paths"]:
        cpu = p["throughput"].get("cpu") or {}
        wall = cpu.get("wall") or 0
        if not wall:
            continue
        shares = [cpu.get(k) for k in ("consumer", "postgres", "broker", "other", "machine_busy")]
        out.append(_row([p["label"], f"{wall:.2f}",
                         *(_f(v / wall if v is not None else None, "{:.2f}") for v in shares)]))
    return out


def phases_table(d: dict[str, Any]) -> list[str]:
    steps = [
        ("runner.step", "whole loop step"), ("consumer.consume", "consume()"),
        ("batch.run_batch", "batch.run_batch"),
        ("batch._prepare", "↳ decode, validate, key, hash"),
        ("batch._read", "↳ read of every key (lock of the existing ones)"),
        ("batch._run_handlers", "↳ handlers + one insert of every success"),
        ("commit", "↳ COMMIT and the rest"),
        ("runner._apply", "_apply (offsets, metrics)"),
        ("runner._ingest", "_ingest (queue; with workers, decode ahead)"),
    ]
    have = [p for p in d["paths"] if (p["throughput"].get("phases") or {}).get("batch.run_batch")]
    if not have:
        return []
    out = [_row(["µs per message: wall / loop-thread CPU", *(p["label"] for p in have)]),
           _row(["---", *(["---:"] * len(have))])]
    for key, label in steps:
        cells = []
        for p in have:
            ph = dict(p["throughput"]["phases"])
            if key == "commit":
                rb = ph["batch.run_batch"]
                inner = [ph.get(k, {"wall_s": 0.0, "cpu_s": 0.0}) for k in (
                    "batch._prepare", "batch._read", "batch._run_handlers",
                    "batch._replays", "batch._claim")]  # the last two: before migration 0010
                ph["commit"] = {"wall_s": rb["wall_s"] - sum(x["wall_s"] for x in inner),
                                "cpu_s": rb["cpu_s"] - sum(x["cpu_s"] for x in inner)}
            x = ph.get(key)
            n = p["messages"]
            cells.append("—" if x is None else
                         f"{x['wall_s'] / n * 1e6:.1f} / {x['cpu_s'] / n * 1e6:.1f}")
        out.append(_row([label, *cells]))
    return out


def round_trips_table(d: dict[str, Any]) -> list[str]:
    cols = [("round trips", "round_trips"), ("statements", "statements"),
            ("pipelined", "pipelined"), ("BEGIN", "begin"), ("COMMIT", "commit")]
    out = [_row(["per message", *(c for c, _ in cols)]), _row(["---", *(["---:"] * len(cols))])]
    for p in d["paths"]:
        rt = p["throughput"].get("round_trips") or {}
        if rt:
            out.append(_row([p["label"], *(f"{rt[k] / p['messages']:.3f}" for _, k in cols)]))
    return out


def statements_table(d: dict[str, Any]) -> list[str]:
    runs = [r for r in d.get("pgbench", []) if r.get("statements_ms") and r["clients"] == 1
            and r["script"] != "gen_only"]
    if not runs:
        return []
    out = [_row(["script (-c 1)", "ms per tx", "statement"]), _row(["---", "---:", "---"])]
    for r in runs:
        for ms, text in r["statements_ms"]:
            out.append(_row([r["script"], f"{ms:.3f}", "`" + text.replace("|", "\\|")[:70] + "…`"]))
    return out


def db_work_table(d: dict[str, Any]) -> list[str]:
    from bench import dbwork

    rows = d.get("db_work") or []
    if not rows:
        return []
    return [_row(["per message", *(c for c, _, _ in dbwork.COLUMNS)]),
            _row(["---", *(["---:"] * len(dbwork.COLUMNS))]),
            *(_row([r["label"], *dbwork.cells(r)]) for r in rows)]


def targets_table(d: dict[str, Any]) -> list[str]:
    out = [_row(["target", "measured", "met"]), _row(["---", "---:", "---"])]
    for t in d.get("targets", []):
        v = t["value"]
        unit = t["unit"]
        shown = "—" if v is None else (f"{v:,.0f} {unit}" if unit == "msgs/s"
                                       else f"{v:.2f}{unit}" if unit == "x"
                                       else f"{v:.1f} {unit}")
        out.append(_row([t["target"], shown, "**met**" if t["met"] else "**not met**"]))
    return out


def orm_table(d: dict[str, Any]) -> list[str]:
    from bench import orm

    comps = d.get("orm") or []
    if not comps:
        return []
    return [_row(orm.HEADER), _row(["---", "---", *(["---:"] * 6), "---"]),
            *(_row(r) for r in orm.lines(comps))]


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    d = json.loads(Path(args[0] if args else HERE / "results.json").read_text())
    for title, lines in (("Main table", main_table(d)), ("CPU split", cpu_table(d)),
                         ("Batch path phases", phases_table(d)),
                         ("Round trips", round_trips_table(d)),
                         ("pgbench statements", statements_table(d)),
                         ("Database work per message", db_work_table(d)),
                         ("ORM handlers", orm_table(d)),
                         ("Targets", targets_table(d))):
        if lines:
            print(f"<!-- {title} -->")
            print("\n".join(lines))
            print()
    rss = d.get("rss") or {}
    if rss.get("samples"):
        print("RSS samples: " + ", ".join(f"{x['messages']:,}: {x['rss_mb']:.1f} MB"
                                          for x in rss["samples"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
