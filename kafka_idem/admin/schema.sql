-- kafka_idem store: the full current schema, used to build a new store in one step.
-- It must equal applying every file of migrations/ in order; a test compares both.
-- Placeholders are filled with quoted identifiers by kafka_idem.migrate:
-- {schema}, {table}, {audit}, {guard}, {audit_guard}, {status_idx}, {retry_idx},
-- {pkey}, {audit_key_idx}, {fence}, {pauses}.

CREATE TABLE {table} (
    idempotency_key   text        NOT NULL,
    request_hash      text        NOT NULL,
    status            text        NOT NULL
        CHECK (status IN ('processing', 'succeeded', 'retryable_failed', 'failed')),
    result_json       jsonb,
    error_kind        text,
    error_class       text,
    error_message     text,
    owner_token       uuid,
    completed_token   uuid,
    lease_until       timestamptz,
    attempts          integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at   timestamptz,
    first_failure_at  timestamptz,
    last_failure_at   timestamptz,
    handler           text,
    kafka_topic       text,
    kafka_partition   integer,
    kafka_offset      bigint,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    completed_at      timestamptz,
    attempt_base      integer     NOT NULL DEFAULT 0 CHECK (attempt_base >= 0),
    -- the app (or the apps sharing it on purpose) the key belongs to; '' = written
    -- before namespaces existed and not yet assigned to an app (migration 0005)
    namespace         text        NOT NULL,
    -- the value a distributed store (Citus) keeps a message's rows together by
    -- (migration 0009); NULL on one PostgreSQL unless the handler sets shard_key=
    shard_key         text,
    CONSTRAINT {pkey} PRIMARY KEY (namespace, idempotency_key),
    CHECK (status <> 'processing' OR (owner_token IS NOT NULL AND lease_until IS NOT NULL)),
    CHECK (status <> 'succeeded' OR completed_token IS NOT NULL)
) WITH (fillfactor = 80);

-- status/retention queries; partial index keeps the hot "not done" set small.
CREATE INDEX {status_idx} ON {table} (status, updated_at);
CREATE INDEX {retry_idx} ON {table} (next_attempt_at) WHERE status IN ('processing', 'retryable_failed');

