-- Every runtime query of kafka_idem, one named block each ("-- name: ...").
-- {table} and {audit} are filled with quoted identifiers (psycopg.sql.Identifier).
-- A record is identified by (namespace, idempotency_key): %(ns)s is the app's
-- namespace in every runtime query; admin queries take NULL for "every namespace".
-- Lease and retry times come from clock_timestamp(), the database's real time:
-- now() is the transaction start and goes stale inside a long transaction.
-- {shard} is empty on one PostgreSQL; on a distributed store (Citus) it is
-- "AND shard_key = %(shard)s", so the statement is routed to the one shard that holds
-- the record, and every clock_timestamp() is statement_timestamp() (Citus refuses a
-- VOLATILE function in an UPDATE of a distributed table; the statement's start is the
-- database's clock there), and "coalesce(first_failure_at, clock_timestamp())" is
-- "least(first_failure_at, ...)" (nor a non-immutable one inside COALESCE or CASE: the
-- queries keep the clock outside their CASEs). {conflict} is the records'
-- primary key. Queries without {shard} run on every shard there (admin tools); a
-- record joined with another record of its key joins on the shard too ({shard_join}).
-- The batch path's arrays are sent in binary (%(name)b): psycopg writes a list in
-- text format element by element with a quoting check, about 1.4 µs per element
-- against 0.3 µs in binary, and a batch of 500 sends a dozen of them.

-- name: claim_insert
-- Step 1 of a claim: a new key becomes ours in one statement.
INSERT INTO {table} AS t (
    namespace, idempotency_key, request_hash, status, owner_token, lease_until, attempts,
    handler, kafka_topic, kafka_partition, kafka_offset, created_at, updated_at, shard_key)
VALUES (
    %(ns)s, %(key)s, %(hash)s, 'processing', %(token)s,
    clock_timestamp() + make_interval(secs => %(lease)s), 1,
    %(handler)s, %(topic)s, %(partition)s, %(offset)s, clock_timestamp(), clock_timestamp(),
    %(shard)s)
ON CONFLICT {conflict} DO NOTHING
RETURNING attempts;

-- name: claim_lock
-- Step 2 of a claim, when the key existed: lock it and read what to decide on.
-- A new statement, so READ COMMITTED sees a row whose insert we just lost a race to.
SELECT request_hash, status, owner_token, lease_until, attempts, attempt_base, next_attempt_at,
       result_json, error_kind, error_class, error_message,
       first_failure_at, last_failure_at, clock_timestamp() AS db_now
FROM {table}
WHERE namespace = %(ns)s AND idempotency_key = %(key)s {shard}
FOR UPDATE;

-- name: claim_take
-- Step 3 of a claim: take over a retryable or expired record with a new token.
UPDATE {table}
SET status = 'processing',
    owner_token = %(token)s,
    lease_until = clock_timestamp() + make_interval(secs => %(lease)s),
    attempts = attempts + %(charge)s,
    next_attempt_at = NULL,
    handler = %(handler)s,
    kafka_topic = %(topic)s,
    kafka_partition = %(partition)s,
    kafka_offset = %(offset)s,
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s {shard}
RETURNING attempts;

-- name: complete
-- Fenced completion: only the current owner's token turns the record into succeeded.
-- The error fields describe the current failure: a success clears them (the history
-- stays in the audit trail and on the DLQ); the failure times stay. A stale token
-- updates no row, and {fence} (migration 0007) then raises KI002: the statement
-- fails, so it can be sent with its COMMIT without waiting for its answer.
WITH done AS (
UPDATE {table}
SET status = 'succeeded',
    result_json = %(result)s,
    error_kind = NULL,
    error_class = NULL,
    error_message = NULL,
    completed_token = owner_token,
    owner_token = NULL,
    lease_until = NULL,
    next_attempt_at = NULL,
    completed_at = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s AND owner_token = %(token)s {shard}
  AND status = 'processing'
RETURNING attempts
)
SELECT {fence}((SELECT count(*) FROM done), %(key)s);

-- name: fail
-- Fenced failure: retryable_failed (with the next due time) or failed.
UPDATE {table}
SET status = %(status)s,
    error_kind = %(kind)s,
    error_class = %(error_class)s,
    error_message = %(error_message)s,
    owner_token = NULL,
    lease_until = NULL,
    -- (the clock outside the CASE: Citus refuses a non-immutable function inside one)
    next_attempt_at = clock_timestamp() + CASE WHEN %(status)s = 'retryable_failed'
                                               THEN make_interval(secs => %(delay)s) END,
    first_failure_at = coalesce(first_failure_at, clock_timestamp()),
    last_failure_at = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s AND owner_token = %(token)s {shard}
  AND status = 'processing'
RETURNING attempts, next_attempt_at, first_failure_at, last_failure_at;

-- name: extend_lease
-- Heartbeat: keep a live lease live; no row back means the lease was lost.
UPDATE {table}
SET lease_until = clock_timestamp() + make_interval(secs => %(lease)s),
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s AND owner_token = %(token)s {shard}
  AND status = 'processing'
RETURNING idempotency_key;

-- name: withdraw_claim
-- A claim of ours whose handler never ran (an async def handler's message waiting for
-- a slot, cancelled by a stop or a revoke): its lease ends now, and the claim does not
-- count against the retry budget (attempt_base + 1; the limit counts attempts -
-- attempt_base), so the next owner takes the key over at once, as if it had not been
-- claimed. processing -> processing (a lease change; attempts never decrease). Only
-- while the claim is ours and live: a stale token changes nothing.
-- next_attempt_at (NULL on every other processing record) marks it withdrawn: the next
-- claim is then no takeover of a call that may have been in flight, so it asks no
-- reconciler for it. Not when the withdrawn claim was itself such a takeover
-- (%(took_over)s): the call before it, never reconciled, still may have been.
UPDATE {table}
SET lease_until = clock_timestamp(),
    attempt_base = attempt_base + 1,
    next_attempt_at = clock_timestamp() + CASE WHEN %(took_over)s::boolean THEN NULL
                                               ELSE interval '0' END,
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s AND owner_token = %(token)s {shard}
  AND status = 'processing' AND lease_until > clock_timestamp()
RETURNING idempotency_key;

-- name: expire_leases
-- The test kit's clock (kafka_idem.testing), never run by a consumer: time passes
-- beyond every live lease of the namespace, as if the owners had stalled that long.
-- processing -> processing, so the guard lets it through as a lease change.
UPDATE {table}
SET lease_until = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND status = 'processing' AND lease_until > clock_timestamp()
  AND (%(key)s::text IS NULL OR idempotency_key = %(key)s)
RETURNING idempotency_key;

-- name: wipe
-- The test kit only (kafka_idem.testing): empties the store of one of its throwaway
-- databases between two scenarios, the guard's triggers off for the delete (a test
-- starts from nothing; no record is "purged"). Refused in any other database.
DO $wipe$
BEGIN
    IF current_database() NOT LIKE 'kafka\_idem\_kit\_%' THEN
        RAISE EXCEPTION USING ERRCODE = 'KI001',
            MESSAGE = 'kafka_idem: a store is wiped only in a test kit database (kafka_idem_kit_*)';
    END IF;
    ALTER TABLE {table} DISABLE TRIGGER USER;
    ALTER TABLE {audit} DISABLE TRIGGER USER;
    DELETE FROM {table};
    DELETE FROM {audit};
    DELETE FROM {pauses};
    ALTER TABLE {table} ENABLE TRIGGER USER;
    ALTER TABLE {audit} ENABLE TRIGGER USER;
    PERFORM setval(pg_get_serial_sequence('{audit}', 'id'), 1, false);
