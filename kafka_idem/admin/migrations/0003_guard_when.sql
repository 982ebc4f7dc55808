-- The transition guard runs its plpgsql function only for rows that need checking.
--
-- Until now one trigger called {guard}() for every inserted, updated and deleted
-- row: every claim and every completion paid a plpgsql call. The function is
-- unchanged; three triggers now call it, each with a WHEN condition that the
-- executor evaluates without calling any function. A row the condition lets
-- through is legal by construction (the function would return it unchanged);
-- every other row runs the function, which raises or allows exactly as before
-- (same SQLSTATEs KI001 / KI002, same messages).
--
--   INSERT: a new row starting 'processing' (every claim) is legal; any other
--           status runs the function (which refuses it).
--   UPDATE: legal without the function, when key and request hash are unchanged
--           and attempts do not decrease, and the transition is one of
--             processing       -> processing, retryable_failed, failed
--             processing       -> succeeded with completed_token = owner_token
--             retryable_failed -> processing, failed
--           Anything else runs the function: failed -> retryable_failed (allowed
--           only with kafka_idem.admin_action = 'rerun'), a completion by a stale
--           owner (KI002), every illegal transition, key or hash changes, attempts
--           decreasing.
--   DELETE: always runs the function (purges are rare).
--
-- NULLs: a WHEN that is NULL skips the function, which would silently allow.
-- Hence IS DISTINCT FROM for INSERT, and NOT coalesce(<obviously legal>, false)
-- for UPDATE: an unexpected NULL anywhere makes the row "not obviously legal".
DROP TRIGGER guard_transitions ON {table};

CREATE TRIGGER guard_transitions
    BEFORE UPDATE ON {table}
    FOR EACH ROW
    WHEN (NOT coalesce(
        NEW.idempotency_key = OLD.idempotency_key
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
    WHEN (NEW.status IS DISTINCT FROM 'processing')
    EXECUTE FUNCTION {guard}();

CREATE TRIGGER guard_transitions_delete
    BEFORE DELETE ON {table}
    FOR EACH ROW
    EXECUTE FUNCTION {guard}();
