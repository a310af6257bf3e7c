-- See migrations/pg: a repeated write recognises its own earlier effect.
ALTER TABLE operations ADD COLUMN last_write TEXT;
ALTER TABLE operation_events ADD COLUMN write_id TEXT;
