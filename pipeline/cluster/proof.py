"""`close RUN_ID` and `verify RUN_ID`: deemed delivery, and a proof no one can quietly edit.

The regulation counts an e-mailed note as delivered when no bounce comes back. Once the run's
bounce window (CN_BOUNCE_WINDOW_H after the run's end) has passed, `close` makes every
mailed account without a permanent bounce delivered, final, and seals the record: it
writes reports/{run}.proof.json (each shard's chain head in the delivery log, and the
SHA-256 of the report and the paper list) with a detached CMS signature by the notes'
signing key, reports/{run}.proof.p7s, which `openssl cms -verify` checks.

`verify` needs storage alone: it walks every shard's chain from its first object, checks each
object's number and link and the sealed heads, and names the first object that was changed,
removed or put out of order; then the signature over the proof. Objects added after the seal
(a client fetching a note) must extend the chain, and are counted.
"""

from __future__ import annotations

import hashlib
import json
import time

from pipeline.cluster import located, restore
from pipeline.credentials import read as read_credentials
from pipeline.day.split import load_manifest
from pipeline.record import delivery_log, keys, report
from pipeline.record.lease import held
from pipeline.record.state import RunNotFound, RunState
from pipeline.record.storage import StorageError, Store, read_json
from pipeline.seal import detached
from pipeline.seal.sign import SignError
from pipeline.settings import Settings


class WindowOpen(RuntimeError):
    pass


def proof_keys(run_id: str) -> tuple[str, str]:
    return f"reports/{run_id}.proof.json", f"reports/{run_id}.proof.p7s"


def close(settings: Settings, run_id: str, now: float | None = None, store_url: str | None = None) -> dict:
    """Under the run's lease: nothing mails the run while it is sealed. On the run's own store
    and key (located.py), unless `store_url` names a copy of its record."""
    found = located.locate(settings, run_id, store_url, writes=True, command="close")
    settings, store = found.settings, found.store
    state = RunState(settings.redis_url, run_id, settings.state_ttl_s)
    split = load_manifest(store, run_id)
    if split is None:
        raise RunNotFound(f"no run {run_id!r} in {settings.store_url}")
    now = time.time() if now is None else now
    with held(state, settings.lease_s):
        if not state.exists():
            restore.from_storage(store, state, run_id)
        meta = state.meta()
        if not meta.get("finished"):
            raise WindowOpen(f"run {run_id} has not finished: its bounce window has not begun")
        hours = float(meta.get("bounce_window_h") or settings.bounce_window_h)
        closes = float(meta["finished"]) + hours * 3600
        if now < closes:
            raise WindowOpen(f"run {run_id}: the bounce window is open until "
                             f"{report.bounce_window(meta)['closes_at']} ({hours:g} h after the run): not closed")
        if not meta.get("closed_at"):
            state.update_meta(closed_at=now, bounce_window_h=hours)
        report.rewrite(store, state, run_id, settings.paper_due_days)
        sealed = seal(settings, store, run_id, split.shards)
    statuses = read_json(store, keys.report_keys(run_id)[0]).get("statuses", {})
    return {"run_id": run_id, "store": store.url, "store_from": found.source, "closed_at": state.meta()["closed_at"], "delivered_final": statuses.get("delivered", 0),
            "bounced": statuses.get("bounced", 0), "proof": proof_keys(run_id)[0],
            "signature": proof_keys(run_id)[1], "shards": len(sealed["heads"]),
            "log_objects": sum(h["objects"] for h in sealed["heads"])}


def seal(settings: Settings, store: Store, run_id: str, shards: list[int]) -> dict:
    heads = []
    for shard in sorted(shards):
        end = delivery_log.head(store, run_id, shard)
        if end is not None:
            heads.append({"shard": shard, "key": end.key, "objects": end.seq, "sha256": end.sha256})
    json_key, csv_key = keys.report_keys(run_id)
    proof = {"run_id": run_id, "sealed_at": time.time(), "heads": heads,
             "reports": {k: hashlib.sha256(store.get(k)).hexdigest()
                         for k in (json_key, csv_key, report.paper_key(run_id))}}
    data = json.dumps(proof, indent=1, sort_keys=True).encode()
    _, signer = read_credentials(settings)
    proof_key, sig_key = proof_keys(run_id)
    store.put(proof_key, data)
    store.put(sig_key, detached.sign(data, signer))
    return proof


