-- Tool calling on the native API: a reply may make tool calls (stored as OpenAI's JSON array,
-- beside the text the model wrote), and a `tool` message holds the result of one call, naming
-- the call it answers. SQLite cannot change a CHECK constraint in place, so the table is
-- rebuilt with the same rows. Nothing refers to `messages`, so dropping it cascades nowhere.
CREATE TABLE messages_new (
    id                 TEXT PRIMARY KEY,
    session_id         TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq                INTEGER NOT NULL,
    role               TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content            TEXT NOT NULL,
    status             TEXT NOT NULL CHECK (status IN ('complete', 'streaming', 'stopped', 'error')),
    finish_reason      TEXT,
    prompt_tokens      INTEGER,
    cached_tokens      INTEGER,
    completion_tokens  INTEGER,
    ttft_ms            INTEGER,
    duration_ms        INTEGER,
    worker             TEXT,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    tool_calls         TEXT,
    tool_call_id       TEXT,
    UNIQUE (session_id, seq)
);
INSERT INTO messages_new (id, session_id, seq, role, content, status, finish_reason,
    prompt_tokens, cached_tokens, completion_tokens, ttft_ms, duration_ms, worker, created_at,
    updated_at)
SELECT id, session_id, seq, role, content, status, finish_reason, prompt_tokens, cached_tokens,
    completion_tokens, ttft_ms, duration_ms, worker, created_at, updated_at
FROM messages;
DROP TABLE messages;
ALTER TABLE messages_new RENAME TO messages;
CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming';
