"""The delivery log: what each mailing of a shard did, and what came of it, kept in storage
beside the signed archive as a chain no one can quietly edit.

A shard's log is a numbered series of write-once objects under the shard's fixed partition
prefix. A mailing adds two: before the first mail of the batch is claimed, every account
about to be tried as "sending"; once the replies are in, each account's outcome (Message-ID,
relay reply, time, attempts, envelope sender), and "not_sent" for each whose claim was
refused. A mailing's entries carry the SHA-256 of the note it attaches (`sha256`), which
`verify` holds the archive to (followup/notes_check.py). Reconciling, a bounce and a client's fetch of their note each add one of their own.

Each object's first line names its run, shard and number and carries the SHA-256 of the
object before it (a chain, as a Git commit names its parent): an object changed, removed or
put out of order breaks the link after it, and `close` signs the heads (followup/close.py).
An object is created with a conditional write (S3's If-None-Match), so two writers that
meet at the end of a chain never fork it: the second takes the next number.

Redis is live state; this is the record. When Redis has lost a run, the mail guard and the
account stages are rebuilt from it before anything is mailed again. For each account the
mail entry with the latest time wins, a delivery over anything after it; a mailing refused
at its claim (`not_sent`) counts for nothing; a "sending" left behind by a mailing that died
means the mail may have left: unconfirmed, never resent blindly.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Container, Iterable, Iterator

from pipeline.record import keys
from pipeline.record.storage import StorageError, Store, write_once

if TYPE_CHECKING:  # not imported at run time: Redis's client is 9 MB more in each of close's and verify's processes
    from pipeline.record.records import Outcome

MAIL_STATUSES = ("sending", "delivered", "unconfirmed", "failed", "not_sent")
AFTER_SEAL = ("fetched", "refused_after_close")  # all that may follow a run's seal (followup/close.py)
# all a chain may gain between close's warrant and the seal (followup/closing.py): the closing object, a
# bounce that came in meanwhile, a client's fetch
AFTER_WARRANT = ("closed", "bounced", "deferred") + AFTER_SEAL
# all that may follow a chain's closing object before the seal: no bounce reader writes beside a close
# (followup/bounces.py), and a close stopped, then run again, may close a chain again
AFTER_CLOSING = ("closed",) + AFTER_SEAL
STATUSES = MAIL_STATUSES + ("bounced", "deferred", "closed") + AFTER_SEAL
GENESIS = "0" * 64  # the `prev` of a chain's first object
CHAINED = re.compile(r"/[0-9]{8}\.jsonl\Z")
SHARD_DIR = re.compile(r"shard-([0-9]+)/")
_SCAN = json.JSONDecoder().scan_once  # json.loads without its Python around it: half the time of a line


@dataclass(frozen=True)
class Link:
    """Where a shard's chain ends: its last object's key, number and SHA-256."""

    key: str
    seq: int
    sha256: str


def object_key(run_id: str, shard: int, seq: int) -> str:
    return f"{keys.delivery_log_prefix(run_id, shard)}{seq:08d}.jsonl"


def seq_of(key: str) -> int:
    """The number a chained object's name gives it (object_key)."""
    return int(key.rsplit("/", 1)[1][:8])


def sending(ucc: str, message_id: str, mail_from: str = "", sha256: str = "", md5: str = "") -> dict:
    """An account about to be mailed; `sha256` and `md5`, of the exact bytes it attaches (hex):
    the MD5 is what an S3 listing gives of each archived note (its ETag), so verify checks
    the archive without reading it, and reads a note only where the two disagree."""
    e = {"ucc": ucc, "status": "sending", "message_id": message_id, "at": time.time()}
    return e | ({"mail_from": mail_from} if mail_from else {}) | ({"sha256": sha256} if sha256 else {}) | (
        {"md5": md5} if md5 else {})


def not_sent(ucc: str, why: str, sending_at: float | None = None) -> dict:
    """Settles a "sending" whose claim was refused (Redis lost the run, or another driver holds
    it): nothing left, and the resumed run mails it as if this mailing had never tried.
    `sending_at`: that sending's time, which names it among the account's other mailings."""
    return {"ucc": ucc, "status": "not_sent", "reason": why[:300], "at": time.time()} | (
        {"sending_at": sending_at} if sending_at is not None else {})


def entry(o: Outcome, mail_from: str = "", sha256: str = "") -> dict:
    """A mail outcome as the log keeps it; a mail skipped because an earlier attempt
    delivered it is logged as delivered again (that attempt may have died before logging).
    `sha256`: of the attachment this mailing carried (hex), which `verify` holds the archive to."""
    status = {"ok": "delivered", "skipped": "delivered"}.get(o.status, o.status)
    e = {"ucc": o.ucc, "status": status, "message_id": o.message_id, "reply": o.reply, "reason": o.reason,
         "at": time.time(), "attempts": o.extra.get("attempts", 0)}
    if o.extra.get("possible_duplicate"):
        e["possible_duplicate"] = True
    if mail_from:
        e["mail_from"] = mail_from
    if sha256:
        e["sha256"] = sha256
    return e


