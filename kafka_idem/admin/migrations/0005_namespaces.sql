-- Keys are scoped per app: a record is identified by (namespace, idempotency_key).
-- Two apps that share a store and a key template no longer answer each other's
-- keys; apps that should share records say so with the same `namespace` setting.
--
-- Records written before this migration belong to no app yet: they get the
-- reserved namespace '' ("unassigned"), which no app can name. An app is refused
-- at start while unassigned records of its (topic, handler) pairs exist, until
-- `kafka-idem migrate --app MODULE:APP` assigns them to the app's namespace (an
-- audited admin action, 'adopt'). Nothing is copied or dropped, so no record is
-- lost or duplicated, and no key already done is run again.
ALTER TABLE {table} ADD COLUMN namespace text NOT NULL DEFAULT '';
ALTER TABLE {table} ALTER COLUMN namespace DROP DEFAULT;
ALTER TABLE {table} DROP CONSTRAINT {pkey};
ALTER TABLE {table} ADD CONSTRAINT {pkey} PRIMARY KEY (namespace, idempotency_key);

ALTER TABLE {audit} ADD COLUMN namespace text;
CREATE INDEX {audit_key_idx} ON {audit} (namespace, idempotency_key, id);

-- The guard: the namespace is immutable, except that an unassigned record may be
-- assigned to an app (admin action 'adopt', nothing else changing); a new record
-- may not be unassigned. Every other decision is unchanged.
CREATE OR REPLACE FUNCTION {guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    -- coalesce: a NULL here would make the checks below NULL, and IF NULL never raises.
    admin text := coalesce(current_setting('kafka_idem.admin_action', true), '');
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.status <> 'processing' THEN
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

-- The triggers' WHEN conditions: a namespace change is never "obviously legal"
-- (it runs the function), and an insert without a namespace runs the function
-- (which refuses it).
DROP TRIGGER guard_transitions ON {table};
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

DROP TRIGGER guard_transitions_insert ON {table};
CREATE TRIGGER guard_transitions_insert
    BEFORE INSERT ON {table}
    FOR EACH ROW
    WHEN (NEW.status IS DISTINCT FROM 'processing' OR NEW.namespace IS NOT DISTINCT FROM '')
    EXECUTE FUNCTION {guard}();
