"""The parts of the consumer loop (:mod:`kafka_idem.consume.runner`), each with one job.

Imports point one way, from the loop down:

* :mod:`~kafka_idem.consume.concurrency.units` — work in flight: the worker pools, one
  processor per thread, dispatching due partitions and harvesting results;
* :mod:`~kafka_idem.consume.send_letters` — dead letters acknowledged before their
  offsets may be committed;
* :mod:`~kafka_idem.consume.offsets` — the only committer of offsets;
* :mod:`~kafka_idem.consume.lag` — consumer lag and the sampled store gauges;
* :mod:`~kafka_idem.consume.partitions` — per-partition bookkeeping, no Kafka calls;
* :mod:`~kafka_idem.consume.paths.processor` — :class:`Processor`, the message path's entry:
  the batch path (:mod:`~kafka_idem.consume.paths.batch_path`) or the per-message paths
  (:mod:`~kafka_idem.consume.paths.local_path`,
  :mod:`~kafka_idem.consume.paths.leased_path`), over the
  shared :mod:`~kafka_idem.consume.paths.steps` and one connection
  (:mod:`~kafka_idem.consume.paths.database`);
* :mod:`~kafka_idem.consume.paths.verdicts` — decisions with no I/O;
  :mod:`~kafka_idem.consume.outcome` — what became of a message.
"""