def append(store: Store, run_id: str, shard: int, entries: Iterable[dict], after: Link | None = None) -> Link:
    """Adds one object to the end of the shard's chain and returns the new end. `after`, the
    end this writer last saw (or another process handed on: known_end), saves a listing; the
    end this process last wrote, if later; else the chain's first object is tried (a fresh run's shards: one PUT, no listing and no
    read). When another writer got there first, the chain is read again and the object takes
    the next number. A PUT sent again after its reply was lost finds the key taken by itself:
    written once, not again at the next number."""
    body = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries)
    chain = (store.url, run_id, shard)
    known = [end for end in (after, _ends.get(chain)) if end is not None]  # the later of the two: both were ends
    guess = max(known, key=lambda end: end.seq) if known else _FIRST  # no listing where the end is known, or none is written
    for _ in range(20):
        end = guess if guess is not None else head(store, run_id, shard)
        seq, prev = (end.seq + 1, end.sha256) if end else (1, GENESIS)
        header = json.dumps({"chain": 1, "run": run_id, "shard": shard, "seq": seq, "prev": prev},
                            separators=(",", ":"))
        data = (header + "\n" + body).encode()
        key = object_key(run_id, shard, seq)
        if write_once(store, key, data) == data:  # made now, or by this very object whose reply was lost
            _ends[chain] = link = Link(key, seq, hashlib.sha256(data).hexdigest())
            if len(_ends) > KNOWN_ENDS:  # the oldest forgotten: a long-lived process's memory stays flat
                _ends.pop(next(iter(_ends)), None)
            return link
        guess = None  # another writer got there first (or a guess was wrong): the chain is listed
    raise StorageError(f"{store.url}: could not add to the delivery log of run {run_id} shard {shard}: "
                       "20 writers got there first")


def known_end(store_url: str, run_id: str, shard: int) -> Link | None:
    """Where this process last wrote the shard's chain to, if it did: a hint. The driver hands
    it on with the shard's batch; when its first notes were mailed before the shard's chain was
    launched (their chain's first objects), the shard's next mailing writes the next object at
    once, where it found the first taken and paid a refused PUT, a listing and two reads. A hint
    behind the chain costs what no hint does: the create-only PUT is refused and the chain read."""
    return _ends.get((store_url, run_id, shard))


_FIRST = Link("", 0, GENESIS)  # the end of a chain with no object yet, as a guess: seq 1 after it, linked to GENESIS
_ends: dict[tuple[str, str, int], Link] = {}  # (store, run, shard) -> the end this process last wrote
KNOWN_ENDS = 4096


def chain_keys(store: Store, run_id: str, shard: int) -> list[str]:
    """The shard's chained objects, in order. Objects a run wrote before the log was chained
    (named by time) are read as entries, never chained to."""
    return [k for k in store.keys(keys.delivery_log_prefix(run_id, shard)) if CHAINED.search(k)]


def run_chain_keys(store: Store, run_id: str) -> dict[int, list[str]]:
    """Every shard's chained objects, in order, as chain_keys gives them, from one listing of
    each of the run's PARTITIONS log prefixes: on S3 a request per 1,000 keys, where a listing a
    shard cost a request each (15,000 at 1.5M accounts)."""
    found: dict[int, list[str]] = {}
    for partition in range(keys.PARTITIONS):
        base = f"{partition}-delivery-log/{run_id}/"
        for key in store.keys(base):
            shard = SHARD_DIR.match(key, len(base))
            if shard and CHAINED.search(key) and key.startswith(keys.delivery_log_prefix(run_id, int(shard[1]))):
                found.setdefault(int(shard[1]), []).append(key)
    return found


def head(store: Store, run_id: str, shard: int) -> Link | None:
    """The last object of the shard's chain, or None for an empty log."""
    found = chain_keys(store, run_id, shard)
    if not found:
        return None
    last = found[-1]
    data = store.get(last)
    return Link(last, chain_header(store, last, data)["seq"], hashlib.sha256(data).hexdigest())


def chain_header(store: Store, key: str, data: bytes) -> dict:
    """An object's first line: run, shard, number and the SHA-256 of the object before it."""
    try:
        header = json.loads(data.split(b"\n", 1)[0])
        ok = isinstance(header, dict) and header.get("chain") == 1 and isinstance(header.get("seq"), int) \
            and isinstance(header.get("prev"), str)
    except ValueError:
        ok = False
    if not ok:
        raise StorageError(f"{store.url}: object {key!r} has no chain header (edited, or not a delivery-log object)")
    return header


def entries(store: Store, run_id: str, shard: int | None = None) -> Iterator[dict]:
    """Every entry of a shard's mailings (or of the whole run), oldest mailing first."""
    prefixes = ([keys.delivery_log_prefix(run_id, shard)] if shard is not None else
                [f"{p}-delivery-log/{run_id}/" for p in range(keys.PARTITIONS)])
    for prefix in prefixes:
        for key in store.keys(prefix):
            yield from parse(store, key, store.lines(key))  # streamed: an object is never held whole


