-- The model a session was created for (its id as the workers report it); NULL follows whatever
-- model is served.
ALTER TABLE sessions ADD COLUMN model TEXT;