-- Allowed transitions , enforced here so no code path can bypass them:
--   (new)            -> processing
--   (new)            -> succeeded  a claim completed in the transaction that made it
--   processing       -> processing (lease extension / takeover), succeeded, retryable_failed, failed
--   retryable_failed -> processing, failed
--   failed           -> retryable_failed  only inside an audited admin re-run
--   failed           -> failed            (dead-lettered again: its failure time moves)
--   succeeded        -> nothing
-- The key, the request hash and the namespace never change, except that a record
-- written before namespaces ('') may be assigned to an app by an audited adoption.
-- DELETE only inside an audited purge, and only of succeeded/failed rows.
CREATE FUNCTION {guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    -- coalesce: a NULL here would make the checks below NULL, and IF NULL never raises.
    admin text := coalesce(current_setting('kafka_idem.admin_action', true), '');
BEGIN
    IF TG_OP = 'INSERT' THEN
        -- (new) -> succeeded (migration 0010): a claim and its completion written as one
        -- row by one transaction (the batch path), with its token as completed_token.
        -- No other transaction can tell it from (new) -> processing -> succeeded in that
        -- transaction, which was always allowed: the processing row is never visible.
        -- (A NULL status is left to its NOT NULL constraint, as before.)
        IF NEW.status <> 'processing'
           AND NOT coalesce(NEW.status = 'succeeded' AND NEW.completed_token IS NOT NULL
                            AND NEW.owner_token IS NULL AND NEW.lease_until IS NULL,
                            false) THEN
            RAISE EXCEPTION USING ERRCODE = 'KI001',
                MESSAGE = format('kafka_idem: illegal transition (new) -> %s for %s', NEW.status, NEW.idempotency_key);
        END IF;
        IF NEW.namespace = '' THEN
            RAISE EXCEPTION USING ERRCODE = 'KI001',
                MESSAGE = format('kafka_idem: a new record needs a namespace (%s)', NEW.idempotency_key);
        END IF;
        RETURN NEW;
    END IF;
    IF TG_OP = 'DELETE' THEN
        IF admin <> 'purge' OR OLD.status NOT IN ('succeeded', 'failed') THEN
            RAISE EXCEPTION USING ERRCODE = 'KI001',
                MESSAGE = format('kafka_idem: deleting a %s record is not allowed outside an audited purge (%s)', OLD.status, OLD.idempotency_key);
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.idempotency_key <> OLD.idempotency_key OR NEW.request_hash <> OLD.request_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'KI001',
            MESSAGE = format('kafka_idem: key and request hash are immutable (%s)', OLD.idempotency_key);
    END IF;
    IF NEW.namespace IS DISTINCT FROM OLD.namespace THEN
        -- only an unassigned record, only to a real namespace, only in an audited
        -- adoption, and nothing else about it changes
        IF NOT (OLD.namespace = '' AND NEW.namespace <> '' AND admin = 'adopt'
                AND (to_jsonb(NEW) - 'namespace') IS NOT DISTINCT FROM (to_jsonb(OLD) - 'namespace')) THEN
            RAISE EXCEPTION USING ERRCODE = 'KI001',
                MESSAGE = format('kafka_idem: the namespace of %s is immutable outside an audited adoption of an unassigned record', OLD.idempotency_key);
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        RAISE EXCEPTION USING ERRCODE = 'KI001',
            MESSAGE = format('kafka_idem: attempts never decrease (%s)', OLD.idempotency_key);
    END IF;
    IF NOT (
        (OLD.status = 'processing' AND NEW.status IN ('processing', 'succeeded', 'retryable_failed', 'failed'))
        OR (OLD.status = 'retryable_failed' AND NEW.status IN ('processing', 'failed'))
        OR (OLD.status = 'failed' AND NEW.status = 'retryable_failed' AND admin = 'rerun')
        -- a failed record dead-lettered again (migration 0004): only its failure time moves
        -- (NULL-safe: an unexpected NULL must not turn this clause into a pass)
        OR (OLD.status = 'failed' AND NEW.status IS NOT DISTINCT FROM 'failed'
            AND NEW.attempts IS NOT DISTINCT FROM OLD.attempts
            AND NEW.idempotency_key IS NOT DISTINCT FROM OLD.idempotency_key
            AND NEW.request_hash IS NOT DISTINCT FROM OLD.request_hash)
    ) THEN
        RAISE EXCEPTION USING ERRCODE = 'KI001',
            MESSAGE = format('kafka_idem: illegal transition %s -> %s for %s', OLD.status, NEW.status, OLD.idempotency_key);
    END IF;
    -- Fencing: only the current owner's token can complete (a stale owner whose lease was taken over must not win).
    IF OLD.status = 'processing' AND NEW.status = 'succeeded'
       AND NEW.completed_token IS DISTINCT FROM OLD.owner_token THEN
        RAISE EXCEPTION USING ERRCODE = 'KI002',
            MESSAGE = format('kafka_idem: stale owner cannot complete %s', OLD.idempotency_key);
    END IF;
    RETURN NEW;
END
$fn$;

-- The function runs only for rows that need checking (migration 0003): each
-- trigger's WHEN, evaluated without a function call, lets through the rows that
-- are legal by construction; every other row runs {guard}(), which decides as
-- above. NULL-safe: an unexpected NULL makes a row "not obviously legal", so the
-- function runs (a NULL WHEN would skip it).
--   UPDATE: legal without the function when namespace, key and request hash are unchanged,
--           attempts do not decrease, and the transition is processing ->
--           processing / retryable_failed / failed, processing -> succeeded with
--           completed_token = owner_token, or retryable_failed -> processing /
--           failed. Everything else (admin re-runs included) runs the function.
--   INSERT: a new 'processing' row with a namespace is legal, and so is a new 'succeeded'
--           one with its completed_token and no lease (migration 0010); anything
--           else runs the function.
--   DELETE: always runs the function.
CREATE TRIGGER guard_transitions
    BEFORE UPDATE ON {table}
    FOR EACH ROW
    WHEN (NOT coalesce(
        NEW.namespace = OLD.namespace
        AND NEW.idempotency_key = OLD.idempotency_key
        AND NEW.request_hash = OLD.request_hash
        AND NEW.attempts >= OLD.attempts
        AND ((OLD.status = 'processing'
              AND NEW.status IN ('processing', 'retryable_failed', 'failed'))
             OR (OLD.status = 'processing' AND NEW.status = 'succeeded'
                 AND NEW.completed_token = OLD.owner_token)
             OR (OLD.status = 'retryable_failed' AND NEW.status IN ('processing', 'failed'))),
        false))
    EXECUTE FUNCTION {guard}();

CREATE TRIGGER guard_transitions_insert
    BEFORE INSERT ON {table}
    FOR EACH ROW
    WHEN (NOT coalesce(
        NEW.namespace <> ''
        AND (NEW.status = 'processing'
             OR (NEW.status = 'succeeded' AND NEW.completed_token IS NOT NULL
                 AND NEW.owner_token IS NULL AND NEW.lease_until IS NULL)),
        false))
    EXECUTE FUNCTION {guard}();

CREATE TRIGGER guard_transitions_delete
    BEFORE DELETE ON {table}
    FOR EACH ROW
    EXECUTE FUNCTION {guard}();

-- Append-only trail of every admin action (rerun, purge, replay).
CREATE TABLE {audit} (
    id               bigserial   PRIMARY KEY,
    at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor            text        NOT NULL,
    action           text        NOT NULL,
    idempotency_key  text,
    selection        jsonb,
    reason           text,
    previous_status  text,
    previous_error   text,
    counts           jsonb,
    namespace        text
);

CREATE INDEX {audit_key_idx} ON {audit} (namespace, idempotency_key, id);

CREATE FUNCTION {audit_guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'KI001', MESSAGE = 'kafka_idem: the audit trail is append-only';
END
$fn$;

CREATE TRIGGER audit_append_only
    BEFORE UPDATE OR DELETE ON {audit}
    FOR EACH ROW EXECUTE FUNCTION {audit_guard}();

-- The transactional outbox (migration 0006; see docs/OUTBOX.md).
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
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    shard_key        text
);

CREATE INDEX {outbox_shard_idx} ON {outbox} (namespace, shard, id);

CREATE TABLE {outbox_slots} (
    namespace text    NOT NULL,
    slot      integer NOT NULL,
    PRIMARY KEY (namespace, slot)
);

-- The fenced completion's check (migration 0007): raises KI002 (stale owner) when
-- the completion updated no row, so a completion sent together with its COMMIT
-- aborts the transaction instead of letting the handler's writes commit.
CREATE FUNCTION {fence}(completed bigint, key text) RETURNS bigint LANGUAGE plpgsql AS $fn$
BEGIN
    IF coalesce(completed, 0) = 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'KI002',
            MESSAGE = format('kafka_idem: stale owner cannot complete %s', key);
    END IF;
    RETURN completed;
END
$fn$;

-- Paused handlers (migration 0008): one row per (namespace, handler) while it is
-- paused; pause and resume are audited (actions 'pause', 'resume').
CREATE TABLE {pauses} (
    namespace  text        NOT NULL,
    handler    text        NOT NULL,
    reason     text        NOT NULL,
    actor      text        NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (namespace, handler)
);
