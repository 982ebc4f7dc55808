"""The parts of the consumer loop (:mod:`kafka_idem.runner`), each with one job.

Imports point one way, from the loop down:

* :mod:`~kafka_idem.consume.units` — work in flight: the worker pools, one
  processor per thread, dispatching due partitions and harvesting results;
* :mod:`~kafka_idem.consume.letters` — dead letters acknowledged before their
  offsets may be committed;
* :mod:`~kafka_idem.consume.offsets` — the only committer of offsets;
* :mod:`~kafka_idem.consume.gauges` — consumer lag and the sampled store gauges;
* :mod:`~kafka_idem.consume.partitions` — per-partition bookkeeping, no Kafka calls.
"""

import logging

# One logger name for everything the member logs about its loop, whichever module
# says it: log filters and the chaos run's log signs match on "kafka_idem.runner".
log = logging.getLogger("kafka_idem.runner")
