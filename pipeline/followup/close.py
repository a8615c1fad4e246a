"""`close RUN_ID`: deemed delivery, and a seal no one can quietly undo, redo or bypass.

The regulation counts an e-mailed note as delivered when no bounce comes back. Once the run's
bounce window (CN_BOUNCE_WINDOW_H after the run's end) has passed, `close` makes every
mailed account without a permanent bounce delivered, final, and seals the record, in order:
  0. reports/{run}.closing.json and .p7s, signed: where the close began (followup/closing.py), so
     a close that stops before its proof reads as begun, never as a proof removed, and the next
     close finishes it;
  1. the report is written closed (its `closed_at`), while
  2. each shard's chain gets a closing object (status "closed"): the fact that the run was
     closed lives in the chain itself, so a proof deleted later is missed by `verify`. Neither
     reads what the other writes, and the warrant covers a close stopped in either;
  3. the seal: reports/{run}.proof.json, the SHA-256 of every object of every chain (so `verify`
     names the first one changed, even when every later link was forged to match), the chain
     heads, and the SHA-256 of the report, its CSV and the paper list; its detached CMS signature
     by the notes' signing key, reports/{run}.proof.p7s (`openssl cms -verify` checks it); and
     with CN_TSA_URL an RFC 3161 timestamp over the proof, reports/{run}.proof.tsr, from a
     time-stamping authority the broker does not run: a seal made later cannot be back-dated.
The seal's three are all had (hashed, signed, timestamped, each checked) before the first is
written, then written in that order, each once (create-only, as the chain is; a PUT refused as
taken is settled by reading the key back: storage.write_once). A signer, TSA or store that fails is
one line naming it; whatever prefix of the writes it leaves reads as a close begun
(seal_state.py), and the next close completes it: from its warrant, or from the proof's bytes as
stored, once the record matches them. A second `close` of a sealed run changes nothing: it
prints the seal there is, or fails naming the object that no longer matches it. A bounce reader
records nothing while a close runs (keys.run_recording, held by close from its first read to its
seal, after waiting for a reader's poll to be recorded): a bounce is logged before the close, or
after it as refused after close, never between the warrant's heads and the seal.
followup/verify.py checks all of it from storage alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator
from urllib.parse import urlsplit

from pipeline.errors import CannotRun
from pipeline.followup import chains, closing, opened
from pipeline.followup.seal_state import SEALED, seal_state
from pipeline.followup.verify import signed_warrant, verify
from pipeline.credentials import read as read_credentials
from pipeline.record import delivery_log, keys, report, spread
from pipeline.record.keys import proof_keys, timestamp_key
from pipeline.record.lease import reader
from pipeline.record.storage import StorageError, Store, sha256, write_once
from pipeline.seal import detached, timestamp
from pipeline.seal.signer import SignError, Signer
from pipeline.settings import ConfigError, Settings, without_password


log = logging.getLogger("pipeline.followup.close")
AGAIN = "the close began and is not sealed: run close again once it answers, to finish it"
READER_PASS_S = 300  # the most close waits for a bounce reader's poll to be recorded (its report's rewrite: ~30 s at 1.5M)


class WindowOpen(CannotRun, RuntimeError):
    pass


class SealBroken(CannotRun, RuntimeError):
    """A sealed run whose record no longer matches its seal: named, never sealed again."""


class SealStopped(CannotRun, RuntimeError):
    """The signer, the timestamp authority or the store failed the seal: one line naming it. The
    close began and is not sealed; the next close completes it."""


def close(settings: Settings, run_id: str, now: float | None = None, store_url: str | None = None) -> dict:
    """Under the run's lease: nothing mails the run while it is sealed. On the run's own store
    and key (located.py), unless `store_url` names a copy of its record."""
    now = time.time() if now is None else now
    with opened.open_run(settings, run_id, store_url, command="close", restored=False) as run, \
            _record_held(run, settings.lease_s) as holds:
        settings, store, state, where = run.settings, run.store, run.state, {"run_id": run_id, **run.where()}
        sealing = seal_state(store, run_id)
        if sealing.state == SEALED:  # sealed once: shown, never sealed again
            _matches(store, run_id, "was sealed, and its record no longer matches the seal")
            return {**where, "already_sealed": True, **_sealed(store, run_id)}
        if sealing.proof:  # the seal began: completed from the proof as stored
            finish(settings, store, run_id, _ready_to_seal(settings, store))
            return {**where, "already_sealed": False, **_sealed(store, run_id)}
        meta = run.meta()
        if not meta.get("finished"):
            raise WindowOpen(f"run {run_id} has not finished: its bounce window has not begun")
        recorded = report.window_h(meta)
        hours = settings.bounce_window_h if recorded is None else recorded
        closes = float(meta["finished"]) + hours * 3600
        if now < closes:
            raise WindowOpen(f"run {run_id}: the bounce window is open until "
                             f"{report.bounce_window(meta)['closes_at']} ({hours:g} h after the run): not closed")
        signer = _ready_to_seal(settings, store)  # before the first write: a close that cannot sign writes nothing
        if sealing.warrant:  # an earlier close began and stopped: finished only as it began
            _matches(store, run_id, "began its close, and its record no longer matches where it began")
        found = _read_chains(store, run_id, run.split.shards)
        if broken := next((chain.problem for chain in found.values() if chain.problem), ""):
            raise SealBroken(f"run {run_id} is not sealed over a delivery log that is not as written: {broken}")
        warrant = closing.begin(store, run_id, {shard: chain.end for shard, chain in found.items()},
                                float(meta.get("closed_at") or now), partial(_signed, run_id, signer=signer,
                                                                             what="warrant"),
                                without_password(settings.tsa_url))
        closed_at = warrant["closed_at"]
        settings = dataclasses.replace(settings, tsa_url=_tsa(settings, run_id, warrant.get("tsa", ""), "warrant"))
        _still_held(holds, run_id)
        state.update_meta(closed_at=closed_at, bounce_window_h=hours)
        with ThreadPoolExecutor(1) as aside:  # the report from Redis while the chains' closing objects go out
            written = aside.submit(report.rewrite, store, state, run_id, settings.paper_due_days)
            ended = _close_chains(store, run_id, found, closed_at)
            written.result()
        del found  # what the seal needs is in `ended`
        _still_held(holds, run_id)
        seal(settings, store, run_id, ended, signer)
    return {**where, "already_sealed": False, **_sealed(store, run_id)}


@contextmanager
def _record_held(run: opened.OpenRun, lease_s: float) -> Iterator[Callable[[], bool]]:
    """The run's record held against bounce readers (keys.run_recording; bounces._recording) while
    close runs. It says first that it waits, so a reader lets it in before its next poll, then
    waits (READER_PASS_S at most) for the poll being recorded."""
    r, run_id, waiting = run.state.r, run.state.run_id, keys.run_close_waiting(run.state.run_id)
    r.set(waiting, "close", px=READER_PASS_S * 1000)
    try:
        with reader(r, keys.run_recording(run_id), f"run {run_id}'s record", lease_s, wait_s=READER_PASS_S,
                    by="being written by a bounce reader", one="close waits for its poll to be recorded") as holds:
            r.delete(waiting)
            yield holds
    finally:
        r.delete(waiting)


def _still_held(holds: Callable[[], bool], run_id: str) -> None:
    """Before the next write: a Redis restarted without its data, or a close stalled past
    CN_LEASE_S, let a bounce reader in beside it."""
    if not holds():
        raise SealStopped(f"close {run_id}: its hold on the run's record in Redis was lost (Redis restarted, or "
                          f"the close stalled past CN_LEASE_S); {AGAIN}")


def _sealed(store: Store, run_id: str) -> dict:
    proof = json.loads(store.get(proof_keys(run_id)[0]))
    statuses = json.loads(store.get(keys.report_keys(run_id)[0])).get("statuses", {})
    return {"closed_at": proof.get("closed_at"), "sealed_at": proof["sealed_at"],
            "delivered_final": statuses.get("delivered", 0), "bounced": statuses.get("bounced", 0),
            "proof": proof_keys(run_id)[0], "signature": proof_keys(run_id)[1],
            "timestamp": timestamp_key(run_id) if store.exists(timestamp_key(run_id)) else "",
            "shards": len(proof["heads"]), "log_objects": sum(h["objects"] for h in proof["heads"])}


def _read_chains(store: Store, run_id: str, shards: list[int]) -> dict[int, chains.Read]:
    """Every shard's chain, read once (the run's listing, then a GET an object, a slice of shards
    at a time: record/spread.py): the warrant's heads, the seal's hashes and where each closing
    object goes all come from this one pass."""
    listed = delivery_log.run_chain_keys(store, run_id)
    jobs = ((run_id, s, listed.get(s, [])) for s in shards)
    return dict(zip(shards, spread.each(chains.read, store, jobs, len(shards))))


def _close_chains(store: Store, run_id: str, found: dict[int, chains.Read],
                  closed_at: float) -> dict[int, tuple[str, list[str]]]:
    """A closing object at the end of each shard's chain, once (a close that stopped half-way
    and runs again adds none twice); returns each chain's last key and every object's SHA-256.
    Written by the processes close spreads its work over, not this one: it writes the report."""
    jobs = ((run_id, shard, chain, closed_at) for shard, chain in found.items())
    return dict(zip(found, spread.each(chains.close, store, jobs, len(found), here=False)))


def _ready_to_seal(settings: Settings, store: Store) -> Signer:
    """What the seal needs, proved before close writes anything: the signing key (a file, or a
    token logged in to) and a store that takes writes. A close that failed here changed nothing,
    so nothing of it can read as tampering."""
    _, signer = read_credentials(settings)
    try:
        store.put(keys.WRITE_CHECK, b"ok")
    except Exception as e:  # OSError, botocore: whatever the backend says, the seal cannot be written
        raise StorageError(f"storage {store.url} cannot be written: {e}") from None
    return signer


def _matches(store: Store, run_id: str, otherwise: str) -> None:
    """The record as verify reads it, whole, or SealBroken naming the first thing that is not."""
    checked = verify(store, run_id)
    if not checked["ok"]:
        raise SealBroken(f"run {run_id} {otherwise}: {checked['first_problem']}")


def seal(settings: Settings, store: Store, run_id: str, chains: dict[int, tuple[str, list[str]]],
         signer: Signer) -> None:
    """The proof, its signature and (with CN_TSA_URL) its timestamp: all had before the first is
    written, then written in that order, each once. A proof another close wrote first is theirs
    to complete (`finish`), as long as the record matches it."""
    data = closing.as_json(_proof(settings, store, run_id, chains))
    made = _made(run_id, data, signer, sign=True, tsa=settings.tsa_url)
    if not _write(store, run_id, proof_keys(run_id)[0], data):
        return finish(settings, store, run_id, signer)
    for key, body in made:
        _write(store, run_id, key, body)  # another close's, over the same proof: theirs stands, verify judges it


def finish(settings: Settings, store: Store, run_id: str, signer: Signer) -> None:
    """A seal whose proof is written, completed: the stored proof's bytes are the seal (a close
    that stopped after writing them, or another that won the key), once the record matches them
    as verify reads it; what is missing of its signature and timestamp is made over them and
    written. The timestamp from CN_TSA_URL, else from the TSA the proof names."""
    _matches(store, run_id, "began its seal, and its record no longer matches its proof")
    found = seal_state(store, run_id)
    data = store.get(proof_keys(run_id)[0])
    if not found.signed:
        _vouched(run_id, json.loads(data), signed_warrant(store, run_id))
    tsa = _tsa(settings, run_id, found.tsa, "proof") if found.tsa and not found.stamped else ""
    for key, body in _made(run_id, data, signer, sign=not found.signed, tsa=tsa):
        _write(store, run_id, key, body)


def _tsa(settings: Settings, run_id: str, named: str, by: str) -> str:
    """The timestamp authority a seal asks: CN_TSA_URL, else the one its close began with (`named`
    by its warrant or its proof, `by`), so a close run again from a shell without CN_TSA_URL still
    stamps the seal its first attempt asked a timestamp for. Said when the two differ. The record
    names an authority without its password, so a close of one that needs it is told to give it."""
    shown, recorded = without_password(settings.tsa_url), without_password(named)  # a record from before: whole
    if named and settings.tsa_url and shown != recorded:
        log.warning("close %s: the timestamp is asked of %s (CN_TSA_URL), not %s, which its %s names", run_id,
                    shown, recorded, by)
    elif named and not settings.tsa_url:
        if urlsplit(named).password == "***":  # masked when recorded
            raise ConfigError(f"close {run_id}: its {by} names the timestamp authority {named}, whose password the "
                              "record does not keep: set CN_TSA_URL to it, with the password, and run close again")
        log.warning("close %s: the timestamp is asked of %s, which its %s names (CN_TSA_URL is not set)", run_id,
                    recorded, by)
    return settings.tsa_url or named


def _vouched(run_id: str, proof: dict, warrant: dict | None) -> None:
    """An unsigned proof is signed only if close's signed warrant vouches for it: the same
    closed_at, and each chain's head where close began on the proof's chain. A proof and chains
    rewritten to agree, with the signature removed, would otherwise be signed by the next close."""
    heads_on_chains = warrant is not None and all(
        not sha or sha in proof.get("objects", {}).get(str(shard), []) for shard, (_, sha) in warrant["heads"].items())
    if not heads_on_chains or proof.get("closed_at") != report.iso(warrant["closed_at"]):
        raise SealBroken(f"run {run_id}: its proof is not signed, and close's signed warrant does not vouch for it "
                         "(missing, changed, or naming other chain heads or another closed_at): not signed again")


def _proof(settings: Settings, store: Store, run_id: str, chains: dict[int, tuple[str, list[str]]]) -> dict:
    """The proof: every chain object's SHA-256, the heads, the report's three objects' SHA-256."""
    objects = {str(shard): hashes for shard, (_, hashes) in sorted(chains.items())}
    heads = [{"shard": shard, "key": last, "objects": len(hashes), "sha256": hashes[-1]}
             for shard, (last, hashes) in sorted(chains.items())]
    json_key, csv_key = keys.report_keys(run_id)
    raw_report = store.get(json_key)
    return {"run_id": run_id, "sealed_at": time.time(), "heads": heads, "objects": objects, "tsa": without_password(settings.tsa_url),
            "closed_at": json.loads(raw_report)["bounce_window"]["closed_at"],
            "reports": {json_key: hashlib.sha256(raw_report).hexdigest(),
                        **{k: sha256(store, k) for k in (csv_key, report.paper_key(run_id))}}}


