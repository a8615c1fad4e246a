"""What a run keeps: live state in Redis (records, counters, the mail guard), storage (the
archive, the delivery log, the reports) and every key format of both. Everything above writes
through here; it imports nothing above settings."""
