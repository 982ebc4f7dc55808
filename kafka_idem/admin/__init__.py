"""Operations on a deployment, with an operator's rights: schema migrations
(:mod:`~kafka_idem.admin.migrate`), status, inspect and audited re-runs
(:mod:`~kafka_idem.admin.operations`), retention purges, the audit trail
(:mod:`~kafka_idem.admin.audit`), namespaces (:mod:`~kafka_idem.admin.namespaces`) and
the topics an app needs (:mod:`~kafka_idem.admin.topics`)."""
