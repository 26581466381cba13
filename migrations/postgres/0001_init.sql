-- Users, API keys, chat sessions and their messages. Timestamps are Unix milliseconds (BIGINT),
-- the same representation as the SQLite schema, so one query layer serves both databases.

CREATE TABLE users (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    created_at  BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id                   TEXT PRIMARY KEY,
    user_id              TEXT NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    -- The first characters of the key, shown to people and used to find candidates for a key.
    prefix               TEXT NOT NULL,
    -- SHA-256 of the whole key, hex; the key itself is never stored.
    key_hash             TEXT NOT NULL UNIQUE,
    requests_per_minute  BIGINT,
    tokens_per_day       BIGINT,
    created_at           BIGINT NOT NULL,
    expires_at           BIGINT,
    revoked_at           BIGINT
);
CREATE INDEX api_keys_prefix ON api_keys (prefix);

CREATE TABLE sessions (
    id             TEXT PRIMARY KEY,
    user_id        TEXT NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    title          TEXT NOT NULL,
    -- The title lowercased by the application (full Unicode), for case-insensitive search.
    title_lower    TEXT NOT NULL,
    system_prompt  TEXT,
    -- Default sampling parameters for the session's turns, JSON.
    params         TEXT,
    created_at     BIGINT NOT NULL,
    updated_at     BIGINT NOT NULL,
    deleted_at     BIGINT
);
CREATE INDEX sessions_user_updated ON sessions (user_id, updated_at DESC, id DESC);

CREATE TABLE messages (
    id                 TEXT PRIMARY KEY,
    session_id         TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq                BIGINT NOT NULL,
    role               TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content            TEXT NOT NULL,
    status             TEXT NOT NULL CHECK (status IN ('complete', 'streaming', 'stopped', 'error')),
    finish_reason      TEXT,
    prompt_tokens      BIGINT,
    cached_tokens      BIGINT,
    completion_tokens  BIGINT,
    ttft_ms            BIGINT,
    duration_ms        BIGINT,
    worker             TEXT,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL,
    UNIQUE (session_id, seq)
);
CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming';