def scan(store: Store, run_id: str, shard: int, statuses: tuple[str, ...]) -> tuple[list[dict], Link | None]:
    """The shard's entries of these statuses, and where its chain ends (for `append`'s `after`:
    one listing for both). An object, then a line, is parsed only if it names one of them
    (entries are written without spaces): looking for a shard's bounces skips the JSON of its
    mailings, ten to a hundred times as many lines."""
    wanted, found, last = tuple(f'"status":"{s}"' for s in statuses), [], None
    for key in store.keys(keys.delivery_log_prefix(run_id, shard)):
        data = store.get(key)
        if CHAINED.search(key):
            last = (key, data)
        if any(w.encode() in data for w in wanted):
            found += [e for n, line in enumerate(data.decode("utf-8", "surrogateescape").splitlines(), 1)
                      if any(w in line for w in wanted) and (e := _entry(store, key, n, line))["status"] in statuses]
    end = Link(last[0], chain_header(store, *last)["seq"], hashlib.sha256(last[1]).hexdigest()) if last else None
    return found, end


def parse(store: Store, key: str, lines: Iterable[str]) -> Iterator[dict]:
    """An object's entries, each checked (its chain header skipped)."""
    for n, line in enumerate(lines, 1):
        if line.strip() and not (n == 1 and line.startswith('{"chain"')):
            yield _entry(store, key, n, line)


def _entry(store: Store, key: str, n: int, line: str) -> dict:
    """One line's entry, checked. verify parses every line of a day's log, 3M at 1.5M accounts:
    a line the scanner takes whole, as entries are written, is what json.loads would give;
    anything else is judged by json.loads itself."""
    try:
        try:
            e, end = _SCAN(line, 0)
        except StopIteration:
            end = -1
        if end != len(line):
            e = json.loads(line)
        ok = isinstance(e, dict) and isinstance(e["ucc"], str) and e["status"] in STATUSES and float(e["at"]) >= 0
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:  # the record was edited or cut short: say where, and trust none of it
        raise StorageError(f"{store.url}: object {key!r} line {n}: not a delivery-log entry (truncated or edited?)")
    return e


def latest(log: Iterable[dict], accounts: Container[str] | None = None) -> dict[str, dict]:
    """Each account's latest mail entry (by time, a later line winning a tie; its latest
    delivery if it has one), of `accounts` only when given: one shard's log is held (a few
    entries an account). What came after the mail (a bounce, a fetch) is not a mailing:
    followup/bounces.py and restore.py read those. A "not_sent" is no mailing, and neither is
    the "sending" it settles (its claim was refused: nothing left), so what the log said of the
    account before that mailing stands. An account with no other entry is absent."""
    mails: dict[str, list[dict]] = {}
    for e in log:
        if e["status"] in MAIL_STATUSES and (accounts is None or e["ucc"] in accounts):
            mails.setdefault(e["ucc"], []).append(e)
    return {ucc: last for ucc, entries in mails.items() if (last := _last_mailing(entries)) is not None}


def _last_mailing(entries: list[dict]) -> dict | None:
    """The latest (by time) of one account's entries that a "not_sent" does not settle, its
    latest delivery if it has one (a mail once delivered stays delivered, as final_statuses
    and the report say, whatever a later mailing did). A not_sent names its sending by time
    (`sending_at`). One written before that field settles a sending only when one alone is
    open (an outcome closes the latest open one); with more, it settles none: a sending that
    stays is read as unconfirmed, guarded."""
    settled: set[int] = set()
    unsettled: list[int] = []  # sendings, in the log's order, with nothing after them yet
    for i, e in enumerate(entries):
        if e["status"] == "sending":
            unsettled.append(i)
        elif e["status"] != "not_sent":
            if unsettled:
                unsettled.pop()
        elif "sending_at" in e:
            settled.update(j for j, s in enumerate(entries) if s["status"] == "sending" and s["at"] == e["sending_at"])
            unsettled = [j for j in unsettled if j not in settled]
        elif len(unsettled) == 1:
            settled.add(unsettled.pop())
    kept = [(e["status"] == "delivered", e["at"], i) for i, e in enumerate(entries)
            if e["status"] != "not_sent" and i not in settled]
    return entries[max(kept)[2]] if kept else None


def final_statuses(log: Iterable[dict], closed: bool) -> dict[str, str]:
    """Each mailed account's final status, from its shard's log alone, as the report states it
    (report.csv_chunks over records.final_status): a mail once delivered stays delivered, else
    the latest mailing decides; a bounce counts on a delivered mail (a permanent one over a
    delay); once closed, a delay is delivered. An account with no mailing here (never mailed,
    or refused at the claim) is absent."""
    log, bounces = list(log), {}  # a shard's log: held once, for latest() too
    for e in log:
        if e["status"] in ("bounced", "deferred") and bounces.get(e["ucc"]) != "bounced":
            bounces[e["ucc"]] = e["status"]
    found = {}
    for ucc, e in latest(log).items():  # a delivery, if the account has one
        status = {"sending": "unconfirmed"}.get(e["status"], e["status"])
        if status == "delivered":
            status = bounces.get(ucc, "delivered")
            status = "delivered" if closed and status == "deferred" else status
        found[ucc] = status
    return found
