"""How long the test kit's ``Harness.check`` takes on the payments example (local mode,
bulk handler: 14 scenarios on two paths) and on the gateway example (leased mode,
reconcile, a real HTTP gateway): ``python -m bench.kit [--runs N]``.

Prints the harness's set-up (two databases, the migrations), each check's wall time
and the five slowest scenarios, with the machine's load: the numbers are for reading
(the suite never asserts on time).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from consumers import gateway, payments
from kafka_idem.testing import Harness


def _run(label: str, harness: Harness, topic: str, value: object, runs: int) -> None:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        report = harness.check(topic, value)
        times.append(time.perf_counter() - started)
    slowest = sorted(report.results, key=lambda r: -r.seconds)[:5]
    print(f"{label}: check of {len(report.results)} scenarios: "
          + ", ".join(f"{t:.2f}s" for t in times)
          + f" (best {min(times):.2f}s); slowest: "
          + ", ".join(f"{r.name} [{r.path}] {r.seconds:.2f}s" for r in slowest))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kit")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the scenarios' dead letters log warnings
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    started = time.perf_counter()
    with Harness(payments.app) as h:
        print(f"payments: harness made in {time.perf_counter() - started:.2f}s")
        _run("payments", h, payments.TOPIC, payments.charge_payload("t1", "o-1", "10.00"),
             args.runs)
        closing = time.perf_counter()
    print(f"payments: harness closed in {time.perf_counter() - closing:.2f}s")
    with gateway.Gateway() as gw, Harness(
            gateway.build_app(gateway_url=gw.url, timeout=5), remotes={"gateway": gw},
            ignore={"payments.gateway_charges": ["charge_id"]}) as h:
        _run("gateway", h, gateway.TOPIC, payments.charge_payload("t1", "o-1", "10.00"),
             args.runs)


if __name__ == "__main__":
    main()
