-- An audited re-run gives a failed key a fresh retry budget without ever
-- decreasing `attempts` (the guard forbids it): exhaustion counts the attempts
-- made since the last re-run, attempts - attempt_base.
ALTER TABLE {table} ADD COLUMN attempt_base integer NOT NULL DEFAULT 0 CHECK (attempt_base >= 0);
