-- Paused handlers: an operator's `kafka-idem pause` (or the console's), durable so that
-- every member of the app honours it, across restarts and rebalances, until a resume
-- deletes the row. A handler is identified by the app's namespace and the handler's
-- name (what the records carry), not by the consumer group: a new group of the same app
-- stays paused. Who, why and when are kept here for `status`; the history is the audit
-- trail's (actions 'pause' and 'resume'). The pausing transaction notifies the members
-- (channel kafka_idem_pause); they poll this table too.
CREATE TABLE {pauses} (
    namespace  text        NOT NULL,
    handler    text        NOT NULL,
    reason     text        NOT NULL,
    actor      text        NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (namespace, handler)
);
