-- Where each outbox row goes, stored, so that the relay's claim can pick rows
-- destination by destination instead of reading a backlog in order.
-- `destination` is a webhook URL's host (and port), lower-cased, or 'mail
-- provider' for every other row (no host name has a space; the relay spells it
-- MAIL_DESTINATION). `destination_owner` is the tenant that chose that
-- destination: a webhook's tenant, '' for the mail provider, which no tenant
-- chooses. A tenant's webhooks share one cap of the relay's slots, however
-- many host names they use.
ALTER TABLE outbox
  ADD COLUMN destination text NOT NULL GENERATED ALWAYS AS (
    CASE WHEN payload ? 'webhook'
      THEN coalesce(lower(substring(payload->>'webhook' FROM '^[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/?#]*@)?([^/?#]*)')), '')
      ELSE 'mail provider' END
  ) STORED,
  ADD COLUMN destination_owner text NOT NULL GENERATED ALWAYS AS (
    CASE WHEN payload ? 'webhook' THEN coalesce(payload->>'tenant', '') ELSE '' END
  ) STORED;
-- A claim walks the (owner, destination) lanes that have unsent rows, one
-- index probe each, skipping an owner at its cap in one probe, and reads the
-- first due rows of each lane it may send to.
CREATE INDEX outbox_lanes ON outbox (destination_owner, destination, next_attempt_at, id)
  WHERE sent_at IS NULL AND failed_at IS NULL;
