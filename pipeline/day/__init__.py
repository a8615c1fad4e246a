"""The day's input: the exchanges' dumps read and validated, the trading calendar, and the
split that deals the day's accounts into shard files (stage 1). Below the note: a note is
built from what this package reads."""
