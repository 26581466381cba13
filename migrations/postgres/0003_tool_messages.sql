-- Tool calling on the native API: a reply may make tool calls (stored as OpenAI's JSON array,
-- beside the text the model wrote), and a `tool` message holds the result of one call, naming
-- the call it answers.
ALTER TABLE messages DROP CONSTRAINT messages_role_check;
ALTER TABLE messages ADD CONSTRAINT messages_role_check
    CHECK (role IN ('user', 'assistant', 'tool'));
ALTER TABLE messages ADD COLUMN tool_calls TEXT;
ALTER TABLE messages ADD COLUMN tool_call_id TEXT;
