-- The session's default reply length (a turn's own max_tokens overrides it).
ALTER TABLE sessions ADD COLUMN max_tokens BIGINT;
