"""What a process says about itself: structured logs (:mod:`~kafka_idem.observe.logs`),
librdkafka's logs (:mod:`~kafka_idem.observe.kafka_logs`), Prometheus metrics and the
health endpoints (:mod:`~kafka_idem.observe.metrics`, :mod:`~kafka_idem.observe.health`),
tracing (:mod:`~kafka_idem.consume.tracing`) and the masking of secrets in text
(:mod:`~kafka_idem.observe.redact`)."""
