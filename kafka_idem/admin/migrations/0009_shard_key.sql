-- The shard key (issue "Past one PostgreSQL"): the value a distributed store (Citus) keeps a
-- message's rows together by. A handler's `shard_key=` gives it (default: the idempotency
-- key); on one PostgreSQL it is stored only when the handler sets it, so a store that is
-- distributed later keeps every record where its handler will look for it. Nullable here:
-- `kafka-idem migrate --citus` fills the missing ones with the idempotency key (what a
-- handler without `shard_key=` uses), makes the column NOT NULL, puts it into the primary
-- keys and distributes the tables by it (kafka_idem/admin/citus.py).
ALTER TABLE {table} ADD COLUMN shard_key text;
ALTER TABLE {outbox} ADD COLUMN shard_key text;
