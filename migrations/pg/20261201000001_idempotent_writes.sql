-- Writes the group commit may run twice (a batch re-run after its
-- connection died, perhaps after the server committed it) recognise their
-- own earlier effect instead of applying it again.

-- The decision that last changed the row: a re-run of that decision finds
-- itself here (same write, same lease epoch) and changes nothing.
ALTER TABLE operations ADD COLUMN last_write UUID;

-- The write that logged the event (an intent: its operation's id); NULL
-- for writes that are never re-run. An append re-run finds its events here.
ALTER TABLE operation_events ADD COLUMN write_id UUID;