END
$wipe$;

-- name: get_record
SELECT idempotency_key, request_hash, status, result_json, error_kind, error_class,
       error_message, owner_token, completed_token, lease_until, attempts,
       attempts - attempt_base AS attempts_counted, next_attempt_at,
       first_failure_at, last_failure_at, handler, kafka_topic, kafka_partition, kafka_offset,
       created_at, updated_at, completed_at, namespace, shard_key,
       clock_timestamp() AS db_now
FROM {table}
WHERE namespace = ANY(%(nss)s::text[]) AND idempotency_key = %(key)s
ORDER BY namespace;

-- name: succeeded_results
-- Replay fast path: which of these keys exist, and the succeeded ones' results (the
-- batch path reads every key of a batch before its handlers run). succeeded is
-- terminal, so a plain snapshot read answers duplicates: no lock, no write.
-- One primary-key probe per key (the keys are distinct), whatever the statistics say.
-- With "namespace = %(ns)s AND idempotency_key = ANY(...)" and statistics taken while
-- the namespace had few rows (a new store, before autovacuum's first ANALYZE), the
-- planner scans every record of the namespace and tests each against the array: 130 ms
-- instead of 3 ms for 500 keys among 200,000. The LIMIT keeps the LATERAL subquery from
-- being pulled up into a join the planner may hash the same way; (namespace, key) is
-- the primary key, so it never drops a row. The status is checked by the caller, so the
-- status index's statistics do not matter either.
SELECT t.idempotency_key, t.request_hash, t.result_json, t.status, t.attempts
FROM unnest(%(keys)b::text[]) AS k(key)
CROSS JOIN LATERAL (
    SELECT idempotency_key, request_hash, result_json, status, attempts
    FROM {table}
    WHERE namespace = %(ns)s AND idempotency_key = k.key
    LIMIT 1
) AS t;

-- name: exhaust
-- Claim found the attempts or elapsed time used up: the record becomes failed.
UPDATE {table}
SET status = 'failed',
    error_kind = 'exhausted',
    error_class = %(error_class)s,
    error_message = %(error_message)s,
    owner_token = NULL,
    lease_until = NULL,
    next_attempt_at = NULL,
    first_failure_at = coalesce(first_failure_at, clock_timestamp()),
    last_failure_at = clock_timestamp(),
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s {shard}
  AND status IN ('processing', 'retryable_failed')
RETURNING first_failure_at, last_failure_at;

-- name: dead_again
-- A failed record met again (a redelivery, a replay): it is dead-lettered again, now.
-- failed -> failed, allowed by the guard from migration 0004; the row is locked.
UPDATE {table}
SET last_failure_at = clock_timestamp(),
    kafka_topic = %(topic)s,
    kafka_partition = %(partition)s,
    kafka_offset = %(offset)s,
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s {shard} AND status = 'failed'
RETURNING first_failure_at, last_failure_at;

-- name: audit_insert
-- The append-only admin trail (rerun, purge, replay).
INSERT INTO {audit} (actor, action, namespace, idempotency_key, selection, reason,
                     previous_status, previous_error, counts)
VALUES (%(actor)s, %(action)s, %(ns)s, %(key)s, %(selection)s, %(reason)s, %(previous_status)s,
        %(previous_error)s, %(counts)s)
RETURNING id, at;

-- name: audit_for_key
SELECT id, at, actor, action, reason, previous_status, previous_error, selection, counts
FROM {audit}
WHERE idempotency_key = %(key)s
  AND (namespace = %(ns)s OR namespace IS NULL)  -- NULL: written before namespaces
ORDER BY id;

-- name: audit_of
-- What one action of the console wrote: rows after the last one before it started
-- that name its replay runs or its caller (selection "via") in their selection.
SELECT id, at, actor, action, namespace, idempotency_key, reason, previous_status,
       previous_error, selection, counts
FROM {audit}
WHERE id > %(after)s
  AND (selection->>'run' = ANY(%(runs)s::text[]) OR selection->>'via' = %(via)s::text)
ORDER BY id
LIMIT %(limit)s;

-- name: audit_last_id
SELECT coalesce(max(id), 0) AS id FROM {audit};

-- name: key_collation
-- The collation the records' keys sort by (the primary key's order): the column's,
-- else the database's; 'icu' when either is ICU's, whatever its name or the database's
-- LC_COLLATE say (datlocprovider, PostgreSQL 15+, read through to_jsonb: NULL before).
SELECT CASE WHEN coalesce(c.collprovider::text, to_jsonb(d) ->> 'datlocprovider') = 'i'
            THEN 'icu' ELSE coalesce(c.collname, d.datcollate) END AS collation
