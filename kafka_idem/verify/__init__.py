"""``kafka-idem verify``: the seven verification scenarios (docs/VERIFICATION.md), run
against the Kafka and PostgreSQL the settings point to, with real processes and real signals.

    from kafka_idem.verify import run, select
    report = run(settings, select(["1", "4"]))
    report.passed, report.to_json()

Every scenario works in its own fresh topics and schemas (``verify_<run>_s<id>`` for
the store, ``..._biz`` for its business tables), never in existing ones, and removes
them afterwards unless asked to keep them. Verdicts are decided on durable state: the
idempotency records and their committed history, business rows, DLQ records, committed
offsets, a downstream's own records, and the members' /metrics.
"""

from kafka_idem.verify.report import Outcome, Report
from kafka_idem.verify.scenarios import SCENARIOS, Scenario, run, select

__all__ = ["SCENARIOS", "Outcome", "Report", "Scenario", "run", "select"]
