-- A failed record that is dead-lettered again (a redelivery or a replay of its
-- message) records when: failed -> failed, attempts unchanged, becomes legal, so
-- its last_failure_at moves and `dlq list --since` finds the new dead letter.
-- The function is replaced whole; every other decision is unchanged. The UPDATE
-- trigger's WHEN (0003) does not let failed -> failed through, so this row runs
-- the function, which now allows it.
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
