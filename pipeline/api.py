"""The status service: a run's live state from Redis, its report, targeted reruns, a live page.

Reads the same state and storage the driver writes. Anything that changes state, or shows
who a client is (name, PAN, e-mail address, state), needs the bearer token from config
(CN_API_TOKEN); without it a reader sees what happened to each note, never whose it is: PII is
masked wherever it appears (relay replies quote addresses; a name shows as initials) and reruns
are refused. A read-only service never shows PII nor reruns, token or not. Unknown runs and
accounts are 404, bad queries 422; a Redis or storage outage is 503, never a 500.

GET /notes/{token} is the clients' own door: the link in their e-mail (pipeline/mail/link.py)
returns their archived note, still encrypted with their PAN, and the fetch goes into the
delivery log (it proves receipt). A link that is expired, tampered with or names no note
gets the same 404, and each address may try only so often (429).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import hmac
import logging
import os
import re
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable, Literal

import redis
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, model_validator

from pipeline import credentials
from pipeline.day.split import find_account

from pipeline.record.manifest import load_manifest
from pipeline.followup.runs import list_runs, run_rate
from pipeline.followup.opened import refuse_closed
from pipeline.followup.seal_state import OPEN, SEALED, run_phase, seal_state
from pipeline.mail import link
from pipeline.mail.message import attachment_name
from pipeline.record import delivery_log, keys, made_with, rates, report, waiting
from pipeline.record.records import FINAL_STATUSES, history, rejected_at_validation
from pipeline.record.redact import mask_email, mask_name, mask_pan, mask_text
from pipeline.record.state import RunClosed, RunState, redis_client
from pipeline.record.statuses import HEADLINE, final_status
from pipeline.record.storage import StorageError, Store, open_store
from pipeline.settings import ROOT, ConfigError, Settings, key_id

log = logging.getLogger("pipeline.api")
PAGE = Path(__file__).parent / "static" / "status.html"
Launcher = Callable[[str, list[str] | None, bool, bool], int]
Status = Literal[FINAL_STATUSES]
MAX_RERUN_ACCOUNTS = 100_000  # a request's named accounts; above it: 422
ASKED_RETRIES = 1  # a request in a Redis outage is a 503 at once (the page asks again), not after the run's 30 s
KEY_RECORD = ("token_key_id", "token_key_file", "secret")  # where a run's HMAC key is, as it recorded it
KEY_KEPT_S = 300.0  # a run's key is read again after this: one deleted (rotated out after a leak) opens nothing after it
OUTAGE_KEPT_S = 900.0  # while its record cannot be read, a run's key read before goes on until this long after
NOTE_FETCHES = (20, 60.0)  # per client address: this many requests to /notes/ in this many seconds, then 429


class RateLimit:
    """A token bucket per client address, in this process: a guesser is slowed to a trickle.
    Buckets that are full again are forgotten, so memory follows the addresses active now."""

    def __init__(self, burst: int, per_s: float):
        self.burst, self.rate = burst, burst / per_s
        self.buckets: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def allow(self, who: str) -> bool:
        now = time.monotonic()
        with self.lock:
            if len(self.buckets) > 100_000:
                self.buckets = {k: v for k, v in self.buckets.items() if v[0] + (now - v[1]) * self.rate < self.burst}
            tokens, at = self.buckets.get(who, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens < 1:
                self.buckets[who] = (tokens, now)
                return False
            self.buckets[who] = (tokens - 1, now)
            return True


class RerunRequest(BaseModel):
    failed: bool = False
    accounts: list[str] | None = None
    force: bool = False

    @model_validator(mode="after")
    def one_choice(self) -> "RerunRequest":
        if self.failed == bool(self.accounts):
            raise ValueError("give either failed: true or a non-empty list of accounts")
        if self.accounts and len(self.accounts) > MAX_RERUN_ACCOUNTS:
            raise ValueError(f"at most {MAX_RERUN_ACCOUNTS:,} accounts a request (rerun --failed takes any number)")
        if self.accounts and not all(re.fullmatch(r"[A-Za-z0-9]{1,10}", a) for a in self.accounts):
            raise ValueError("accounts are client codes: 1-10 letters or digits")
        return self


def launch_rerun(run_id: str, accounts: list[str] | None, failed: bool, force: bool) -> int:
    """Starts `python -m pipeline rerun` in the background, with this service's settings. The
    codes go through its standard input: a command line holds only so many."""
    args = [sys.executable, "-m", "pipeline", "rerun", run_id]
    args += ["--failed"] if failed else ["--accounts", "-"]
    args += ["--force"] if force else []
    log = open(os.environ.get("CN_RERUN_LOG", os.devnull), "ab")
    process = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
    process.stdin.write("\n".join(accounts or []).encode())
    process.stdin.close()
    return process.pid


def create_app(settings: Settings | None = None, launch: Launcher = launch_rerun, read_only: bool = False) -> FastAPI:
    settings = settings or Settings.from_env()
    app = FastAPI(title="Contract notes: run status", version="1", docs_url=None, redoc_url=None)
    bearer = HTTPBearer(auto_error=False)

    def authorised(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> bool:
        token = "" if read_only else settings.api_token
        return bool(token and creds and hmac.compare_digest(creds.credentials.encode(), token.encode()))

    def state_of(run_id: str) -> RunState:
        return RunState(settings.redis_url, run_id, settings.state_ttl_s, ASKED_RETRIES)

    def run_state(run_id: str) -> RunState:
        state = state_of(run_id) if keys.RUN_ID.match(run_id) else None
        if state is None or not state.exists():
            raise HTTPException(404, f"no run {run_id!r}")
        return state

    @app.exception_handler(redis.exceptions.RedisError)
    async def redis_down(request: Request, exc: Exception):
        return JSONResponse({"detail": "state store unavailable"}, status_code=503)

    @app.exception_handler(StorageError)
    async def storage_down(request: Request, exc: Exception):
        return JSONResponse({"detail": "storage unavailable"}, status_code=503)

    @app.get("/healthz", summary="Is the service up and its Redis reachable")
    def healthz():
        """Answers `{"ok": true}` when this service can reach its Redis, for a load balancer or a
        heartbeat; no token needed. 503 when Redis does not answer."""
        redis_client(settings.redis_url, patience_retries=0).ping()
        return {"ok": True}

    @app.get("/", response_class=HTMLResponse, summary="The live status page")
    def page():
        """An HTML page for a browser: the recent runs as a grid, and for the chosen one its
        progress, notes a second, relays, failures and bounces, refreshed every second. Anyone may
        open it; its rerun button asks for the API token (a read-only service shows none)."""
        html = PAGE.read_text()
        if read_only:  # no token box, no rerun button: nothing on the page this service would refuse
            html = re.sub(r"<!-- write -->.*?<!-- /write -->", "", html, flags=re.S)
        return HTMLResponse(html, headers={"Content-Security-Policy": content_security_policy(html),
                                           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    @app.get("/docs", response_class=HTMLResponse, summary="This reference, as plain HTML")
    def docs():
        """Every request this service answers, what it does and its parameters, made from
        /openapi.json with nothing fetched from elsewhere, so it works on an isolated network
        (Swagger UI would come from a CDN). No token needed."""
        html = api_reference(app.openapi())
        return HTMLResponse(html, headers={"Content-Security-Policy": content_security_policy(html)})

    def due_days(meta: dict) -> int:
        """A paper note's days from its bounce, as the run's report counts them (its own setting)."""
        return made_with.value(meta, "paper_due_days", settings.paper_due_days)

    def store_of(run_id: str) -> Store:
        """The run's own store as Redis recorded it (a run started with --store elsewhere), as
        the commands open it (located.locate); the service's once Redis no longer holds the run,
        or does not answer (the page then answers from storage, as it does for the runs' list)."""
        try:
            url = state_of(run_id).meta().get("store_url") if keys.RUN_ID.match(run_id) else None
        except redis.exceptions.RedisError:
            url = None
        return open_store(url or settings.store_url)

    stored, seals = StoredRuns(settings), Seals(store_of)

    @app.get("/runs", summary="The recent runs, newest first")
    def runs(limit: int = Query(20, ge=1, le=500)):
        """Each run's trade date, state (running, finished, closing, sealed), counts by final
        status, start, duration and notes a second: from Redis where it holds the run, else from
        its report in storage (a cluster's Redis ends with the cluster; one Redis run hid every
        other). No token needed; 422 for a limit outside 1-500, 503 when storage does not answer
        and Redis holds none."""
        try:
            ids = redis_client(settings.redis_url, ASKED_RETRIES).zrevrange(keys.RUNS, 0, limit - 1)
            live = [summary(s, seals) for s in map(state_of, ids) if s.exists()]
        except redis.exceptions.RedisError:
            live = []
        shown = {r["run_id"] for r in live}  # a run Redis holds, as Redis has it; every other, as storage has it
        try:
            rows = live + [r for r in stored.listed(limit + len(live)) if r["run_id"] not in shown]
        except StorageError:
            if not live:
                raise
            rows = live
        return {"runs": sorted(rows, key=lambda r: -(r["started"] or 0))[:limit]}

    @app.get("/runs/{run_id}", summary="One run's counters, rate, ETA and timeline")
    def run(run_id: str):
        """The run's counts by stage and final status, its state, notes a second, ETA, bounce
        window, relays' rates and its timeline of counters (about one a second), from Redis or,
        once Redis has forgotten it, from its report in storage (no timeline). No token needed;
        404 for a run neither holds, 503 when both are unreachable."""
        try:
            state = state_of(run_id) if keys.RUN_ID.match(run_id) else None
            if state is not None and state.exists():
                return {**summary(state, seals), "timeline": state.timeline()}
            redis_said = None
        except redis.exceptions.RedisError as e:
            redis_said = e
        found = stored.report(run_id) if keys.RUN_ID.match(run_id) else None
        if found is None:
            if redis_said:
                raise redis_said
            raise HTTPException(404, f"no run {run_id!r}")
        return {**report_summary(run_id, found, seals), "timeline": []}

    @app.get("/runs/{run_id}/accounts", summary="A run's accounts, a page at a time")
    def accounts(run_id: str, status: Status | None = None, cursor: int = Query(0, ge=0, lt=2**64),
                 limit: int = Query(50, ge=1, le=500), full: bool = Depends(authorised)):
        """Each account's stage, final status, reason and attempts, optionally of one status only;
        follow `next_cursor` for the next page. Reasons are masked without the bearer token. 404
        for an unknown run, 422 for a bad status, cursor or limit, 503 when Redis is down."""
        state = run_state(run_id)
        meta = state.meta()
        closed = bool(meta.get("closed_at"))
        items, cursor = state.page(cursor, limit, status, closed)
        return {"items": [public_record(rec, full, due_days(meta), closed) for rec in items],
                "next_cursor": cursor or None}

    @app.get("/runs/{run_id}/accounts/{ucc}", summary="One account's history and its client")
    def account(run_id: str, ucc: str, full: bool = Depends(authorised)):
        """Everything that happened to one client's note in the run, stage by stage (`history`,
        from Redis), its entries in the run's delivery log (`delivery_log`, the record: each
        mailing, the relay's reply, a bounce, the client's fetches of the note), and who the
        client is: the name, e-mail, PAN and state need the bearer token (without it they and
        the texts are masked). 404 for an unknown run or account, 503 when Redis or storage is down."""
        state = run_state(run_id)
        record = state.accounts([ucc]).get(ucc) if re.fullmatch(r"[A-Za-z0-9]{1,10}", ucc) else None
        if record is None:
            raise HTTPException(404, f"no account {ucc!r} in run {run_id!r}")
        store = store_of(run_id)
        entry = find_account(store, run_id, ucc)
        client = {k: entry["client"][k] for k in ("name", "email", "pan", "state")} if entry else {}
        if client and not full:  # who the client is needs the token; what happened to the note does not
            client.update(name=mask_name(client["name"]), email=mask_email(client["email"]),
                          pan=mask_pan(client["pan"]), state="***")

        def shown(event: dict) -> dict:  # without the token: texts masked, and no bounce's VERP token (it proves one)
            return event if full else {k: mask_text(v) if isinstance(v, str) else v for k, v in event.items()
                                       if k != "token"}
        meta, shards = state.meta(), shard_count(store.url, run_id)
        logged = [shown(e) for e in delivery_log.entries(store, run_id, keys.shard_of(ucc, shards))
                  if e["ucc"] == ucc] if shards else []
        return {**public_record(record, full, due_days(meta), bool(meta.get("closed_at"))),
                "history": [shown(e) for e in history(record)], "delivery_log": logged, "client": client,
                "pii": "shown" if full else "masked"}

    @app.get("/runs/{run_id}/report.csv", response_class=PlainTextResponse, summary="The run's report as CSV")
    def report_csv(run_id: str, full: bool = Depends(authorised)):
        """A row per account, live while the run goes on, or the report stored when it ended
        once Redis has forgotten the run. Addresses and PANs are masked without the bearer
        token. 404 for an unknown run, 503 when Redis or storage is down."""
        if not keys.RUN_ID.match(run_id):
            raise HTTPException(404, f"no run {run_id!r}")
        state = state_of(run_id)
        if state.exists():  # live, also while the run goes on
            meta = state.meta()
            chunks = report.csv_chunks(state, trade_date=meta.get("date", ""), due_days=due_days(meta))
        else:
            store = open_store(settings.store_url)
            key = keys.report_keys(run_id)[1]
            if not store.exists(key):  # Redis forgot the run (TTL): the stored report is the record
                raise HTTPException(404, f"no run {run_id!r}")
            chunks = store.lines(key)
        return StreamingResponse((c if full else mask_text(c) for c in chunks), media_type="text/csv")

    limit, key = RateLimit(*NOTE_FETCHES), lru_cache(maxsize=1)(settings.hmac_key)  # read when a client comes
    unreadable: dict[str, float] = {}  # a run whose own key could not be read: not tried again until then
    away = [0.0]  # Redis or storage not answering a link's lookup: said again after then
    run_keys: dict[str, tuple[bytes | None, str, float]] = {}  # a run's key (None: the service's), date, when read

    def run_key(run_id: str) -> tuple[bytes | None, str] | None:
        """The key a run signed its links with (None: the service's) and its trade date, read
        where the run recorded them: in Redis, else in its report in storage (Redis keeps a run
        14 days, its links work 90). None for a run whose record has no key: a made-up name, a
        run from before keys were recorded, or one not yet recorded, asked about again. A key
        found is read again after KEY_KEPT_S: one deleted since is refused from then on; with
        Redis or storage away meanwhile, the key read before goes on, up to OUTAGE_KEPT_S."""
        kept = run_keys.get(run_id)
        if kept and time.monotonic() - kept[2] < KEY_KEPT_S:
            return kept[:2]
        try:
            found = dict(zip((*KEY_RECORD, "date"), state_of(run_id).r.hmget(keys.run_meta(run_id), *KEY_RECORD,
                                                                              "date")))
            if not any(found[k] for k in KEY_RECORD):
                found = stored.report(run_id) or {}
                found["date"] = found.get("trade_date")
        except (redis.exceptions.RedisError, StorageError) as e:
            if not kept or time.monotonic() - kept[2] >= OUTAGE_KEPT_S:  # a record unreadable for good: not for ever
                raise
            record_away(run_id, e, "the key read before goes on")
            return kept[:2]
        run_keys.pop(run_id, None)  # a key no longer recorded, or readable, is not kept
        if not found.get("token_key_id"):
            return None
        own = found["token_key_id"] == key_id(key())
        read = (None if own else credentials.recorded_token_key(settings, {k: found.get(k) or "" for k in KEY_RECORD}),
                found.get("date") or "")
        run_keys[run_id] = (*read, time.monotonic())
        return read

    def record_away(run_id: str, e: Exception, meanwhile: str) -> None:
        if away[0] <= time.monotonic():  # once a minute, whatever the runs asked about
            away[0] = time.monotonic() + 60
            log.warning("run %s: its record cannot be read (%s): %s", run_id, e, meanwhile)

    def checked(token: str) -> link.NoteLink | None:
        """A link's contents when the key its run signed its links with checks it: the service's
        own, or, for a run that recorded another key's fingerprint (the key was rotated since),
        that run's key: its links keep working for their 90 days, and no other key opens them.
        A run's key opens only links of that run's trade date: the note a link names is found by
        its date and account, so an old key would otherwise open every later day's notes. A run
        whose key cannot be read: refused, as a wrong link is, and not tried again for a minute.
        Redis or storage not answering: the service's key, as a link never needed them (said
        once a minute: a rotated run's links are refused meanwhile)."""
        own, run_id = link.check(key(), token), link.claimed_run(token)
        if run_id is None or not keys.RUN_ID.match(run_id) or unreadable.get(run_id, 0.0) > time.monotonic():
            return None
        try:
            found = run_key(run_id)
        except (redis.exceptions.RedisError, StorageError) as e:
            record_away(run_id, e, "its links are checked with this service's key alone")
            return own
        except Exception as e:  # a key file, a secret: whatever reading it raised
            unreadable[run_id] = time.monotonic() + 60
            log.warning("run %s: its links cannot be checked: %s", run_id, e)
            return None
        if found is None:
            return own
        other, date = found
        opened = own if other is None else link.check(other, token)
        return opened if opened is not None and opened.trade_date == date else None

    @lru_cache(maxsize=64)
    def shard_count(store_url: str, run_id: str) -> int | None:
        split = load_manifest(open_store(store_url), run_id)
        return split.shard_count if split else None

    @app.get("/notes/{token}", summary="A client's own note, from the link in their e-mail")
    def note(token: str, request: Request):
        """The signed PDF, still encrypted with the client's PAN; the signed link is the only
        credential, and the fetch goes into the delivery log as proof of receipt. An expired,
        altered or unknown link is 404, alike; too many tries from one address, 429; storage not
        answering (a folder's disk too), 503."""
        if not limit.allow(request.client.host if request.client else ""):
            raise HTTPException(429, "too many requests: try again in a minute", headers={"Retry-After": "60"})
        found = checked(token)
        pdf_key = keys.signed_pdf_key(found.trade_date, found.ucc) if found and keys.RUN_ID.match(found.run_id) \
            else None
        store = store_of(found.run_id) if pdf_key else None  # the run's own, as its page reads it
        shards = shard_count(store.url, found.run_id) if pdf_key else None
        if not shards or not store.exists(pdf_key):
            raise HTTPException(404, "no such note")  # the same whatever was wrong: a link reveals nothing
        pdf = store.get(pdf_key)
        delivery_log.append(store, found.run_id, keys.shard_of(found.ucc, shards),
                            [{"ucc": found.ucc, "status": "fetched", "at": time.time(), "bytes": len(pdf)}])
        return Response(pdf, media_type="application/pdf", headers={
            "Content-Disposition": f'attachment; filename="{attachment_name(found.ucc, found.trade_date)}"',
            "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    @app.get("/runs/{run_id}/paper.csv", response_class=PlainTextResponse,
             summary="The notes owed on paper, as CSV")
    def paper_csv(run_id: str, full: bool = Depends(authorised)):
        """The physical dispatch list as the report last wrote it: who gets a printed note, why
        (no e-mail consent, a bounce, a refused address) and by when. Addresses are masked
        without the bearer token. 404 when the run has no such list, 503 when storage is down."""
        key = report.paper_key(run_id) if keys.RUN_ID.match(run_id) else ""
        store = store_of(run_id)
        if not key or not store.exists(key):
            raise HTTPException(404, f"no paper list for run {run_id!r}")
        return StreamingResponse((c if full else mask_text(c) for c in store.lines(key)), media_type="text/csv")

    @app.post("/runs/{run_id}/rerun", status_code=202, summary="Rerun a run's failed or named accounts")
    def rerun(run_id: str, body: RerunRequest, full: bool = Depends(authorised)):
        """Starts `python -m pipeline rerun` in the background for `{"failed": true}` or a list
        of accounts (at most 100,000), and answers 202 with the accounts chosen and its process
        id. Needs the bearer token (401 without it, 403 on a read-only service); 404 for an
        unknown run, 422 for a bad body or an account the run lacks; 409, naming why, for a run the
        rerun would refuse at once (closed, held by a live driver, or its notes' files neither
        where the run read them nor named by this service's settings): its own output is not the
        page's to show. A run Redis no longer holds, its report in storage, is rerun as `rerun`
        reruns it: brought back from storage first, then its accounts chosen (`from_storage`
        names the store; `accounts` is null for the failed ones, not known until then)."""
        if read_only:
            raise HTTPException(403, "this status service is read-only")
        if not full:
            raise HTTPException(401, "a bearer token is required to rerun", headers={"WWW-Authenticate": "Bearer"})
        state, store = state_of(run_id) if keys.RUN_ID.match(run_id) else None, store_of(run_id)
        held = state is not None and state.exists()
        if not held and (state is None or not store.exists(keys.report_keys(run_id)[0])):
            raise HTTPException(404, f"no run {run_id!r}")
        try:  # as the rerun refuses it: Redis's word, or the close's objects in storage
            refuse_closed(store, run_id, state.meta() if held else {})
        except RunClosed as e:
            raise HTTPException(409, str(e)) from None
        if holder := state.live_holder(settings.lease_s):
            raise HTTPException(409, f"run {run_id} is held by a driver on {holder['host']} (pid {holder['pid']}): "
                                     "a rerun waits for it to end")
        try:
            made_with.resumed(settings, run_id, "the page's rerun of")  # the run's own files, or refused
        except ConfigError as e:
            raise HTTPException(409, str(e)) from None
        if not held:  # the accounts named, as its report has them; the failed ones, as the rerun finds them
            reported = {} if body.failed else _reported(store, run_id, set(body.accounts))
            _all_in_run(run_id, body.accounts or [], reported)
            pid = launch(run_id, body.accounts, body.failed, body.force)
            return {"run_id": run_id, "force": body.force, "pid": pid, "from_storage": store.url,
                    "accounts": None if body.failed else [u for u in body.accounts if reported[u] != "rejected"]}
        chosen = state.failed() if body.failed else body.accounts
        records = state.accounts(chosen)
        _all_in_run(run_id, chosen, records)
        rejected = set(rejected_at_validation(records))  # as the rerun takes them: not those the input got wrong
        chosen = [u for u in chosen if u not in rejected]
        pid = launch(run_id, body.accounts, body.failed, body.force)
        return {"run_id": run_id, "accounts": chosen, "force": body.force, "pid": pid}

    return app


def _all_in_run(run_id: str, chosen: list[str], found) -> None:
    """422 for accounts the run lacks, as the rerun refuses them at once (NotInRun)."""
    if unknown := [u for u in chosen if u not in found]:
        raise HTTPException(422, f"run {run_id} has no account {', '.join(unknown[:5])}"
                                 + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))


def _reported(store: Store, run_id: str, wanted: set[str]) -> dict[str, str]:
    """The status the run's stored report gives each of `wanted`: its CSV read once as it streams."""
    return {r["ucc"]: r["status"] for r in csv.DictReader(store.lines(keys.report_keys(run_id)[1]))
            if r["ucc"] in wanted}


def content_security_policy(html: str) -> str:
    """Only this page's own inline script and style run (by hash); it talks only to this origin."""
    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class Seals:
    """Where a finished run's seal stands (seal_state), as `status` and `runs` say it: a close
    whose warrant storage holds began, whether or not Redis heard of it. Asked of storage at most
    every ASK_EVERY_S a run (the page asks for every run each second), and a seal, never undone,
    once."""

    ASK_EVERY_S = 30.0

    def __init__(self, store_of: Callable[[str], Store]):
        self.store_of, self.known = store_of, {}

    def phase(self, run_id: str, finished: bool, closed: bool) -> str:
        """seal_state.run_phase, the seal asked of storage as the class says."""
        seal, at = self.known.get(run_id, (OPEN, 0.0))
        if finished and seal != SEALED and (closed or time.monotonic() - at > self.ASK_EVERY_S):
            seal = seal_state(self.store_of(run_id), run_id).state
            self.known[run_id] = (seal, time.monotonic())
        return run_phase(finished, closed, seal)


class StoredRuns:
    """The runs in storage, for those Redis no longer holds: their list read at most every
    LIST_EVERY_S (each refresh of a page would otherwise read every report), a sealed run's row
    kept from the read before."""

    LIST_EVERY_S = 30.0

    def __init__(self, settings: Settings):
        self.settings, self.at, self.rows = settings, 0.0, []

    def listed(self, limit: int) -> list[dict]:
        if time.monotonic() - self.at > self.LIST_EVERY_S:
            known = {r["run_id"]: r for r in self.rows}
            self.rows, self.at = list_runs(open_store(self.settings.store_url), known), time.monotonic()
        return [{**{k: r[k] for k in HEADLINE}, "paper_owed": r["paper_owed"], "run_id": r["run_id"], "date": r["date"],
                 "accounts": r["accounts"] or 0, "state": r["state"], **_times(r["started_at"], r["finished_at"]),
                 "notes_per_s": r["notes_per_s"], "source": "storage"} for r in self.rows[:limit]]

    def report(self, run_id: str) -> dict | None:
        return report.of_run(open_store(self.settings.store_url), run_id)


def report_summary(run_id: str, found: dict, seals: Seals) -> dict:
    """What summary() says of a live run, from its report: its counts by final status (over the
    counts by stage the report kept), its rate, its times, the relays it mailed through (their
    rates were live state)."""
    finished = float(found.get("finished_at") or 0) or None
    final = report.final_counts(found)
    closed = bool((found.get("bounce_window") or {}).get("closed_at"))
    return {"run_id": run_id, "date": found.get("trade_date"), **final, "accounts": found.get("accounts", 0),
            "counts": _headline_counts(found.get("stage_counts", {}), final),
            **_times(report.started_at(found) if finished else None, finished),
            "state": seals.phase(run_id, bool(finished), closed),
            "bounce_window": found.get("bounce_window", {}), "relays": {}, "relay": found.get("relays", ""),
            "notes_per_s": float(found.get("notes_per_s") or 0), "eta_s": None, "source": "storage",
            "reran": _reran(report.started_at(found), found.get("last_started_at"))}


def api_reference(schema: dict) -> str:
    """/docs: each path and method with its summary and parameters, as plain HTML."""
    from html import escape

    rows = []
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            params = ", ".join(f"{p['name']} ({p['in']})" for p in op.get("parameters", []))
            rows.append(f"<tr><td><code>{escape(method.upper())} {escape(path)}</code></td>"
                        f"<td><b>{escape(op.get('summary', ''))}</b><br>{escape(op.get('description') or '')}</td>"
                        f"<td>{escape(params)}</td></tr>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>" + escape(schema["info"]["title"])
            + " API</title><style>body{font:14px system-ui,sans-serif;margin:24px}td{padding:4px 8px;"
            "border-bottom:1px solid #ddd;vertical-align:top}</style></head><body><h1>"
            + escape(schema["info"]["title"]) + "</h1><p>The machine-readable schema: <a href='/openapi.json'>"
            "/openapi.json</a></p><table><tr><th>Request</th><th>What it does</th><th>Parameters</th></tr>"
            + "".join(rows) + "</table></body></html>")


def _headline_counts(stages: dict, final: dict) -> dict:
    """The page's bars: the stages reached as progress, and delivered, failed and the rest as
    the run's final statuses (a bounced mail reached the relay: it is not delivered)."""
    return {**{s: 0 for s in ("validated", "rendered", "signed", "archived")}, **stages,
            **{k: final[k] for k in HEADLINE}}


def summary(state: RunState, seals: Seals) -> dict:
    """Counters by stage, counts by final status, state, rate and ETA: O(1) reads, whatever the size of the run."""
    meta, counts = state.meta(), state.counts()
    final = state.final_counts(meta)
    accounts = int(meta.get("accounts") or 0)
    started, finished = float(meta.get("started") or 0), float(meta.get("finished") or 0) or None
    done = counts["delivered"] + counts["failed"]
    rate = run_rate(meta, counts["delivered"], time.time())
    eta = max(0, accounts - done) / rate if rate > 0 and not finished else None
    closed = bool(meta.get("closed_at"))
    return {"run_id": state.run_id, "date": meta.get("date"), **final, "accounts": accounts,
            "counts": _headline_counts(counts, final), **_times(started or None, finished),
            "state": seals.phase(state.run_id, bool(finished), closed),
            "bounce_window": report.bounce_window(meta), "relays": rates.snapshot(state.r),
            "relay": meta.get("relays", ""), "notes_per_s": rate, "reran": _reran(started, meta.get("last_started")),
            "eta_s": round(eta, 1) if eta is not None else None, "source": "redis",
            "waiting": [] if finished else [waiting.said(what, since) for what, since in
                                            sorted(waiting.waits(meta).items(), key=lambda w: w[1])]}


def _reran(started: float | None, last_started) -> bool:
    """Whether a driver started after the run's first: its rate, then, is the rerun's own (the page says so)."""
    return bool(started and last_started and float(last_started) > started + 1)


def _times(started: float | None, finished: float | None) -> dict:
    """When a run started (epoch, and as `runs` prints it) and how long it took, from its first
    start to its last end (so far, while it runs), as the grid of runs shows them."""
    end = finished or time.time()
    return {"started": started, "finished": finished, "start": report.iso(started) if started else "",
            "duration_s": round(end - started, 3) if started else None}


def public_record(rec: dict, full: bool = False, due_days: int = 1, closed: bool = False) -> dict:
    """An account as the service shows it; `closed`: its run's bounce window has ended (a
    deferred mail is then delivered, final, as the report and the run's counts say)."""
    out = {k: rec.get(k) for k in ("ucc", "stage", "status", "failed_at", "reason", "message_id", "attempts",
                                   "updated")} | {"status": final_status(rec, closed)}
    if not full and out["reason"]:
        out["reason"] = mask_text(out["reason"])
    if rec.get("bounce"):
        b = rec["bounce"]
        out["bounce"] = {"kind": b["kind"], "status": b["status"], "at": b["at"],
                         "reason": b["reason"] if full else mask_text(b["reason"]),
                         "due_date": report.due_date(b["at"], due_days) if b["kind"] == "bounced" else ""}
    return out
