"""The operator's web console: ``kafka-idem console MODULE:APP`` (docs/how-to/console.md).

A server-rendered Starlette application over the same store, Kafka topics and
operations as the CLI (:mod:`~kafka_idem.console.app`): the overview, records, dead
letters, re-drive and re-run, each write audited with the operator's name. Its
security model is :mod:`~kafka_idem.console.security`'s; the dead-letter topics are
read through an in-memory index (:mod:`~kafka_idem.console.dlq_index`). Needs the
``console`` extra: ``pip install 'kafka-idem[console]'``.
"""

from kafka_idem.console.app import create_app
from kafka_idem.console.state import Options

__all__ = ["Options", "create_app"]
