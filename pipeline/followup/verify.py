"""`verify RUN_ID`: what a run's record proves, checked from storage alone.

Every shard's chain is walked from its first object: each object's number and link, and for a
sealed run each object's SHA-256 against the one the seal recorded, so the first object
changed is named even when every later link was forged to match. After the seal only a
client's fetch or a bounce refused after close may follow. The signer of the proof must be the
certificate the run recorded when it started (or the one an auditor brings, `--cert`); a
timestamp, where the run was sealed with one, must be over this proof. A run whose chains or
report say it was closed must have its proof, or (a close that stopped before it) close's signed
warrant (followup/closing.py) that the record still matches. Then every account's final status is worked out
from the log alone and compared with the sealed report and paper list.

A seal part-written (its proof without its signature, or a signed proof without the timestamp
it names a TSA for: seal_state.py) is a close that began: its objects are checked as a sealed
run's are, and what is missing is said with what the next close does, never called removed.

Exit status of the command: 0 sealed and whole; 1 a problem, the first one named; 3 not
sealed: consistent so far, not yet proof (or a close began and must be run again to seal it).
"""

from __future__ import annotations

import csv
import json
import operator
import sqlite3
import tempfile
from typing import Iterator

from pipeline.errors import RunNotFound
from pipeline.followup import chains, closing, notes_check
from pipeline.followup.seal_state import BEGAN, SEALED, SealState, seal_state
from pipeline.record import delivery_log, keys, report, spread
from pipeline.record.keys import closing_keys, proof_keys, timestamp_key
from pipeline.record.manifest import load_manifest
from pipeline.record.storage import Garbled, Store, sha256
from pipeline.seal import detached, timestamp
from pipeline.seal.signer import SignError

MAILED = ("delivered", "bounced", "deferred", "unconfirmed")  # a report status that only a mailing can give


def verify(store: Store, run_id: str, cert_pem: bytes | None = None, tsa_cert_pem: bytes | None = None) -> dict:
    try:
        return _verified(store, run_id, cert_pem, tsa_cert_pem)
    except Garbled as e:  # read whole: an object of the record changed (exit 1), never exit 2
        return _unread(run_id, e.problem)  # the run's manifest or seal: what it says of the run is not known


def _unread(run_id: str, problem: str) -> dict:
    return {"run_id": run_id, "sealed": False, "signed_by": "", "timestamp": {}, "shards": None, "log_objects": None,
            "added_after_seal": None, "ok": False, "summary": f"run {run_id}: {problem}", "first_problem": problem,
            "problems": [problem]}


def _verified(store: Store, run_id: str, cert_pem: bytes | None, tsa_cert_pem: bytes | None) -> dict:
    split = load_manifest(store, run_id)
    if split is None:  # a run's first object: with its report or seal there, it was removed (exit 1), not never made
        if left := [k for k in (keys.report_keys(run_id)[0], proof_keys(run_id)[0], closing_keys(run_id)[0])
                    if store.exists(k)]:
            return _unread(run_id, f"{keys.manifest_key(run_id)}: removed ({', '.join(left)} remain)")
        raise RunNotFound(f"no run {run_id!r} in {store.url}")
    problems = []
    try:
        run_report = report.of_run(store, run_id) or {}
    except Garbled as e:  # the rest is checked as for a run with no report
        run_report = {}
        problems.append(e.problem)
    seal = seal_state(store, run_id)
    proof, has_proof = _proof(store, run_id, problems), seal.proof
    signer, stamped = "", {}
    if proof is not None and seal.signed:  # one not yet signed or timestamped: a close began (seal_state.py)
        signer = _signer(store, proof_keys(run_id), proof["data"], cert_pem, run_report, problems)
    if proof is not None and seal.stamped:
        stamped = _timestamp(store, run_id, proof, tsa_cert_pem, problems)
    warrant = _warrant(store, run_id, cert_pem, run_report, problems) if not has_proof else None
    closed = has_proof or bool((run_report.get("bounce_window") or {}).get("closed_at"))
    objects = after_seal = was_closed = 0
    with tempfile.TemporaryDirectory() as tmp:
        db = _scratch(f"{tmp}/statuses.db")  # each account's status from the log: on disk, not in memory
        db.execute("CREATE TABLE log (ucc TEXT, status TEXT, key TEXT)")
        for c in _chains(store, run_id, split.shards, proof["objects"] if proof else None, closed,
                         warrant["heads"] if warrant else {}):
            objects, after_seal, was_closed = objects + c.objects, after_seal + c.after_seal, was_closed + c.closed
            problems += [c.problem] if c.problem else []
            db.executemany("INSERT INTO log VALUES (?, ?, ?)",
                           ((u, st, c.where.get(u, "")) for u, st in c.statuses.items()))
        if not has_proof and (was_closed or closed) and warrant is None:
            evidence = f"{was_closed} chains hold a closing object" if was_closed else "its report says closed_at"
            problems.insert(0, f"{proof_keys(run_id)[0]}: removed (the run was closed: {evidence})")
        elif not has_proof and warrant and problems:  # the record changed since its close began: never sealed now
            problems.append(f"{proof_keys(run_id)[0]}: not there (close began {report.iso(warrant['closed_at'])}, and "
                            "the record no longer matches its warrant)")
        if proof is not None:
            for key, sha in proof["reports"].items():
                if not store.exists(key) or sha256(store, key) != sha:
                    problems.append(f"{key}: changed or removed after the seal")
            if not problems:
                problems += _disagreements(db, store, run_id)
        db.close()
    problems += notes_check.first_difference(store, run_id, run_report.get("trade_date", ""), split.shards)
    ok, sealed = not problems, seal.state == SEALED
    summary = f"run {run_id}: " + (problems[0] if problems else "sealed: whole" if sealed else
                                   f"not sealed: {_begun(seal, proof, warrant)}" if seal.state == BEGAN else
                                   "not sealed: consistent so far, not yet proof")
    return {"run_id": run_id, "sealed": sealed, "signed_by": signer, "timestamp": stamped,
            "shards": len(split.shards), "log_objects": objects, "added_after_seal": after_seal, "ok": ok,
            "summary": summary,
            "first_problem": problems[0] if problems else None, "problems": problems[:100]}


