-- The runs of batches whose lines are not settled yet (issue 43's metrics): the worker's
-- oncely_batch_runs_waiting counts them for each batch in flight (batch_store.ts `batchesInFlight`)
-- without reading the settled runs of those batches, nor any row of a committed batch.
-- (The batches in flight themselves are read through batches_unfinished, migration 020.)
CREATE INDEX IF NOT EXISTS batch_runs_unsettled ON batch_runs (batch_id) WHERE settled IS NULL;
