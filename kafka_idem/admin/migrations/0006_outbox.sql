-- The transactional outbox: events a handler emits (ctx.emit) are rows here,
-- written in the handler's own transaction, published to Kafka by the relay
-- (kafka_idem/outbox) and deleted once published. See docs/OUTBOX.md.
--
-- id orders the rows of a shard; it is NOT a publication watermark: transactions
-- commit out of id order, so the relay reads what is visible now and deletes
-- exactly the ids it published. Per-key order comes from outbox_slots: a
-- transaction locks its keys' slots (in slot order) just before inserting, so a
-- later transaction emitting the same key waits for the earlier one's commit and
-- gets the later id.
CREATE TABLE {outbox} (
    id               bigserial   PRIMARY KEY,
    namespace        text        NOT NULL,
    shard            integer     NOT NULL,
    topic            text        NOT NULL,
    key              bytea,
    value            bytea,
    headers          jsonb,
    idem_key         text        NOT NULL,
    source_topic     text,
    source_partition integer,
    source_offset    bigint,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX {outbox_shard_idx} ON {outbox} (namespace, shard, id);

CREATE TABLE {outbox_slots} (
    namespace text    NOT NULL,
    slot      integer NOT NULL,
    PRIMARY KEY (namespace, slot)
);
