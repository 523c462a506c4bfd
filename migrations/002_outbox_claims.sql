-- The relay's lease: a claim stamps a token, so a relay whose lease expired
-- cannot record a failure over a row another relay has since claimed.
ALTER TABLE outbox ADD COLUMN claim_token uuid;
ALTER TABLE outbox ADD COLUMN provider_message_id text;
