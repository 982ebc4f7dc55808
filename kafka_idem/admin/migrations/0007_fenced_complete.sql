-- The fenced completion fails on the server when it is stale, so the leased path can
-- send it together with its COMMIT (one round trip) instead of reading its row first.
--
-- {fence}(completed, key) is given the number of rows the completion updated (one
-- when the token still owns the key, none when it was taken over). With none it
-- raises KI002, the guard's "stale owner" SQLSTATE: the transaction aborts, the
-- COMMIT sent after it cannot commit the handler's writes, and the client sees
-- StaleOwner (retried and then replayed or taken over, never dead-lettered: KI002 is
-- not a data error, whose classes are 22 and 23). Numbered 0007: 0006 is the outbox.
CREATE FUNCTION {fence}(completed bigint, key text) RETURNS bigint LANGUAGE plpgsql AS $fn$
BEGIN
    IF coalesce(completed, 0) = 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'KI002',
            MESSAGE = format('kafka_idem: stale owner cannot complete %s', key);
    END IF;
    RETURN completed;
END
$fn$;