def verify(store: Store, run_id: str, cert_pem: bytes | None = None) -> dict:
    """Every check, and the first problem found (None: the record is whole). With the broker's
    certificate (`cert_pem`), the proof must be signed by it: a proof edited and signed again
    with another key fails, where without it the signer is only named, for the reader to judge."""
    split = load_manifest(store, run_id)
    if split is None:
        raise RunNotFound(f"no run {run_id!r} in {store.url}")
    proof_key, sig_key = proof_keys(run_id)
    sealed, reports, signer, problems = {}, {}, "", []
    if store.exists(proof_key):
        data = store.get(proof_key)
        try:
            signer = detached.check(data, store.get(sig_key) if store.exists(sig_key) else b"")
        except SignError as e:
            problems.append(f"{proof_key}: signature {sig_key}: {e}")
        if signer and cert_pem and not signer.endswith(detached.fingerprint(cert_pem)):
            problems.append(f"{sig_key}: signed by {signer}, not by the certificate given")
        try:
            sealed_proof = json.loads(data)
            sealed, reports = {h["shard"]: h for h in sealed_proof["heads"]}, sealed_proof.get("reports", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            problems.append(f"{proof_key}: not a proof (edited?)")
    objects = after_seal = 0
    for shard in sorted(split.shards):
        n, extra, problem = _chain(store, run_id, shard, sealed.get(shard))
        objects, after_seal = objects + n, after_seal + extra
        if problem:
            problems.append(problem)
    for key, sha in reports.items():
        if not store.exists(key) or hashlib.sha256(store.get(key)).hexdigest() != sha:
            problems.append(f"{key}: changed or removed after the seal")
    return {"run_id": run_id, "sealed": bool(sealed), "signed_by": signer, "shards": len(split.shards),
            "log_objects": objects, "added_after_seal": after_seal, "ok": not problems,
            "first_problem": problems[0] if problems else None, "problems": problems[:100]}


def _links_elsewhere(store: Store, rest: list[str], data: bytes, head: dict | None, n: int) -> bool:
    """Whether what comes after this object no longer links to it as it is."""
    sha = hashlib.sha256(data).hexdigest()
    if rest:
        try:
            return delivery_log.chain_header(store, rest[0], store.get(rest[0]))["prev"] != sha
        except StorageError:
            return True
    return bool(head) and head["objects"] == n and head["sha256"] != sha


def _chain(store: Store, run_id: str, shard: int, head: dict | None) -> tuple[int, int, str]:
    """(objects, of them after the seal, the first problem or "") for one shard's chain."""
    prev_sha, prev_key, n, unreadable = delivery_log.GENESIS, "", 0, ""
    found = [k for k in store.keys(keys.delivery_log_prefix(run_id, shard)) if delivery_log.CHAINED.search(k)]
    for i, key in enumerate(found):
        data = store.get(key)
        try:
            header = delivery_log.chain_header(store, key, data)
        except StorageError:
            return n, 0, f"{key}: changed (its chain header is gone)"
        n += 1
        if header["run"] != run_id or header["shard"] != shard or key != delivery_log.object_key(run_id, shard, n):
            if header["seq"] > n and key == delivery_log.object_key(run_id, shard, header["seq"]):
                return n, 0, f"{delivery_log.object_key(run_id, shard, n)}: removed (the chain goes from " \
                             f"{prev_key or 'its start'} to {key})"
            return n, 0, f"{key}: out of place (it says run {header['run']} shard {header['shard']} number " \
                         f"{header['seq']}; number {n} of shard {shard} belongs here)"
        if header["prev"] != prev_sha:  # this object or the one before was changed: the next link tells which
            this_changed = not prev_key or _links_elsewhere(store, found[i + 1:], data, head, n)
            return n, 0, f"{key}: changed (its link to {prev_key or 'the start'} was edited)" if this_changed else \
                f"{prev_key}: changed (the next object, {key}, links to another)"
        prev_sha, prev_key = hashlib.sha256(data).hexdigest(), key
        try:  # each line an entry; named only if the chain itself is whole
            for _ in delivery_log.parse(store, key, data.decode("utf-8", "surrogateescape").splitlines()):
                pass
        except StorageError as e:
            unreadable = unreadable or str(e)
        if head and n == head["objects"] and prev_sha != head["sha256"]:
            return n, 0, f"{key}: changed (not the head the proof sealed)"
    if head and n < head["objects"]:
        return n, 0, f"{head['key']}: removed (the proof sealed {head['objects']} objects, {n} remain)"
    return n, max(0, n - head["objects"]) if head else 0, unreadable
