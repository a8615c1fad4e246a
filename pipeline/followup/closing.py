"""close's first write: a signed warrant that the run's close has begun, and from where.

A close writes many objects (the report, a closing object in every chain, the proof). One that
stops between its first write and its proof would leave a record that reads exactly as one whose
proof was removed. So before anything else, close writes reports/{run}.closing.json: the run's
`closed_at` and each chain's head as the close found it (its number and SHA-256: the chain's
links fix everything before it), signed like the proof. `verify` then reads a record with a
closing object but no proof as "close began, not sealed" (exit 3) when it matches the warrant,
and the next close finishes it; whatever does not match (an object before a head changed, a
mail logged after close began, a warrant not signed by the run's key) is named, as before.
"""

from __future__ import annotations

import json
from typing import Callable

from pipeline.record import delivery_log
from pipeline.record.keys import closing_keys
from pipeline.record.storage import StorageError, Store


def begin(store: Store, run_id: str, links: dict[int, delivery_log.Link | None], closed_at: float,
          sign: Callable[[bytes], bytes], tsa: str = "") -> dict:
    """The run's warrant: written (and signed by `sign`, which returns its detached signature)
    now, from each shard's chain end as close read it (`links`), and the timestamp authority the
    seal asks (`tsa`, "" none), or the one an earlier close that stopped wrote."""
    key, sig_key = closing_keys(run_id)
    if not store.exists(key):
        warrant = {"run_id": run_id, "closed_at": closed_at, "tsa": tsa,
                   "heads": {str(s): [link.seq, link.sha256] if link else [0, ""] for s, link in links.items()}}
        store.put_new(key, as_json(warrant))  # lost to another close: theirs
    data = store.get(key)
    warrant = parse(data, run_id)
    if warrant is None:
        raise StorageError(f"{store.url}: {key} is not a warrant close could have written")
    if not store.exists(sig_key):
        store.put_new(sig_key, sign(data))
    return warrant


def as_json(value: dict) -> bytes:
    """A warrant or proof as close writes it: one value a line, keys sorted, encoded a piece at a
    time (json.dumps with an indent holds every piece at once: a 1.5M day's proof has 45,000
    hashes, each three pieces)."""
    data = bytearray()
    for piece in json.JSONEncoder(indent=0, sort_keys=True).iterencode(value):
        data += piece.encode()
    return bytes(data)


def parse(data: bytes, run_id: str) -> dict | None:
    """The warrant in exactly the shape `begin` writes, or None."""
    try:
        warrant = json.loads(data)
        heads = warrant["heads"]
        if warrant["run_id"] != run_id or not isinstance(warrant["closed_at"], (int, float)) or \
                not isinstance(warrant.get("tsa", ""), str) or not all(
                s.isdigit() and isinstance(n, int) and n >= 0 and isinstance(sha, str) for s, (n, sha) in heads.items()):
            return None
        return {**warrant, "heads": {int(s): (n, sha) for s, (n, sha) in heads.items()}}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
