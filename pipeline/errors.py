"""The error every package's "this command cannot start, or must stop" derives from.

`python -m pipeline` answers each with exit status 2 and one line, `error: ...` (the cause
named: a file and row, a setting, a store, a run). Each concrete error also keeps the builtin
it always was (InputError is a ValueError), so a caller catches one type or a familiar one,
as aiosmtplib's errors do. The lowest layer: it imports nothing.
"""


class CannotRun(Exception):
    """The command cannot start (input, settings, storage, signer, calendar) or must stop
    (the run's state lost, its lease taken, its record sealed)."""


class RunNotFound(CannotRun, LookupError):
    """No run of that id: not in Redis, nor (where the command looks there too) in storage."""


class NotInRun(CannotRun, LookupError):
    """Accounts named to a command that the run does not hold: a typo is never a success."""


class DayTaken(CannotRun, ValueError):
    """A fresh run for a trade date another run has started: its notes are archived under the
    date (and may be mailed), so a second run would mail that run's notes again."""
