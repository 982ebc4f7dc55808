"""Chaos verification of the payments example: a fault-injecting run and an anomaly checker.

The run's members run ``consumers.payments:app``, or with ``--orm`` the same example
written with SQLAlchemy's ORM, ``consumers.payments_orm:app`` (same tables, records and
events, so the checker is the same).

* :mod:`tools.chaos.checker` reads only durable state (the source topic,
  the DLQ topic, the group's committed offsets, PostgreSQL) and counts anomalies;
  it re-exports the public names and is the command line
  (``python -m tools.chaos.checker``). Its parts:
  :mod:`~tools.chaos.checks` (:func:`check`, the checks, one function each: 1-9
  always, 10 and 11 when asked for),
  :mod:`~tools.chaos.evidence` (the durable state read once and indexed),
  :mod:`~tools.chaos.report` (``Check``, ``Report``, ``Liveness``),
  :mod:`~tools.kafka_state` (topics and committed offsets, read patiently),
  :mod:`~tools.chaos.db_state` (records, ledger, balances, guard triggers in
  one snapshot) and :mod:`~tools.chaos.intents` (source messages decoded as
  the payments handler decodes them).
* :mod:`tools.chaos.run` drives a consumer group of ``kafka-idem run``
  members through seeded faults, heals, waits for the lag to reach 0 and runs
  the checker: ``python -m tools.chaos.run --help``. Its parts:
  :mod:`~tools.chaos.members` (the member processes),
  :mod:`~tools.chaos.traffic` (the producer of charge intents),
  :mod:`~tools.chaos.faults` (the seeded fault injector and its undoing),
  :mod:`~tools.chaos.services` (database set-up, lag, admin operations, clean-up)
  and :mod:`~tools.chaos.output` (progress lines and the final report).

See ``docs/VERIFICATION.md``.
"""
