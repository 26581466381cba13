-- Admin keys may load and unload models on the workers (`hearth keys create --admin`); 1 for
-- an admin key, 0 for any other.
ALTER TABLE api_keys ADD COLUMN admin INTEGER NOT NULL DEFAULT 0;
