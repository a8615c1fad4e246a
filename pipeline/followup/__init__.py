"""The run after its day: finding its record (located), bringing a lost Redis back from it
(restore), settling unconfirmed mail (reconcile), recording bounces, closing and sealing the
record (close) and checking the seal (verify). No Ray: an auditor runs `verify` and `close` on
a laptop, and the import-linter contract in pyproject.toml keeps it so."""