def _made(run_id: str, data: bytes, signer: Signer, sign: bool, tsa: str) -> list[tuple[str, bytes]]:
    """The proof's signature and its timestamp from `tsa` (as asked), each checked over `data`
    before anything is written: a signer or TSA that answers wrongly is refused here, not sealed
    in for good. SealStopped naming the one that failed."""
    made = []
    if sign:
        made.append((proof_keys(run_id)[1], _signed(run_id, data, signer)))
    if tsa:
        made.append((timestamp_key(run_id), _stamped(run_id, data, tsa)))
    return made


def _signed(run_id: str, data: bytes, signer: Signer, what: str = "proof") -> bytes:
    """The proof's (or the warrant's) signature, checked: an HSM lost past its patience
    (CN_HSM_PATIENCE_S) is named with its token, a key file as the signing key; one line, exit 2."""
    about = signer.about
    who = f"the HSM (token {about.get('token')!r}, {about.get('module')})" if about.get("key") == "pkcs11" \
        else "the signing key"
    try:
        signature = detached.sign(data, signer)
        detached.check(data, signature)
    except SignError as e:
        raise SealStopped(f"close {run_id}: {who} did not sign the {what}: {e}; {AGAIN}") from None
    return signature


def _stamped(run_id: str, data: bytes, url: str) -> bytes:
    """The TSA's token over the proof, checked to be over it: a refusal, a reply that is no token
    or a token of other bytes is named with the TSA's URL."""
    tsa = f"close {run_id}: the timestamp authority at {without_password(url)}"
    try:
        token = timestamp.request(url, data)
    except SignError as e:
        raise SealStopped(f"{tsa} {e}; {AGAIN}") from None
    try:
        timestamp.check(token, data)
    except SignError as e:
        raise SealStopped(f"{tsa} answered with a token that is no timestamp of the proof: {e}; {AGAIN}") from None
    return token


def _write(store: Store, run_id: str, key: str, data: bytes) -> bool:
    """One of the seal's objects, written once: True when `key` holds `data` now (a PUT whose
    reply was lost included), False when another close's bytes took it."""
    try:
        return write_once(store, key, data) == data
    except StorageError as e:
        raise SealStopped(f"close {run_id}: {e}; the seal stopped at {key}: {AGAIN}") from None

