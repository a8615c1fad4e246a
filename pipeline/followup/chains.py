"""One shard's delivery-log chain, read whole: walked link by link for `verify`, read and ended
with a closing object for `close`. The functions a process of record/spread.py runs on a slice of
shards: they import the record alone, not the seal.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from pipeline.record import delivery_log
from pipeline.record.storage import NoObject, NotAsWritten, StorageError, Store


@dataclass(slots=True)
class Read:
    """One shard's chain as close read it: its last key, not every key (a 1.5M day's close holds
    15,000 of these until the seal)."""

    last: str  # "" for a chain with no object
    hashes: list[str]  # each object's SHA-256
    closed: bool  # its last object is a closing object (a close that stopped half-way wrote it)
    problem: str = ""  # the first object out of its chain (walk's words): never sealed over

    @property
    def end(self) -> delivery_log.Link | None:
        return delivery_log.Link(self.last, len(self.hashes), self.hashes[-1]) if self.hashes else None


def read(store: Store, run_id: str, shard: int, found: list[str]) -> Read:
    """`found`: the chain's keys, as listed. Each object's number, header and link checked as
    `walk` checks them, on the bytes read for the seal: a seal over an edited object would make
    the record read as tampered for good."""
    data = [store.get(k) for k in found]
    hashes = [hashlib.sha256(d).hexdigest() for d in data]
    problem = next((p for i in range(len(found)) if (p := _unlinked(store, run_id, shard, found, i, data[i],
                                                                  hashes[i - 1] if i else delivery_log.GENESIS))), "")
    closed = bool(found) and any(e["status"] == "closed" for e in delivery_log.parse(
        store, found[-1], data[-1].decode("utf-8", "surrogateescape").splitlines()))
    return Read(found[-1] if found else "", hashes, closed, problem)


def close(store: Store, run_id: str, shard: int, chain: Read, closed_at: float) -> tuple[str, list[str]]:
    """The chain ended with a closing object, unless it has one: its last key and every object's SHA-256."""
    if chain.closed:
        return chain.last, chain.hashes
    added = delivery_log.append(store, run_id, shard, [{"ucc": "", "status": "closed", "at": closed_at}], chain.end)
    if added.seq != len(chain.hashes) + 1:  # another writer (a client's fetch) got there first: read the chain again
        return close(store, run_id, shard, read(store, run_id, shard, delivery_log.chain_keys(store, run_id, shard)),
                     closed_at)
    return added.key, chain.hashes + [added.sha256]


@dataclass
class Chain:
    """One shard's chain as verify found it walking it."""

    shard: int
    objects: int = 0
    after_seal: int = 0
    problem: str = ""
    closed: bool = False  # it holds a closing object
    statuses: dict[str, str] = field(default_factory=dict)  # from the log alone
    where: dict[str, str] = field(default_factory=dict)  # ucc -> the object of its last entry


