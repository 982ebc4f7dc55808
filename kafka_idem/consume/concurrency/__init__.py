"""Work in flight: units of work and the pools they run on
(:mod:`~kafka_idem.consume.concurrency.units`,
:mod:`~kafka_idem.consume.concurrency.daemon_pool`), key-ordered concurrency inside a
partition (:mod:`~kafka_idem.consume.concurrency.keyed_units`,
:mod:`~kafka_idem.consume.concurrency.keyed_state`), handler slots
(:mod:`~kafka_idem.consume.paths.slots`) and the member's event loop for
``async def`` handlers (:mod:`~kafka_idem.consume.concurrency.event_loop`)."""
