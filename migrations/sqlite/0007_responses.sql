-- Responses of OpenAI's Responses API kept on sessions: a response is the assistant message that
-- answers it, in a session of its user. The row keeps what the `response` object repeats of its
-- request (JSON), the response it continued, and the sequence number of the first message its
-- request added to the session (its input items run from there to the reply). It goes with its
-- message: a regenerate or an edit that drops the reply drops the response, and so does a purge.
CREATE TABLE responses (
    message_id   TEXT PRIMARY KEY REFERENCES messages (id) ON DELETE CASCADE,
    session_id   TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    previous_id  TEXT,
    first_seq    INTEGER NOT NULL,
    request      TEXT NOT NULL,
    created_at   INTEGER NOT NULL
);
CREATE INDEX responses_session ON responses (session_id);
