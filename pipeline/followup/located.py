"""Where a run's record lives: the store and keys every command after the day works on.

A run records its store (an absolute folder or an s3:// URL) and where its keys are, in its
meta in Redis and in its report. `rerun`, `reconcile`, `bounces` and `close` open the run with
`opened.open_run`, `verify` and `status` find it with `locate`: from what the run recorded, not from
whatever the current folder or CN_STORE implies. A rerun typed in another folder once opened
./store, split the day again there, made a new HMAC key and appended to a second delivery log.
A store that does not hold the run is refused before anything is written, naming the run, the
store tried and the one the run recorded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import redis

from cryptography import x509

from pipeline.errors import RunNotFound
from pipeline.record import keys, made_with
from pipeline.record.report import read_report
from pipeline.record.state import RunState
from pipeline.record.storage import Garbled, Store, check_create_only, open_store
from pipeline.seal import detached
from pipeline.settings import KEY_FILES, Settings, absolute_store, key_id

log = logging.getLogger("pipeline.followup.located")
said = log.getChild("store")  # which store a command works on, and why: shown whatever the command's level


@dataclass(frozen=True)
class Located:
    settings: Settings  # with the run's store and key locations
    store: Store
    source: str  # why this store, as the command says it
    in_redis: bool  # Redis holds the run (else it comes back from `store`)


TOKEN_FIELDS = ("pkcs11_module", "pkcs11_token", "pkcs11_key", "pkcs11_key_id", "pkcs11_pin_file")  # never the PIN


def recorded(settings: Settings, resolved: Settings, cert: x509.Certificate) -> dict[str, str]:
    """What a run records about where its record and keys are (`settings` anchored, `resolved`
    with the secret laid over, `cert` the notes' signing certificate): locations and
    fingerprints, never key material."""
    own = not settings.secret
    unused = {"signer_key"} if settings.pkcs11_module else set()  # a token signs: no key file was read
    return {"store_url": settings.store_url, "key_dir": str(Path(settings.signer_key).parent) if own else "",
            "secret": settings.secret, **{f: getattr(settings, f) if own and f not in unused else "" for f in KEY_FILES},
            "token_key_id": key_id(resolved.hmac_key()),
            "signer_cert_sha256": detached.cert_fingerprint(cert), **{f: getattr(settings, f) for f in TOKEN_FIELDS},
            "message_id_domain": settings.message_id_domain}


def locate(settings: Settings, run_id: str, store_url: str | None = None, writes: bool = False,
           command: str = "", redis_optional: bool = False, sealed_is_found: bool = False) -> Located:
    """The run's store and key locations: Redis's record of the run, else `store_url` (--store),
    else CN_STORE. An explicit store other than the recorded one is used only if it holds the
    run's manifest (a copied or moved record). `writes`: the store must refuse a second
    create-only write (the delivery log's chain rests on it). Reads only, until that check.
    `sealed_is_found` (verify): a run whose close's warrant or proof is there is found, its
    manifest and report removed or not, for the reader to name what was removed."""
    keys.check_run_id(run_id)
    meta = _meta(settings, run_id, redis_optional)
    own = meta.get("store_url", "")
    if store_url:
        url = absolute_store(store_url)
        source = "--store" if not own else "--store, the run's own" if url == own else \
            f"--store, a copy of the run's record (it recorded {own})"
    elif own:
        url, source = own, "the run's own, recorded in Redis"
        if absolute_store(settings.store_url) != own and settings.store_url != Settings.store_url:
            source += f"; CN_STORE={settings.store_url} is not the run's and is not used"
    else:
        url = absolute_store(settings.store_url)
        source = "CN_STORE" if settings.store_url != Settings.store_url else "the default folder ./store (CN_STORE unset)"
        source += ": Redis does not hold the run"
    store = open_store(url, probe=True)
    manifest, report = store.exists(keys.manifest_key(run_id)), store.exists(keys.report_keys(run_id)[0])
    sealed = sealed_is_found and not (manifest or report) and any(
        store.exists(k) for k in (keys.proof_keys(run_id)[0], keys.closing_keys(run_id)[0]))
    if not (manifest or report or sealed) or (own and url != own and not manifest):
        elsewhere = f"; the run recorded {own}" if own and own != url else ""
        raise RunNotFound(f"no run {run_id!r} in {url} (no manifest or report there){elsewhere}"
                          + ("" if meta else "; Redis does not hold it either"))
    try:
        found = meta if meta else read_report(store, keys.report_keys(run_id)[0]) if report else {}
    except Garbled:  # NotAsWritten too
        if writes:
            raise
        found = {}  # changed in the bucket: a command that only reads (verify) names it as changed
    if not meta and found.get("store_url") and found["store_url"] != url:
        source += f"; a copy of the run's record (it recorded {found['store_url']})"
    if writes:
        check_create_only(store, keys.create_only_check_key(run_id))
    said.info("%s %s: store %s (%s)", command or "run", run_id, url, source)
    settings = _with_keys(replace(settings, store_url=url), found)
    if writes:  # what it writes (a report's paper list, a rerun's notes and mails) is as the run made it
        settings = made_with.run_settings(settings, found, run_id, command or "run")
    return Located(settings, store, source, bool(meta))


def _meta(settings: Settings, run_id: str, optional: bool) -> dict:
    """Redis down at the command's start is said at once, as a run's preflight says it: the ~30 s
    a connection is retried are for a blip mid-command (a `close` waited 37 s to say it)."""
    try:
        return RunState(settings.redis_url, run_id, patience_retries=0).meta()
    except redis.RedisError as e:
        if not optional:
            raise
        log.info("Redis unreachable (%s): the run's record is looked for in storage", e)
        return {}


def _with_keys(settings: Settings, found: dict) -> Settings:
    """The run's key locations wherever these settings name none of their own (no CN_SECRET, a
    key file left at its default), and its HMAC key's fingerprint: a follow-up finds that key,
    or stops."""
    changes = {}
    if found.get("secret") and not settings.secret:
        changes["secret"] = found["secret"]
    elif not settings.secret:
        changes.update({f: found[f] for f in KEY_FILES if found.get(f) and getattr(settings, f) == getattr(Settings, f)})
    if found.get("token_key_id"):
        changes["token_key_id"] = found["token_key_id"]
    # the run's Message-IDs, whatever this shell says: a run from before it was recorded had the old domain
    changes["message_id_domain"] = found.get("message_id_domain") or Settings.message_id_domain
    if found.get("pkcs11_module") and not settings.pkcs11_module:  # `close` signs with the run's token
        changes.update({f: found[f] for f in TOKEN_FIELDS if found.get(f)})
    return replace(settings, **changes)
