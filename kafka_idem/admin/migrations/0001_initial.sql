-- kafka_idem store, version 1.
-- Placeholders are filled with quoted identifiers by kafka_idem.migrations:
-- {schema}, {table}, {audit}, {guard}, {audit_guard}, {status_idx}, {retry_idx}.

CREATE TABLE {table} (
    idempotency_key   text        PRIMARY KEY,
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
    CHECK (status <> 'processing' OR (owner_token IS NOT NULL AND lease_until IS NOT NULL)),
    CHECK (status <> 'succeeded' OR completed_token IS NOT NULL)
) WITH (fillfactor = 80);

-- status/retention queries; partial index keeps the hot "not done" set small.
CREATE INDEX {status_idx} ON {table} (status, updated_at);
CREATE INDEX {retry_idx} ON {table} (next_attempt_at) WHERE status IN ('processing', 'retryable_failed');

-- Allowed transitions , enforced here so no code path can bypass them:
--   (new)            -> processing
--   processing       -> processing (lease extension / takeover), succeeded, retryable_failed, failed
--   retryable_failed -> processing, failed
--   failed           -> retryable_failed  only inside an audited admin re-run
--   succeeded        -> nothing
-- DELETE only inside an audited purge, and only of succeeded/failed rows.
CREATE FUNCTION {guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    -- coalesce: a NULL here would make the checks below NULL, and IF NULL never raises.
    admin text := coalesce(current_setting('kafka_idem.admin_action', true), '');
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.status <> 'processing' THEN
            RAISE EXCEPTION USING ERRCODE = 'KI001',
                MESSAGE = format('kafka_idem: illegal transition (new) -> %s for %s', NEW.status, NEW.idempotency_key);
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
    IF NEW.attempts < OLD.attempts THEN
        RAISE EXCEPTION USING ERRCODE = 'KI001',
            MESSAGE = format('kafka_idem: attempts never decrease (%s)', OLD.idempotency_key);
    END IF;
    IF NOT (
        (OLD.status = 'processing' AND NEW.status IN ('processing', 'succeeded', 'retryable_failed', 'failed'))
        OR (OLD.status = 'retryable_failed' AND NEW.status IN ('processing', 'failed'))
        OR (OLD.status = 'failed' AND NEW.status = 'retryable_failed' AND admin = 'rerun')
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

CREATE TRIGGER guard_transitions
    BEFORE INSERT OR UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION {guard}();

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
    counts           jsonb
);

CREATE FUNCTION {audit_guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'KI001', MESSAGE = 'kafka_idem: the audit trail is append-only';
END
$fn$;

CREATE TRIGGER audit_append_only
    BEFORE UPDATE OR DELETE ON {audit}
    FOR EACH ROW EXECUTE FUNCTION {audit_guard}();
