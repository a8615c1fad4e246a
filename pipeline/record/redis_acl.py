"""The head's Redis users: who may change which part of a run's live state.

`default` is off: nothing on the cluster's network talks to Redis without a password. `cn` (the
driver, the signer and mailer actors, the operator's commands on the head) may do anything; its
password is the secret's `redis_password`. `render` is for the render and split tasks, which
run on the spot nodes that parse untrusted dumps and cannot read the secret: its password is
derived from the secret's (credentials.render_redis_password) and reaches them with their tasks.
It may write account records and reserve note numbers, and add a mail guard, but never remove
or expire one, nor touch a run's meta, epoch or lease, nor run an admin command: a render node
cannot make a note go out twice. `python -m pipeline redis-acl` prints the file for `aclfile`.
"""

from __future__ import annotations

import hashlib

RENDER_COMMANDS = "+ping +client|setname +script|load +evalsha +eval"  # Redis 7.0: no CLIENT SETINFO
RECORD_KEYS = ("accounts", "counts", "failed", "unconfirmed")  # records.py's script and reads


def acl_file(password: str, render_password: str) -> str:
    records = " ".join(f"~cn:run:*:{k}" for k in RECORD_KEYS)
    return "\n".join([
        "user default off resetkeys resetchannels -@all",
        f"user cn on #{_sha256(password)} ~* &* +@all",
        f"user render on #{_sha256(render_password)} resetchannels -@all {RENDER_COMMANDS} "
        f"+hget +hmget +hset +hincrby +zadd +zrem +expire {records} "
        "(~cn:noteseq:* +evalsha +eval +script|load +get +set +incrby +del +pexpire) "  # the sequence, its lock, its blocks
        "(~cn:run:*:mailguard +hmget +hsetnx)",  # a restored guard: added, never taken away
        ""])


def _sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()
