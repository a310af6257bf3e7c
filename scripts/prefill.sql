-- Pre-fills the ledger with :n decided operations as the service writes
-- them (the row, its reconcile log), spread over the last :n / 100 seconds
-- before the newest decision, then ANALYZEs: never measure from empty
-- tables. Ids are time-ordered (UUIDv7, as the service makes them); keys,
-- servers and volumes random. The decisions predate the verification
-- cursors, so the verifier leaves them alone.
--   psql -v n=100000 -f scripts/prefill.sql DATABASE
\set ON_ERROR_STOP on
BEGIN;
CREATE TEMP TABLE prefill ON COMMIT DROP AS
SELECT g,
       (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || substr(r, 19))::uuid AS id,
       t AS created_at, gen_random_uuid() AS server_id, gen_random_uuid() AS volume_id
FROM (SELECT g, gen_random_uuid()::text AS r, t,
             lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') AS h
      FROM (SELECT g, (SELECT min(decided_at) FROM verification_cursors) - interval '1 hour'
                      - (:n - g) * interval '10 milliseconds' AS t
            FROM generate_series(1, :n) g) s) s;
INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution, server_id, volume_id,
    request, attachment, attempts, deadline_at, last_request_at, created_at, updated_at, completed_at,
    lease_epoch, last_write, verify_expect)
SELECT id, 'prefill-' || id, 'attach|' || server_id || '|' || volume_id || '|{}', 'attach', 'succeeded', 'response',
    server_id, volume_id, '{}'::jsonb,
    jsonb_build_object('id', volume_id, 'tag', null, 'device', '/dev/vdb', 'delete_on_termination', false),
    1, created_at + interval '9 seconds', created_at, created_at, created_at + interval '30 ms',
    created_at + interval '30 ms', 1, id, true
FROM prefill ORDER BY g;
INSERT INTO operation_events (operation_id, at, kind, detail, metadata, replica, write_id)
SELECT id, created_at + e.ms * interval '1 millisecond', e.kind, e.detail, e.metadata, 'prefill', id
FROM prefill, LATERAL (VALUES
    (1, 'recorded', 'attach recorded', jsonb_build_object('caller', '-', 'answer_by_ms', '9499',
        'idempotency_key', 'prefill-' || id, 'caller_deadline_ms', '9999', 'deadline_from_caller', 'true')),
    (2, 'request_sent', 'POST attach request #1 with an outbound deadline of 7463 ms',
        jsonb_build_object('attempt', '1', 'request_id', 'req-' || id, 'outbound_deadline_ms', '7463')),
    (3, 'response', 'Nova answered 200: attachment created',
        jsonb_build_object('elapsed_ms', '1', 'http_status', '200', 'nova_request_id', 'req-' || gen_random_uuid())),
    (30, 'resolved', 'attached (Nova''s response)', '{"state": "succeeded", "resolution": "response"}'::jsonb)
) AS e(ms, kind, detail, metadata)
ORDER BY g, e.ms;
COMMIT;
VACUUM ANALYZE;
