"""kafka_idem's test kit: prove that *your* handler is idempotent.

    from kafka_idem.testing import Harness

    with Harness(app, database_url="postgresql://me@localhost/postgres") as harness:
        first = harness.deliver("orders.placed", order)     # the real claim/complete protocol
        again = harness.deliver("orders.placed", order)
        assert (first.outcome, again.outcome) == ("succeeded", "replayed")
        harness.check("orders.placed", order)    # the scenario matrix; AssertionError if not

:class:`Harness` runs an app's handlers through the framework's own message path
(batch, per-message and leased) on a throwaway PostgreSQL database, without Kafka;
:meth:`Harness.check` runs the scenario matrix (redelivery, crashes before and after
the commit, concurrent duplicates, a payload conflict, exhausted retries, a lost
answer, a lease taken over, the batch path against the per-message path) and
compares the app's own tables, the events its handlers emitted (the outbox) and
remote fakes (:class:`FakeService`, or any :class:`Remote`) with a single delivery.
The pytest plugin (``kafka_idem_harness`` fixture) is in
:mod:`kafka_idem.testing.plugin`. The guide: docs/how-to/testing.md.
"""

from kafka_idem.testing.events import EmittedEvent
from kafka_idem.testing.harness import Harness
from kafka_idem.testing.letters import CapturedLetter
from kafka_idem.testing.message import FakeMessage
from kafka_idem.testing.remote import FakeService, Remote
from kafka_idem.testing.report import CheckReport, ScenarioResult
from kafka_idem.testing.sandbox import Delivered, Sandbox
from kafka_idem.testing.scenarios import SCENARIOS

__all__ = [
    "SCENARIOS",
    "CapturedLetter",
    "CheckReport",
    "Delivered",
    "EmittedEvent",
    "FakeMessage",
    "FakeService",
    "Harness",
    "Remote",
    "Sandbox",
    "ScenarioResult",
]
