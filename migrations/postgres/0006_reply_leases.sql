-- Replies that survive their replica, fenced. A streaming reply is owned by one replica at a
-- time: `lease_epoch` grows by one with each claim, and every write of the reply (progress,
-- heartbeat, its end) holds only for the epoch its writer owns, so a replica that lost the reply
-- can change nothing. While the reply streams, its checkpoint is kept beside its text: the job
-- that makes it (JSON), the generated token ids the saved text is (space-separated) and how many
-- of its events that text covers. A replica taking the reply over continues from the checkpoint
-- when the reply's stream in Redis is lost. The three are cleared when the reply ends.
ALTER TABLE messages ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE messages ADD COLUMN reply_job TEXT;
ALTER TABLE messages ADD COLUMN reply_tokens TEXT;
ALTER TABLE messages ADD COLUMN reply_events BIGINT;