FROM pg_attribute a
JOIN pg_class t ON t.oid = a.attrelid
JOIN pg_namespace s ON s.oid = t.relnamespace
JOIN pg_database d ON d.datname = current_database()
LEFT JOIN pg_collation c ON c.oid = a.attcollation AND c.collname <> 'default'
WHERE s.nspname = %(schema)s AND t.relname = %(table)s AND a.attname = 'idempotency_key';

-- name: handler_counts
-- Records per (namespace, handler, status): the console's overview.
SELECT namespace, coalesce(handler, '') AS handler, status, count(*) AS n
FROM {table}
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3;

-- name: status_summary
-- Counts for `kafka-idem status` and the sampled metrics gauges, per namespace
-- (%(ns)s NULL: every namespace).
SELECT namespace, status,
       count(*) AS n,
       count(*) FILTER (WHERE status = 'processing' AND lease_until >= clock_timestamp()) AS live,
       count(*) FILTER (WHERE status = 'processing' AND lease_until < clock_timestamp()) AS expired,
       count(*) FILTER (WHERE status IN ('processing', 'retryable_failed')
                        AND created_at < clock_timestamp() - make_interval(secs => %(long_running)s))
           AS long_running,
       count(*) FILTER (WHERE status = 'retryable_failed'
                        AND next_attempt_at <= clock_timestamp()) AS due_now,
       min(next_attempt_at) AS next_due