def exit_status(result: dict) -> int:
    return 1 if not result["ok"] else 0 if result["sealed"] else 3


def _begun(seal: SealState, proof: dict | None, warrant: dict | None) -> str:
    """A close that began and stopped, in words: how far it got and what the next close does.
    `proof` as written, `warrant` when signed (else None)."""
    when = proof["closed_at"] if proof else report.iso(warrant["closed_at"]) if warrant else ""
    began = f"close began ({when})" if when else "close began"
    if seal.proof:
        return f"{began} and wrote its proof, not yet its {' and '.join(seal.missing())}: run close again: it makes " \
               "them over the proof as written, and the run is sealed"
    if warrant:
        return f"{began} and stopped before its proof: run close again to seal it"
    return f"{began} and stopped before its warrant was signed: run close again to seal it"


def _proof(store: Store, run_id: str, problems: list[str]) -> dict | None:
    """The proof as the seal wrote it, or None. One that is no longer a proof is a changed
    object of the record (exit 1), not a command that could not run: a script that retries on
    2 must not pass over a tampered seal."""
    key = proof_keys(run_id)[0]
    if not store.exists(key):
        return None
    data = store.get(key)
    try:
        proof = json.loads(data)
        if not _as_sealed(proof, run_id):
            raise TypeError
        return {**proof, "objects": {int(s): h for s, h in proof["objects"].items()}, "data": data}
    except (ValueError, KeyError, TypeError, AttributeError):
        problems.append(f"{key}: changed (it is no longer a proof the seal could have written)")
        return None


def _as_sealed(proof, run_id: str) -> bool:
    """Whether the proof has exactly the shape close.seal writes: anything else is "changed",
    never a crash or a path outside the run's reports."""
    json_key, csv_key = keys.report_keys(run_id)
    objects, reports, heads = proof.get("objects"), proof.get("reports"), proof.get("heads")
    return (isinstance(objects, dict) and isinstance(reports, dict) and isinstance(heads, list)
            and proof.get("run_id") == run_id
            and all(isinstance(s, str) and s.isdigit() and isinstance(h, list) and all(map(_is_sha, h))
                    for s, h in objects.items())
            and set(reports) == {json_key, csv_key, report.paper_key(run_id)} and all(map(_is_sha, reports.values())))


