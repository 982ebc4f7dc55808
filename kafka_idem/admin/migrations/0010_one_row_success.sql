-- A success in one row version (issue "Performance III"): the batch path writes a new
-- key's record once, as succeeded, after its handler ran, in the transaction that
-- wrote the handler's effect; before, it inserted the record as processing and
-- updated it to succeeded in that same transaction (two row versions, five index
-- entries). The guard now lets a new row be succeeded when it carries its token as
-- completed_token and no lease. That is no new power: (new) -> processing ->
-- succeeded inside one transaction was always allowed, and no other transaction can
-- tell the two apart (the processing row was never visible). (new) -> anything else
-- is still refused, and so is a new row without a namespace.
CREATE OR REPLACE FUNCTION {guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
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

DROP TRIGGER guard_transitions_insert ON {table};
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
