"""The message paths: how one unit of work goes through the claim / complete protocol.

:class:`~kafka_idem.consume.paths.processor.Processor` is the entry; it runs the batch
path (:mod:`~kafka_idem.consume.paths.batch_path`) or a per-message path (local:
:mod:`~kafka_idem.consume.paths.local_path`; leased:
:mod:`~kafka_idem.consume.paths.leased_path`, with its lease heartbeats in
:mod:`~kafka_idem.consume.paths.lease_keeper`; ``async def`` handlers:
:mod:`~kafka_idem.consume.paths.async_leased_path` on the event loop's connections,
:mod:`~kafka_idem.consume.paths.async_connections`), over the shared steps
(:mod:`~kafka_idem.consume.paths.steps`, decoding in
:mod:`~kafka_idem.consume.paths.decoding`), decisions with no I/O
(:mod:`~kafka_idem.consume.paths.verdicts`,
:mod:`~kafka_idem.consume.paths.failure_record`) and one connection
(:mod:`~kafka_idem.consume.paths.database`)."""
