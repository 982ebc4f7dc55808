"""The parts of the consumer loop (:mod:`kafka_idem.runner`), each with one job.

Imports point one way, from the loop down:

* :mod:`~kafka_idem.consume.units` — work in flight: the worker pools, one
  processor per thread, dispatching due partitions and harvesting results;
* :mod:`~kafka_idem.consume.letters` — dead letters acknowledged before their
  offsets may be committed;
* :mod:`~kafka_idem.consume.offsets` — the only committer of offsets;
* :mod:`~kafka_idem.consume.gauges` — consumer lag and the sampled store gauges;
* :mod:`~kafka_idem.consume.partitions` — per-partition bookkeeping, no Kafka calls;
* :mod:`~kafka_idem.consume.executor` — :class:`Processor`, the message path's entry:
  the batch path (:mod:`~kafka_idem.consume.batch`) or the per-message paths
  (:mod:`~kafka_idem.consume.local`, :mod:`~kafka_idem.consume.leased`), over the
  shared :mod:`~kafka_idem.consume.steps` and one connection
  (:mod:`~kafka_idem.consume.database`);
* :mod:`~kafka_idem.consume.verdicts` — decisions with no I/O;
  :mod:`~kafka_idem.consume.outcome` — what became of a message.
"""

import logging

# One logger name for everything the member logs about its loop, whichever module
# says it: log filters and the chaos run's log signs match on "kafka_idem.runner".
log = logging.getLogger("kafka_idem.runner")