FROM {table}
WHERE %(ns)s::text IS NULL OR namespace = %(ns)s::text
GROUP BY namespace, status;

-- name: failed_by_kind
SELECT namespace, coalesce(error_kind, 'unknown') AS kind, count(*) AS n
FROM {table}
WHERE status = 'failed' AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
GROUP BY 1, 2
ORDER BY 1, 2;

-- name: keys_among
-- Which of these keys have a record (inspect's "did you mean": one index probe each).
SELECT DISTINCT idempotency_key FROM {table}
WHERE namespace = ANY(%(nss)s::text[]) AND idempotency_key = ANY(%(keys)s::text[])
ORDER BY idempotency_key
LIMIT 5;

-- name: namespaces
-- Every namespace with records, '' (unassigned) included: a walk down the primary
-- key's leading column, one index probe per namespace, not a scan of the table.
-- Admin lookups of a key given without a namespace probe each of these.
WITH RECURSIVE ns AS (
    (SELECT namespace FROM {table} ORDER BY namespace LIMIT 1)
    UNION ALL
    SELECT (SELECT t.namespace FROM {table} t
            WHERE t.namespace > ns.namespace ORDER BY t.namespace LIMIT 1)
    FROM ns
    WHERE ns.namespace IS NOT NULL
)
SELECT namespace FROM ns WHERE namespace IS NOT NULL;

-- name: namespaces_distributed
-- namespaces on a distributed store (Citus refuses a recursive CTE without a filter on
-- the distribution column): a read of every shard (each worker groups its shards'
-- primary-key entries by namespace), acceptable for the admin lookups that need it.
SELECT DISTINCT namespace FROM {table} ORDER BY namespace;

-- name: record_shard
-- The shard key a record is stored with, read from the record (an admin tool knows the
-- key, not the handler's shard key): the lock and the re-run then name it ({shard}), so
-- each is routed to the record's one shard. On a distributed store a read of every
-- shard, once per key an admin tool acts on; not run on one PostgreSQL.
SELECT shard_key FROM {table}
WHERE namespace = %(ns)s AND idempotency_key = %(key)s
ORDER BY shard_key;

-- name: lock_record
SELECT idempotency_key, status, lease_until, error_kind, error_class, error_message,
       kafka_topic, handler, namespace, shard_key, clock_timestamp() AS db_now
FROM {table}
WHERE namespace = %(ns)s AND idempotency_key = %(key)s {shard}
FOR UPDATE;

-- name: rerun
-- The audited admin re-run: failed -> retryable_failed, due now, with a fresh
-- retry budget. The guard allows it only with kafka_idem.admin_action = 'rerun'.
UPDATE {table}
SET status = 'retryable_failed',
    next_attempt_at = clock_timestamp(),
    attempt_base = attempts,
    first_failure_at = NULL,
    updated_at = clock_timestamp()
WHERE namespace = %(ns)s AND idempotency_key = %(key)s {shard} AND status = 'failed';

-- name: purge_batch
-- Retention: one batch of old terminal records (never processing or retryable_failed).
-- now() (the batch's transaction start), not clock_timestamp(): a stable bound is an
-- index condition the planner can estimate, so few old records are read down the
-- status index (status, updated_at), where a volatile one made every batch a
-- sequential scan of the table (never prepared: a generic plan would not know the bound).
DELETE FROM {table}
WHERE ctid IN (
    SELECT ctid FROM {table}
    WHERE status = ANY(%(statuses)s)
      AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
      AND updated_at < now() - make_interval(secs => %(older_than)s)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
);

-- name: purge_batch_distributed
-- purge_batch on a distributed store (Citus): a ctid names a row only within its shard,
-- and Citus refuses FOR UPDATE in a statement on several shards. The batch is chosen by
-- primary key (a read of every shard, its LIMIT applied on the coordinator) and deleted
-- where it still matches: the conditions are checked again on each row as it is
-- deleted, so a record re-run or dead-lettered again since it was chosen stays (where
-- purge_batch skipped a locked row, this waits for its lock). An audited delete on every
-- shard, acceptable for the admin tools and the background retention that run it.
DELETE FROM {table}
WHERE status = ANY(%(statuses)s)
  AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
  AND updated_at < now() - make_interval(secs => %(older_than)s)
  AND (namespace, idempotency_key, shard_key) IN (
    SELECT namespace, idempotency_key, shard_key FROM {table}
    WHERE status = ANY(%(statuses)s)
      AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
      AND updated_at < now() - make_interval(secs => %(older_than)s)
    LIMIT %(batch)s
);

-- name: purge_count
-- Retention's dry run: what purge_batch would delete now, by status.
SELECT status, count(*) AS n FROM {table}
WHERE status = ANY(%(statuses)s)
  AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
  AND updated_at < now() - make_interval(secs => %(older_than)s)
GROUP BY status;

-- name: retention_lock
-- The background retention's turn: one member of an app at a time (a session lock,
-- held on the purging connection across its batches' transactions).
SELECT pg_try_advisory_lock(hashtext('kafka_idem.retention'), hashtext(%(what)s));

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtext('kafka_idem.retention'), hashtext(%(what)s));

-- name: retention_last
-- The latest background retention run of each namespace (or of one) that removed records.
SELECT DISTINCT ON (namespace) namespace, at, actor, selection, counts
FROM {audit}
WHERE action = 'retention' AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
ORDER BY namespace, id DESC;

-- name: topics_seen
SELECT DISTINCT kafka_topic FROM {table}
WHERE kafka_topic IS NOT NULL AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text);

-- name: batch_claim_insert
-- Batch path: every new key of the batch claimed in one statement, in key order
-- (a consistent lock order between concurrent batches: byte order, "C", the order
-- the batch's COPY writes in). The owner tokens are
-- made here (gen_random_uuid(), built in since PostgreSQL 13) and come back with
-- the keys that were inserted; a key that already existed returns no row.
INSERT INTO {table} AS t (
    namespace, idempotency_key, request_hash, status, owner_token, lease_until, attempts,
    handler, kafka_topic, kafka_partition, kafka_offset, created_at, updated_at, shard_key)
SELECT %(ns)s, i.key, i.hash, 'processing', gen_random_uuid(),
       clock_timestamp() + make_interval(secs => %(lease)s), 1,
       i.handler, i.topic, i.part, i.off, clock_timestamp(), clock_timestamp(), i.shard
FROM unnest(%(keys)b::text[], %(hashes)b::text[], %(handlers)b::text[],
            %(topics)b::text[], %(parts)b::int[], %(offs)b::bigint[], %(shards)b::text[])
     AS i(key, hash, handler, topic, part, off, shard)
ORDER BY i.key COLLATE "C"
ON CONFLICT (namespace, idempotency_key) DO NOTHING
RETURNING idempotency_key, owner_token;

-- name: batch_lock
-- Batch path: lock the keys that already existed and were not found succeeded, in
-- key order, "C" as every multi-key statement (ORDER BY before FOR UPDATE: the rows
-- are locked in that order). A rare
-- path (keys in someone's hands, conflicts), so its plan is left to the planner.
SELECT idempotency_key, request_hash, status, owner_token, lease_until, attempts,
       attempt_base, next_attempt_at, result_json, error_kind, error_class, error_message,
       first_failure_at, last_failure_at, clock_timestamp() AS db_now
FROM {table}
WHERE namespace = %(ns)s AND idempotency_key = ANY(%(keys)b::text[])
ORDER BY idempotency_key COLLATE "C"
FOR UPDATE;

-- name: batch_insert_done
-- Batch path, a batch of fewer than BatchQueries.copy_from new keys: every new key of
-- the batch written once, as succeeded, after its handler ran in this same
-- transaction (a claim and its completion in one row version: the guard allows (new)
-- -> succeeded with its completed_token, migration 0010). Sent in the handlers'
-- pipeline, so it costs no round trip of its own. Key order in bytes ("C"), as every
-- statement that takes several records. A key someone else inserted since the batch
-- read it (a committed record, or one whose insert this one waited for) is not
-- written: the caller rolls the batch back and the per-message path decides it.
-- The batch's one clock value is taken once (a CTE), not three times per row.
WITH now AS (SELECT clock_timestamp() AS at)
INSERT INTO {table} AS t (
    namespace, idempotency_key, request_hash, status, completed_token, attempts,
    result_json, handler, kafka_topic, kafka_partition, kafka_offset, created_at,
    updated_at, completed_at, shard_key)
SELECT %(ns)s, i.key, i.hash, 'succeeded', i.token, 1, r.result, i.handler, i.topic, i.part,
       i.off, now.at, now.at, now.at, i.shard
FROM unnest(%(keys)b::text[], %(hashes)b::text[], %(handlers)b::text[], %(topics)b::text[],
            %(parts)b::int[], %(offs)b::bigint[], %(shards)b::text[], %(tokens)b::uuid[])
     WITH ORDINALITY AS i(key, hash, handler, topic, part, off, shard, token, n)
-- results travel as one JSON array (one encode per batch), matched by position
JOIN jsonb_array_elements(%(results)s::jsonb) WITH ORDINALITY AS r(result, n) USING (n)
CROSS JOIN now
ORDER BY i.key COLLATE "C"
ON CONFLICT (namespace, idempotency_key) DO NOTHING;

-- name: batch_clock
-- Batch path, a batch written by COPY (batch_copy_done): the one time its records are
-- stamped with (created, updated and completed), read at the end of its handlers'
-- pipeline.
SELECT clock_timestamp();

-- name: batch_copy_done
-- Batch path, a batch of at least BatchQueries.copy_from new keys: the rows
-- batch_insert_done writes, by a binary COPY. The server parses and plans nothing and
-- reads each row as it comes: about two thirds of the insert's CPU per record, for two
-- round trips of its own (a COPY cannot be pipelined), so small batches insert. Rows
-- go in key order in bytes, the client sorting them as Python sorts str (code points:
-- UTF-8's byte order, "C"). A key someone else inserted since the batch read it fails
-- the COPY with a unique violation (after waiting for that writer to end, if it had
-- not): the caller rolls the batch back and the per-message path decides it.
COPY {table} (
    namespace, idempotency_key, request_hash, status, completed_token, attempts,
    result_json, handler, kafka_topic, kafka_partition, kafka_offset, shard_key,
    created_at, updated_at, completed_at)
FROM STDIN (FORMAT BINARY);

-- name: redrive_states
-- Replay re-drive: the state of each (namespace, key) a batch of dead letters names,
-- with the key's latest audit row there (a key this replay re-ran in an interrupted
-- run shows action 'rerun' and this replay's group). One scan of the audit trail per
-- batch; audit rows from before namespaces (NULL) count for the key's namespace.
-- untouched: nothing changed the record since that audit row (no claim, no attempt):
-- a re-run whose message may never have been sent (see `rerun` of a stranded key).
WITH found AS (
    SELECT r.namespace, r.idempotency_key, r.status, r.error_kind, r.request_hash,
           r.updated_at
    FROM unnest(%(nss)s::text[], %(keys)s::text[]) AS w(ns, key)
    JOIN {table} r ON r.namespace = w.ns AND r.idempotency_key = w.key
), latest AS (
    SELECT DISTINCT ON (f.namespace, f.idempotency_key)
           f.namespace, f.idempotency_key, a.action, a.selection, a.at
    FROM found f
    JOIN {audit} a ON a.idempotency_key = f.idempotency_key
                  AND (a.namespace = f.namespace OR a.namespace IS NULL)
    ORDER BY f.namespace, f.idempotency_key, a.id DESC
)
SELECT f.namespace, f.idempotency_key, f.status, f.error_kind, f.request_hash,
       l.action AS last_action, l.at AS last_at,
       l.selection ->> 'via' AS last_via, l.selection ->> 'run' AS last_run,
       l.selection ->> 'group' AS last_group, l.selection ->> 'dlq_topic' AS last_topic,
       l.selection ->> 'partition' AS last_partition, l.selection ->> 'offset' AS last_offset,
       f.updated_at <= l.at AS untouched
FROM found f
LEFT JOIN latest l USING (namespace, idempotency_key);

-- name: failed_selection
-- Bulk re-run: the failed records a filter selects (NULL parameters select all),
-- oldest failure first, with the shard key each re-run then names (a read of every shard
-- on a distributed store, acceptable for an admin tool).
SELECT namespace, idempotency_key, error_kind, error_class, error_message, handler,
       kafka_topic, last_failure_at, shard_key
FROM {table}
WHERE status = 'failed'
  AND (%(ns)s::text IS NULL OR namespace = %(ns)s::text)
  AND (%(kind)s::text IS NULL OR error_kind = %(kind)s::text)
  AND (%(handler)s::text IS NULL OR handler = %(handler)s::text)
  AND (%(since)s::timestamptz IS NULL OR last_failure_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR last_failure_at < %(until)s::timestamptz)
  AND (%(prefix)s::text IS NULL OR starts_with(idempotency_key, %(prefix)s::text))
ORDER BY last_failure_at, namespace, idempotency_key
LIMIT %(limit)s;

-- name: unassigned
-- Records written before namespaces (namespace '') of the given (topic, handler)
-- pairs whose key the namespace does not hold yet: what an adoption would assign.
SELECT u.kafka_topic, u.handler, count(*) AS n
FROM {table} u
JOIN unnest(%(topics)s::text[], %(handlers)s::text[]) AS p(topic, handler)
  ON u.kafka_topic = p.topic AND u.handler = p.handler
WHERE u.namespace = ''
  AND NOT EXISTS (SELECT 1 FROM {table} n
                  WHERE n.namespace = %(ns)s AND n.idempotency_key = u.idempotency_key
                    {shard_join})
GROUP BY 1, 2
ORDER BY 1, 2;

-- name: adopt
-- The audited adoption: those records move to the namespace (the guard allows it
-- only with kafka_idem.admin_action = 'adopt', and nothing else changes).
UPDATE {table} u
SET namespace = %(ns)s
FROM unnest(%(topics)s::text[], %(handlers)s::text[]) AS p(topic, handler)
WHERE u.kafka_topic = p.topic AND u.handler = p.handler
  AND u.namespace = ''
  AND NOT EXISTS (SELECT 1 FROM {table} n
                  WHERE n.namespace = %(ns)s AND n.idempotency_key = u.idempotency_key
                    {shard_join})
RETURNING u.kafka_topic, u.handler;

-- name: outbox_lock_slots
-- Before a transaction's events are inserted: lock the slots of their keys (the
-- caller sorts and dedupes them, so concurrent transactions lock in one order and
-- cannot deadlock on them) and wake the relays of their shards. A later transaction
-- emitting the same key waits here for this one's commit, so it gets a later id:
-- per-key order is commit order. Notifications are delivered at commit only.
WITH locked AS (
    INSERT INTO {outbox_slots} AS s (namespace, slot)
    SELECT %(ns)s, slot FROM unnest(%(slots)b::int4[]) AS slot
    ON CONFLICT (namespace, slot) DO UPDATE SET slot = EXCLUDED.slot
    RETURNING 1
)
SELECT (SELECT count(*) FROM locked),
       (SELECT count(pg_notify(%(channel)s, note)) FROM unnest(%(notes)b::text[]) AS note);

-- name: outbox_lock_slots_distributed
-- outbox_lock_slots on a distributed store (Citus): the same order, by an advisory lock
-- per slot on the coordinator, held to the end of the transaction, instead of a row of
-- a reference table (a write there would make every emitting message a transaction on
-- every node). Every member reaches the store through the coordinator, where these
-- locks live; the slots are taken in the caller's (sorted) order.
SELECT (SELECT count(pg_advisory_xact_lock(hashtext(%(ns)s), s.slot))
        FROM unnest(%(slots)b::int4[]) WITH ORDINALITY AS s(slot, n)),
       (SELECT count(pg_notify(%(channel)s, note)) FROM unnest(%(notes)b::text[]) AS note);

-- name: local_writes
-- A distributed store (Citus) only, before a message's completion: the tables local to
-- the coordinator this transaction wrote (or began to write: the lock a write takes).
-- The record lives on a worker, and Citus commits a worker's part before the
-- coordinator's own: a crash in between would keep the one without the other.
SELECT c.oid::regclass::text
FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
WHERE l.locktype = 'relation' AND l.pid = pg_backend_pid() AND l.mode = 'RowExclusiveLock'
  AND c.relkind IN ('r', 'p')
  AND NOT EXISTS (SELECT 1 FROM pg_dist_partition p WHERE p.logicalrelid = c.oid)
ORDER BY 1;

-- name: outbox_wake
-- Wake the relays of shards whose events committed without a notification of their
-- own (the per-message path writes a unit's messages in many transactions and wakes
-- the relays once, after them: notifying commits queue for one server-wide lock).
SELECT count(pg_notify(%(channel)s, note)) FROM unnest(%(notes)b::text[]) AS note;

-- name: outbox_insert
-- A transaction's events, in emit order (ids follow the array's order).
INSERT INTO {outbox} (namespace, shard, topic, key, value, headers, idem_key,
                      source_topic, source_partition, source_offset, shard_key)
SELECT %(ns)s, e.shard, e.topic, e.key, e.value, e.headers, e.idem_key,
       e.source_topic, e.source_partition, e.source_offset, e.shard_key
FROM unnest(%(shards)b::int4[], %(topics)b::text[], %(keys)b::bytea[], %(values)b::bytea[],
            %(headers)b::jsonb[], %(idem_keys)b::text[], %(source_topics)b::text[],
            %(source_partitions)b::int4[], %(source_offsets)b::int8[], %(shard_keys)b::text[])
     WITH ORDINALITY AS e(shard, topic, key, value, headers, idem_key, source_topic,
                          source_partition, source_offset, shard_key, n)
ORDER BY e.n;

-- name: outbox_insert_distributed
-- outbox_insert on a distributed store (Citus): one event a statement, run for each in
-- emit order (each parameter is that event's element of outbox_insert's array of the
-- same name). A row of VALUES is routed to the message's shard; an INSERT ... SELECT
-- from unnest would pass through the coordinator and commit on two nodes.
INSERT INTO {outbox} (namespace, shard, topic, key, value, headers, idem_key,
                      source_topic, source_partition, source_offset, shard_key)
VALUES (%(ns)s, %(shards)s, %(topics)s, %(keys)s, %(values)s, %(headers)s, %(idem_keys)s,
        %(source_topics)s, %(source_partitions)s, %(source_offsets)s, %(shard_keys)s);

-- name: outbox_select
-- What a shard's relay publishes next: the rows visible now, in id order. Never
-- "id > the last published id": a lower id can commit after a higher one.
SELECT id, topic, key, value, headers, idem_key, source_topic, source_partition,
       source_offset, created_at
FROM {outbox}
WHERE namespace = %(ns)s AND shard = %(shard)s
ORDER BY id
LIMIT %(limit)s;

-- name: outbox_delete
-- The rows a committed Kafka transaction published (exactly those ids).
DELETE FROM {outbox} WHERE namespace = %(ns)s AND id = ANY(%(ids)b::int8[]);

-- name: outbox_pending
-- Unpublished rows and the age of the oldest, per namespace (NULL: every namespace).
SELECT namespace, count(*) AS pending,
       extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS oldest_age_seconds
FROM {outbox}
WHERE %(ns)s::text IS NULL OR namespace = %(ns)s
GROUP BY namespace
ORDER BY namespace;

-- name: outbox_identity
-- Which outbox this is: a marker names it, so a marker written for another database
-- (or for an outbox table since dropped and created again, its ids restarting) is
-- never taken to name this one's rows.
SELECT format('%%s:%%s', d.oid, %(table)s::regclass::oid)
FROM pg_database d WHERE d.datname = current_database();

-- name: pause_insert
-- Pause a handler (migration 0008); nothing when it is paused already (the row that
-- stands is returned by pause_get). Notifies the members at the commit.
WITH added AS (
    INSERT INTO {pauses} (namespace, handler, reason, actor)
    VALUES (%(ns)s, %(handler)s, %(reason)s, %(actor)s)
    ON CONFLICT (namespace, handler) DO NOTHING
    RETURNING namespace, handler, reason, actor, paused_at
)
SELECT a.*, pg_notify(%(channel)s, a.namespace) AS notified FROM added a;

-- name: pause_delete
-- Resume a handler: its row goes (the audit trail keeps the history). Notifies the
-- members at the commit.
WITH gone AS (
    DELETE FROM {pauses} WHERE namespace = %(ns)s AND handler = %(handler)s
    RETURNING namespace, handler, reason, actor, paused_at
)
SELECT g.*, pg_notify(%(channel)s, g.namespace) AS notified FROM gone g;

-- name: pauses_of
-- The paused handlers of a namespace (every namespace's with NULL), by namespace, name.
SELECT namespace, handler, reason, actor, paused_at
FROM {pauses}
WHERE %(ns)s::text IS NULL OR namespace = %(ns)s
ORDER BY namespace, handler;