def _is_sha(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def signed_warrant(store: Store, run_id: str) -> dict | None:
    """close's warrant, whole and signed by the run's recorded key, or None: what an unsigned
    proof must agree with before a close signs it."""
    return _warrant(store, run_id, None, report.of_run(store, run_id) or {}, [])


def _warrant(store: Store, run_id: str, cert_pem: bytes | None, run_report: dict, problems: list[str]) -> dict | None:
    """close's warrant, when a close began and wrote it whole and signed by the run's key."""
    key, sig_key = closing_keys(run_id)
    if not store.exists(key) or not store.exists(sig_key):
        return None
    data = store.get(key)
    warrant = closing.parse(data, run_id)
    if warrant is None:
        problems.append(f"{key}: changed (it is no longer a warrant close could have written)")
        return None
    before = len(problems)
    _signer(store, (key, sig_key), data, cert_pem, run_report, problems)
    return warrant if len(problems) == before else None


def _signer(store: Store, signed: tuple[str, str], data: bytes, cert_pem: bytes | None, run_report: dict,
            problems: list[str]) -> str:
    """Who signed the proof (or the warrant: `signed` names the object and its signature); a
    problem unless it is the certificate given, else the one the run recorded when it started
    (a proof signed again with a key of one's own is not the broker's)."""
    proof_key, sig_key = signed
    try:
        signer = detached.check(data, store.get(sig_key) if store.exists(sig_key) else b"")
    except SignError as e:
        problems.append(f"{proof_key}: signature {sig_key}: {e}")
        return ""
    expected = detached.fingerprint(cert_pem) if cert_pem else run_report.get("signer_cert_sha256", "")
    whose = "the certificate given (--cert)" if cert_pem else "the run's signing certificate (its report)"
    if not expected:
        problems.append(f"{sig_key}: the run recorded no signing certificate: give the broker's with --cert")
    elif not signer.endswith(expected):
        problems.append(f"{sig_key}: signed by {signer}, not by {whose}")
    return signer


def _timestamp(store: Store, run_id: str, proof: dict, tsa_cert_pem: bytes | None, problems: list[str]) -> dict:
    key = timestamp_key(run_id)
    try:
        return timestamp.check(store.get(key), proof["data"], tsa_cert_pem)
    except SignError as e:
        problems.append(f"{key}: {e}")
        return {}


def _chains(store: Store, run_id: str, shards: list[int], sealed: dict | None, closed: bool,
            begun: dict[int, tuple[int, str]]) -> Iterator[chains.Chain]:
    """Each shard's Chain, in order, read a slice of shards at a time (record/spread.py): memory
    follows the slices, and the run's listing (its objects' keys), not the day's entries."""
    listed = delivery_log.run_chain_keys(store, run_id)
    jobs = ((run_id, s, None if sealed is None else sealed.get(s, []), closed, begun.get(s) if begun else None,
             listed.get(s, [])) for s in sorted(shards))
    return spread.each(chains.walk, store, jobs, len(shards))


def _scratch(path: str) -> sqlite3.Connection:
    """A database for one command's comparison, thrown away after: no journal, no syncs. Its
    tables are filled unindexed and indexed once full (_disagreements): 1.5M accounts put into
    a keyed table in the order the shards give them cost three times the appends and one sort."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = OFF")
    db.execute("PRAGMA synchronous = OFF")
    return db


def _disagreements(db: sqlite3.Connection, store: Store, run_id: str) -> list[str]:
    """Where the sealed report or paper list says other than the log (`db`'s table `log`): each
    account's status against every report row of it, a mailed status the log never saw, the paper
    list against the report's dispatch column. The first one, naming account and object."""
    csv_key, paper_key = keys.report_keys(run_id)[1], report.paper_key(run_id)
    db.execute("CREATE TABLE report (ucc TEXT, status TEXT, paper INTEGER)")
    db.execute("CREATE TABLE paper (ucc TEXT)")
    db.executemany("INSERT INTO report VALUES (?, ?, ?)", (
        (ucc, status, paper == "Y") for ucc, status, paper in _rows(store, csv_key, "ucc", "status", "physical_dispatch")))
    db.executemany("INSERT INTO paper VALUES (?)", ((ucc,) for ucc in _rows(store, paper_key, "ucc")))
    for table in ("log", "report", "paper"):
        db.execute(f"CREATE INDEX {table}_ucc ON {table} (ucc)")
    differs = db.execute("SELECT l.ucc, r.status, l.status, l.key FROM log l LEFT JOIN report r USING (ucc) "
                         "WHERE r.status IS NOT l.status ORDER BY l.ucc LIMIT 1").fetchone()
    if differs:
        ucc, said, logged, key = differs
        return [f"{csv_key}: account {ucc} is {said or 'missing'!r} in the report, {logged!r} in the delivery log "
                f"({key})"]
    unlogged = db.execute(f"SELECT ucc, status FROM report WHERE status IN ({','.join('?' * len(MAILED))}) AND ucc "
                          "NOT IN (SELECT ucc FROM log) ORDER BY ucc LIMIT 1", MAILED).fetchone()
    if unlogged:
        return [f"{csv_key}: account {unlogged[0]} is {unlogged[1]!r} in the report, and the delivery log has no "
                "mailing of it"]
    odd = db.execute("SELECT ucc FROM report WHERE paper = 1 AND ucc NOT IN (SELECT ucc FROM paper) UNION "
                     "SELECT ucc FROM paper WHERE ucc NOT IN (SELECT ucc FROM report WHERE paper = 1) "
                     "ORDER BY ucc LIMIT 1").fetchone()
    return [f"{paper_key}: account {odd[0]} is on one of the paper list and the report's dispatch column, "
            "not both"] if odd else []


def _rows(store: Store, key: str, *names: str) -> Iterator:
    """The named columns of each row of a CSV (csv.DictReader made a dict of every row, 1.5M in a
    day's report). A row too short to hold them, or a CSV without one of them, is no row: its
    accounts read as missing from the report."""
    rows = csv.reader(store.lines(key))
    header = next(rows, [])
    at = [header.index(n) if n in header else len(header) for n in names]
    pick, width = operator.itemgetter(*at), max(at) + 1
    return (pick(r) for r in rows if len(r) >= width)