def walk(store: Store, run_id: str, shard: int, sealed: list[str] | None, closed: bool,
         begun: tuple[int, str] | None, found: list[str]) -> Chain:
    """One shard's chain, from its first object (`found`: its keys, as listed); `sealed`: the
    SHA-256 the seal recorded for each object (None: the run is not sealed); `begun`: the head
    (number, SHA-256) close's warrant recorded, when a close began and has not sealed."""
    chain = Chain(shard)
    prev_sha, entries, unreadable = delivery_log.GENESIS, [], ""
    for i, key in enumerate(found):
        n = i + 1
        if gap := _gap(run_id, shard, found, i):  # named further on than its place: not read
            chain.problem = gap
            return chain
        try:
            data = store.get(key)
        except NotAsWritten as e:
            chain.problem = e.problem
            return chain
        sha = hashlib.sha256(data).hexdigest()
        chain.objects = n
        if sealed is not None and n <= len(sealed) and sha != sealed[i]:
            chain.problem = f"{key}: changed (not the object the seal recorded)"
            return chain
        if begun and n == begun[0] and sha != begun[1]:
            chain.problem = f"{key}: changed (not the object close's warrant recorded)"
            return chain
        chain.problem = _unlinked(store, run_id, shard, found, i, data, prev_sha)
        if chain.problem:
            return chain
        prev_sha = sha
        try:
            lines = list(delivery_log.parse(store, key, data.decode("utf-8", "surrogateescape").splitlines()))
        except StorageError as e:
            unreadable = unreadable or str(e)
            continue
        after = sealed is not None and n > len(sealed)
        chain.after_seal += after
        for e in lines:
            if after and e["status"] not in delivery_log.AFTER_SEAL:
                chain.problem = (f"{key}: a {e['status']!r} entry after the seal (only a client's fetch or a bounce "
                                 "refused after close may follow it)")
                return chain
            if begun and n > begun[0] and e["status"] not in delivery_log.AFTER_WARRANT:
                chain.problem = f"{key}: a {e['status']!r} entry after close began (its warrant's head is object " \
                                f"{begun[0]})"
                return chain
            if sealed is None and chain.closed and e["status"] not in delivery_log.AFTER_CLOSING:
                chain.problem = (f"{key}: a {e['status']!r} entry after the chain's closing object (only a client's "
                                 "fetch or a bounce refused after close may follow it)")
                return chain
            chain.closed |= e["status"] == "closed"
            chain.where[e["ucc"]] = key
        entries += lines
    if begun and len(found) < begun[0]:
        chain.problem = f"{delivery_log.object_key(run_id, shard, begun[0])}: removed (close's warrant recorded " \
                        f"{begun[0]} objects of shard {shard}, {len(found)} remain)"
        return chain
    if sealed is not None and len(found) < len(sealed):
        chain.problem = f"{delivery_log.object_key(run_id, shard, len(sealed))}: removed (the seal recorded " \
                        f"{len(sealed)} objects of shard {shard}, {len(found)} remain)"
        return chain
    chain.problem = unreadable
    chain.statuses = delivery_log.final_statuses(entries, closed) if sealed is not None else {}
    return chain


def _unlinked(store: Store, run_id: str, shard: int, found: list[str], i: int, data: bytes, prev_sha: str) -> str:
    """Why object `i` of the chain `found` (its bytes `data`) is out of its chain: its number
    further on than its place (those before it removed), its header gone or another chain's, or
    its link not to the object before (`prev_sha`); "" where it is in place."""
    key, n, prev_key = found[i], i + 1, found[i - 1] if i else ""
    if gap := _gap(run_id, shard, found, i):
        return gap
    try:
        header = delivery_log.chain_header(store, key, data)
    except StorageError:
        return f"{key}: changed (its chain header is gone)"
    if header["run"] != run_id or header["shard"] != shard or key != delivery_log.object_key(run_id, shard, n):
        return _misplaced(run_id, shard, n, key, header, prev_key)
    if header["prev"] != prev_sha:  # this object or the one before was changed: the next link tells which
        if not prev_key or _links_elsewhere(store, found[i + 1:], hashlib.sha256(data).hexdigest()):
            return f"{key}: changed (its link to {prev_key or 'the start'} was edited)"
        return f"{prev_key}: changed (the next object, {key}, links to another)"
    return ""


def _gap(run_id: str, shard: int, found: list[str], i: int) -> str:
    """Object `i` named further on than its place: those before it are gone, whatever the seal says."""
    if delivery_log.seq_of(found[i]) <= i + 1:
        return ""
    return f"{delivery_log.object_key(run_id, shard, i + 1)}: removed (the chain goes from " \
           f"{found[i - 1] if i else 'its start'} to {found[i]})"


def _misplaced(run_id: str, shard: int, n: int, key: str, header: dict, prev_key: str) -> str:
    return f"{key}: out of place (it says run {header['run']} shard {header['shard']} number {header['seq']}; " \
           f"number {n} of shard {shard} belongs here)"


def _links_elsewhere(store: Store, rest: list[str], sha: str) -> bool:
    """Whether what comes after this object no longer links to it as it is."""
    if not rest:
        return False
    try:
        data = store.get(rest[0])
    except (NoObject, NotAsWritten):
        return True
    try:
        return delivery_log.chain_header(store, rest[0], data)["prev"] != sha
    except StorageError:  # it has no chain header
        return True
