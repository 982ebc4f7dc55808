"""Chaos verification of the payments example: a fault-injecting run and an anomaly checker.

* :mod:`kafka_idem.chaos.checker` reads only durable state (the source topic,
  the DLQ topic, the group's committed offsets, PostgreSQL) and counts anomalies;
  it re-exports the public names and is the command line
  (``python -m kafka_idem.chaos.checker``). Its parts:
  :mod:`~kafka_idem.chaos.checks` (:func:`check`, the checks, one function each: 1-9
  always, 10 and 11 when asked for),
  :mod:`~kafka_idem.chaos.evidence` (the durable state read once and indexed),
  :mod:`~kafka_idem.chaos.report` (``Check``, ``Report``, ``Liveness``),
  :mod:`~kafka_idem.chaos.kafka_state` (topics and committed offsets, read patiently),
  :mod:`~kafka_idem.chaos.db_state` (records, ledger, balances, guard triggers in
  one snapshot) and :mod:`~kafka_idem.chaos.intents` (source messages decoded as
  the payments handler decodes them).
* :mod:`kafka_idem.chaos.run` drives a consumer group of ``kafka-idem run``
  members through seeded faults, heals, waits for the lag to reach 0 and runs
  the checker: ``python -m kafka_idem.chaos.run --help``. Its parts:
  :mod:`~kafka_idem.chaos.members` (the member processes),
  :mod:`~kafka_idem.chaos.traffic` (the producer of charge intents),
  :mod:`~kafka_idem.chaos.faults` (the seeded fault injector and its undoing),
  :mod:`~kafka_idem.chaos.services` (database set-up, lag, admin operations, clean-up)
  and :mod:`~kafka_idem.chaos.output` (progress lines and the final report).

See ``docs/VERIFICATION.md``.
"""
