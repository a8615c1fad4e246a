"""The per-shard work of stages 2-4, as plain functions over a batch.

A batch is what travels between stages through Ray's object store: the accounts of one
shard, with their PDF bytes once rendered, plus the CPU time each stage spent on it. The
same functions run inside Ray tasks and actors and in the benchmark's sequential loop.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from email.utils import parseaddr
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Container, Iterator

from pipeline.day.dumps import EMAIL, SEGMENTS, Client, Trade
from pipeline.mail import link
from pipeline.mail.message import (
    Letter,
    PermanentMailError,
    QuotaError,
    TransientMailError,
    UnconfirmedMailError,
    build_message,
    message_id,
)
from pipeline.mail.md5s import md5_hex_all
from pipeline.mail.relay import PoolOptions, RetryPolicy, SmtpPool, send_with_retry
from pipeline.mail.verp import Verp
from pipeline.note.charges import compute
from pipeline.note.content import build_note
from pipeline.note.render import RenderError, render_all
from pipeline.record import delivery_log, keys
from pipeline.record.guard import StateLostError, claim_token
from pipeline.record.lease import LeaseLostError
from pipeline.record.rates import RedisBuckets
from pipeline.record.records import Outcome, StateWriter, rank
from pipeline.record.state import RunState
from pipeline.record.storage import FolderStore, Store, write_once
from pipeline.seal.sign import SignatureInfo, protect_each, user_halves
from pipeline.seal.signer import SignError
from pipeline.settings import TEMPLATES, ConfigError

if TYPE_CHECKING:  # only a mailer with CN_DKIM_* loads dkim (~70 ms of every Ray worker's start)
    from pipeline.mail.dkim_signer import DkimSigner

log = logging.getLogger("pipeline.stages")
RECORD_WAIT_S = 0.005  # longest a relay's reply waits for a claim to ride to Redis with
# A signer's writes to S3 under way at once: one after another, a batch of 100 notes waited out
# 100 of S3's round trips (~2 s at ~20 ms a PUT) for ~0.5 s of signing. A folder's stay in the
# signer's thread: in threads, its creates in one directory cost ~0.35 ms more CPU a note.
_ARCHIVE_WRITES = ThreadPoolExecutor(16, "archive")
_REDIS_CALLS = ThreadPoolExecutor(8, "redis")  # a mailer's Redis calls (MailContext.redis)


@dataclass
class Batch:
    run_id: str
    trade_date: str
    shard: int
    items: list[dict] = field(default_factory=list)  # ucc, name, email, pan, ecn, pdf (and made, to the signer)
    cpu_s: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # accounts that left the batch early, by status
    settles: dict[str, str] = field(default_factory=dict)  # exchange -> settlement date (ISO)
    broker_file: str = ""  # the issuing entity's (CN_BROKER_FILE): its details and tariff on the notes
    lease: str = ""  # the token of the run's lease its driver held: checked before archiving and mailing
    waits: list[tuple[str, float, float]] = field(default_factory=list)  # (on what, from, to): epoch seconds held
    log_end: delivery_log.Link | None = None  # where the driver saw the shard's delivery log end (its first notes')

    def drop(self, status: str) -> None:
        self.dropped[status] = self.dropped.get(status, 0) + 1

    def timed(self, stage: str, started: float) -> None:
        self.cpu_s[stage] = self.cpu_s.get(stage, 0.0) + time.process_time() - started


def broker(path: str = "") -> dict:
    """The issuing entity's details, memberships and tariff: `path` (CN_BROKER_FILE), else
    templates/broker.json."""
    return _broker(str(Path(path).resolve()) if path else _BROKER_FILE)


_BROKER_FILE = str(TEMPLATES / "broker.json")  # the path's join and str() were ~2 µs a note


@lru_cache(maxsize=4)
def _broker(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the broker file {path}: {e}") from None
    for segment in [*data.get("segments", []), *data.get("left_to", {})]:
        if segment not in SEGMENTS:
            raise ConfigError(f"{path}: {segment!r} is not an exchange-segment ({', '.join(SEGMENTS)})")
    if both := set(data.get("segments", [])) & set(data.get("left_to", {})):
        raise ConfigError(f"{path}: {', '.join(sorted(both))} both in its segments and left to another entity")
    return data


def load_shard(store: Store, run_id: str, shard: int, data: bytes | None = None) -> list[dict]:
    """The shard file's accounts; `data`: its bytes, when the caller has them (the driver reads a
    shard it cut in parts once, and hands the bytes to each part's render task)."""
    data = store.get(keys.shard_key(run_id, shard)) if data is None else data
    return [json.loads(line) for line in data.decode().splitlines()]


def restore_from_log(store: Store, state: RunState, run_id: str, shard: int, accounts: Container[str],
                     as_of: float | None = None) -> int:
    """Before a resumed run mails a shard, Redis and the shard's delivery log are brought
    level, whichever knows more (_knows_more): a log entry Redis does not know (Redis lost the
    run, or came back from an older snapshot) goes back into Redis, the mail guard first; a
    delivery Redis saw that the log missed (its mailing died before logging) goes into the
    log. Only the shard's `accounts` are looked at: an entry for any other is not the run's.
    `as_of`: the records were rebuilt from a report whose accounts were read then (restore.py).
    The log's bounces go back too, after the mail they answer (records.bounce: each once), so a
    run resumed after Redis lost it reports a bounced client bounced, as its log does.
    Returns how many accounts Redis got back: none the second time, without `as_of`."""
    bounces: list[tuple] = []

    def mailings() -> Iterator[dict]:  # the log read once, as it streams: its bounces kept aside (a few)
        for e in delivery_log.entries(store, run_id, shard):
            if e["status"] in ("bounced", "deferred") and e["ucc"] in accounts:
                bounces.append((e["ucc"], e["status"], e.get("dsn_status", ""), e.get("reason", ""), e["at"]))
            yield e
    found = delivery_log.latest(mailings(), accounts)
    records = state.accounts(sorted(found))
    guard, outcomes, catch_up = set(), [], []
    for ucc, e in found.items():
        rec = records.get(ucc)
        if rec is not None and _knows_more(rec, e, as_of):
            if rec.get("stage") == "delivered":
                guard.add(ucc)
            if rec.get("stage") == "delivered" and e["status"] != "delivered":  # in the log from now
                catch_up.append({"ucc": ucc, "status": "delivered", "message_id": rec.get("message_id", ""),
                                 "reply": rec.get("reply", ""), "at": max(rec["updated"], e["at"]),
                                 "attempts": rec.get("attempts", 1)})
            continue
        status = "unconfirmed" if e["status"] == "sending" else e["status"]
        extra = {"attempts": e.get("attempts", 1)} | ({"possible_duplicate": True} if e.get("possible_duplicate") else {})
        if status in ("delivered", "unconfirmed"):
            guard.add(ucc)
        if status == "delivered":
            outcomes.append(Outcome(ucc, "delivered", message_id=e["message_id"], reply=e.get("reply", ""), extra=extra))
        elif status == "unconfirmed":
            reason = e.get("reason") or "a mailing ended between claim and reply (from the delivery log)"
            outcomes += [Outcome(ucc, "archived"), Outcome(ucc, "delivered", "unconfirmed", reason=reason,
                                                           message_id=e["message_id"], extra=extra)]
        else:  # failed: the next mailing tries again, from the archive
            outcomes += [Outcome(ucc, "archived"),
                         Outcome(ucc, "delivered", "failed", reason=e.get("reason", ""), extra=extra)]
    if catch_up:
        delivery_log.append(store, run_id, shard, catch_up)
    state.restore_claims(guard)
    state.record(outcomes)
    state.bounce(sorted(bounces, key=lambda b: b[1] == "bounced"))  # a delay, then the failure that ends it
    return len({o.ucc for o in outcomes})


def _knows_more(rec: dict, e: dict, as_of: float | None) -> bool:
    """Whether an account's record already says what its latest log entry says, or more: it was
    written after the entry, as of `as_of` when it was rebuilt from a report (the report knew
    nothing logged after it read the account); a delivered record says as much as a delivered
    entry and more than any "sending" (the account was delivered, by that mailing or one before
    it, and stays delivered and guarded). A record below "archived" knows less than any entry,
    whatever its time: an account
    is archived before its mail is logged and a record's stage never goes back, so Redis had
    lost the account and made that record anew (a split run again validates it then)."""
    if rec["rank"] < rank("archived"):
        return False
    return min(rec["updated"], as_of or rec["updated"]) >= e["at"] or (
        rec["stage"] == "delivered" and e["status"] in ("sending", "delivered"))


def render_stage(batch: Batch, accounts: list[dict], state: RunState, only: set[str] | None = None,
                 render_notes: Callable[[list[dict]], list[bytes | Exception]] = render_all, force: bool = False,
                 in_archive: Callable[[str], bool] = lambda ucc: True, encryption: str = "") -> Batch:
    """Render every account of the shard that still needs it; an account already archived is
    passed on to be mailed from the archive, one already delivered is left alone (unless
    `force`: then it is mailed again, from the archive). `only` limits a targeted rerun.
    The shard's notes are rendered in one call (`render_notes`: compiled together; the Ray task
    renders a huge note as page ranges in parallel), each note's PDF or why it failed. An archived
    note the store has lost (`in_archive` says no) is rendered again, with its note number: the
    signer archives it anew unless its mail was claimed, and a mailed note is never rebuilt.
    With `encryption`, each rendered note carries its keys' user half (`made`), which needs
    only the PAN: the signer, one process per key, then hashes the owner's half alone."""
    started = time.process_time()
    records = state.accounts([a["ucc"] for a in accounts])
    todo: list[tuple[dict, dict]] = []  # (item, its note's data)
    with StateWriter(state) as writer:
        def failed(ucc: str, e: Exception) -> None:  # one account's bad data fails that account, never its shard-mates
            why = str(e) if isinstance(e, RenderError) else f"{type(e).__name__}: {e}"
            writer.add(Outcome(ucc, "rendered", "failed", reason=f"render: {why}"[:300]))
            batch.drop("failed")

        for account in accounts:
            ucc = account["ucc"]
            reached = records.get(ucc, {}).get("rank", 0)
            if only is not None and ucc not in only:
                continue
            if reached >= rank("delivered") and not force:
                batch.drop("skipped")
                continue
            client = Client(**account["client"])
            item = {"ucc": ucc, "name": client.name, "email": client.email, "pan": client.pan,
                    "ecn": client.ecn_opt_in, "pdf": None}
            if reached >= rank("archived") and (reached >= rank("delivered") or in_archive(ucc)):
                batch.items.append(item)
                continue
            try:
                todo.append((item, note_data(account, client, batch.trade_date, batch.settles, batch.broker_file)))
            except Exception as e:
                failed(ucc, e)
        rendered = []
        for (item, _), pdf in zip(todo, render_notes([note for _, note in todo])):
            if isinstance(pdf, Exception):
                failed(item["ucc"], pdf)
                continue
            item["pdf"] = pdf
            rendered.append(item)
        for item, made in zip(rendered, user_halves([item["pan"] for item in rendered], encryption)):
            if made:
                item["made"] = made
            batch.items.append(item)
            writer.add(Outcome(item["ucc"], "rendered"))
    batch.timed("render", started)
    return batch


def note_data(account: dict, client: Client, trade_date: str, settles: dict[str, str], broker_file: str = "") -> dict:
    """An account of a shard file to its note's data, with the cycle collector paused: a huge
    note's trades and rows live until the note is built, and the collections their allocation
    set off scanned them again and again, 40% of a 125,000-trade note's build (10.8 -> 6.3 s).
    What is freed meanwhile is freed by reference counts; a cycle waits for the next collection."""
    enabled = gc.isenabled()  # paused in place: a context manager made of a generator cost ~2 µs a note
    gc.disable()
    try:
        trades = list(map(Trade.from_row, account["trades"]))  # the classmethod bound once, not a row
        b = broker(broker_file)
        charges = compute(trades, trade_date, client.gst_state_code == b["gst_state_code"], b["tariff"])
        return build_note(client, trades, charges, b, trade_date, account["note_no"], settles)
    finally:
        if enabled:
            gc.enable()


def sign_stage(batch: Batch, signer, owner_password: str, encryption: str, store: Store,
               state: RunState, info: SignatureInfo = SignatureInfo()) -> Batch:
    """Sign and encrypt, then archive: the signed PDF is in storage before any mail leaves, each
    note written while the next is signed (to S3, a round trip each). Only for the driver
    holding the run. The archive is what the client got: a note whose mail was claimed is not
    signed again (it may have gone out), and a note archived by an earlier attempt is never
    replaced (_archived): the item carries the archived bytes. The HSM's outages while it ran go
    in the batch's waits (the report's time waited on the HSM)."""
    started, since = time.process_time(), time.time()
    if not state.holds_lease(batch.lease):
        if state.lease_holder() is None:  # Redis lost the run (its epoch too): say that, as a claim would
            raise StateLostError(f"Redis no longer holds run {batch.run_id}: nothing signed or archived; run the "
                                 "same run id again to rebuild its state from the delivery log")
        raise LeaseLostError(f"run {batch.run_id}: the driver of shard {batch.shard} no longer holds the run: "
                             "nothing signed or archived")
    made = {i["ucc"]: i.pop("made", None) for i in batch.items}  # the file keys go no further
    claimed = state.claimed([i["ucc"] for i in batch.items if i["pdf"] is not None])
    for item in batch.items:
        if item["ucc"] in claimed:
            item["pdf"] = None  # mailed, or being mailed, from the archive
    todo = [item for item in batch.items if item["pdf"] is not None]
    notes = [(i["pdf"], i["pan"], made[i["ucc"]]) for i in todo]
    aside = not isinstance(store, FolderStore)  # to S3, each note archived while the next is signed
    archived: dict[int, Future] = {}
    try:
        for item, signed in zip(todo, protect_each(notes, owner_password, signer, info, encryption)):
            item["pdf"] = signed  # the signed note, or why it could not be signed
            if isinstance(signed, bytes):
                write = partial(_or_storage_error, _archived, store, batch.trade_date, item["ucc"], signed)
                archived[id(item)] = _ARCHIVE_WRITES.submit(write) if aside else _done(write())
    finally:  # nothing of the batch goes on, nor fails, while a write of it is under way
        wait(archived.values())
    kept = []
    with StateWriter(state) as writer:
        for item in batch.items:
            if item["pdf"] is None:
                kept.append(item)
                continue
            if isinstance(item["pdf"], SignError):
                writer.add(Outcome(item["ucc"], "signed", "failed", reason=f"sign: {item['pdf']}"))
                batch.drop("failed")
                continue
            writer.add(Outcome(item["ucc"], "signed"))
            item["pdf"] = archived[id(item)].result()
            if isinstance(item["pdf"], Exception):
                writer.add(Outcome(item["ucc"], "archived", "failed", reason=f"archive: {item['pdf']}"))
                batch.drop("failed")
                continue
            writer.add(Outcome(item["ucc"], "archived"))
            kept.append(item)
    batch.items = kept
    batch.timed("sign", started)
    batch.waits += [("hsm", start, end) for start, end in signer.outages(since)]
    return batch


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _or_storage_error(fn, *args):
    """What a storage call gives, or its error, for the note to fail alone: storage errors come
    in many types (StorageError, OSError, obstore's)."""
    try:
        return fn(*args)
    except Exception as e:
        return e


def _archived(store: Store, trade_date: str, ucc: str, signed: bytes) -> bytes:
    """The note as the archive holds it. Archived once, create-only: another attempt of the same
    batch (the fleet resending a lost actor's batch, a rerun) that got there first keeps its
    signature, and this attempt carries those bytes on to be mailed, not the ones it just signed,
    so the client gets exactly what the archive holds."""
    kept = write_once(store, keys.signed_pdf_key(trade_date, ucc), signed)
    if kept != signed:
        log.info("account %s: archived by an earlier attempt; its archived note goes on", ucc)
    return kept


@dataclass
class MailContext:
    pool: SmtpPool
    state: RunState
    store: Store
    letter: Letter
    policy: RetryPolicy = RetryPolicy()
    force: bool = False
    resend_unconfirmed: bool = False  # rerun --unconfirmed: the same Message-ID again
    epoch: str = ""  # the run's epoch in Redis: claims are refused if Redis lost the run
    sending: asyncio.Semaphore | None = None  # one per connection: claim only what can leave now
    verp: Verp | None = None  # each message's envelope sender (None: the From header's address)
    link_base: str = ""  # the client's link to their note, in the e-mail's text ("": none)
    link_s: float = 90 * 86400
    key: bytes = b""  # the HMAC key of the links and the Message-IDs
    mid_domain: str = "contract-notes.invalid"  # the run's Message-IDs' domain (CN_MESSAGE_ID_DOMAIN)
    dkim: DkimSigner | None = None  # signs each message (CN_DKIM_*); None: unsigned, the relay may sign
    unrecorded: list[Outcome] = field(default_factory=list)  # relays' replies not yet in Redis (_record)
    record_timer: asyncio.TimerHandle | None = None
    flushes: set[asyncio.Task] = field(default_factory=set)  # records on their way to Redis (held: not collected)

    async def redis(self, call: Callable, *args):
        """A Redis call, off the event loop: during an outage it waits (up to the run's
        deadline) in a thread, while the loop goes on reading the relays' replies and
        answering the driver; storage's threads are not among those it holds."""
        return await asyncio.get_running_loop().run_in_executor(_REDIS_CALLS, call, *args)

    def mail_from(self, run_id: str, ucc: str) -> str:
        return self.verp.address(run_id, ucc) if self.verp else _envelope_sender(self.letter.sender)

    def note_link(self, run_id: str, ucc: str, trade_date: str) -> str:
        if not self.link_base:
            return ""
        return f"{self.link_base}/notes/{link.make(self.key, run_id, ucc, trade_date, self.link_s)}"

    def __post_init__(self) -> None:
        if self.sending is None:
            self.sending = asyncio.Semaphore(sum(r.options.size for r in self.pool.relays))


def mail_context(settings, state: RunState, store: Store, force: bool = False,
                 resend_unconfirmed: bool = False, dkim: DkimSigner | None = None,
                 epoch: str | None = None) -> MailContext:
    """Everything a mailer holds; call it on the event loop that will send. `dkim`: the key
    credentials.for_mailer loaded once for this mailer, never per message; `epoch`: the run's,
    read off the loop by an async caller (None: read here)."""
    options = PoolOptions(size=settings.smtp_connections, idle_s=settings.smtp_idle_s, wait_s=settings.smtp_wait_s,
                          max_messages=settings.smtp_max_per_conn, helo=settings.smtp_helo or None,
                          starttls=settings.smtp_starttls, ca_file=settings.smtp_ca_file or None,
                          patience_s=settings.smtp_patience_s, deadline_at=settings.deadline_at)
    b = broker(settings.broker_file)
    letter = Letter(settings.mail_from, settings.mail_reply_to, b["name"], parseaddr(settings.mail_reply_to)[1])
    epoch = state.epoch() if epoch is None else epoch
    if not epoch:
        raise StateLostError(f"Redis holds no run {state.run_id}: not mailing (run it again to rebuild its state)")
    key = settings.hmac_key()
    targets, domains = settings.smtp(), settings.domain_limits()
    buckets = RedisBuckets(settings.redis_url, settings.redis_patience_s, settings.deadline_at) if domains or any(t.rate for t in targets) else None
    return MailContext(SmtpPool(targets, options, buckets, domains), state, store, letter,
                       RetryPolicy(attempts=settings.smtp_attempts), force, resend_unconfirmed, epoch,
                       verp=Verp(settings.bounce_local, settings.bounce_domain, key),
                       link_base=settings.link_base.rstrip("/"), link_s=settings.link_days * 86400, key=key,
                       mid_domain=settings.message_id_domain, dkim=dkim)


async def mail_stage(batch: Batch, ctx: MailContext) -> dict:
    """Mail every item; returns the batch's tally (small: this is what the driver fetches).
    The delivery log gets the batch as "sending" before the first claim, and every outcome
    once the replies are in, even when the batch stops on an error."""
    started = time.process_time()
    mailable = [i for i in batch.items if _not_mailable(i) is None]
    for i in mailable:  # its VERP address and Message-ID (an HMAC each): sent with, and logged twice
        i["mail_from"] = ctx.mail_from(batch.run_id, i["ucc"])
        i["message_id"] = message_id(batch.run_id, i["ucc"], ctx.key, ctx.mid_domain)
    if mailable:  # storage calls block: off the event loop, which is busy with other batches' mail
        await asyncio.to_thread(_attach, ctx.store, batch.trade_date, mailable)
        intent = [delivery_log.sending(i["ucc"], i["message_id"], i["mail_from"], i["sha256"], i["md5"])
                  for i in mailable if "sha256" in i]
        end = await asyncio.to_thread(delivery_log.append, ctx.store, batch.run_id, batch.shard, intent, batch.log_end)
    results = await asyncio.gather(*(_mail_one(batch, item, ctx) for item in batch.items), return_exceptions=True)
    await asyncio.gather(_flush_records(ctx), *ctx.flushes, return_exceptions=True)  # Redis has them all, or the log
    outcomes = [r for r in results if isinstance(r, Outcome)]
    if mailable:
        sent = {i["ucc"]: i for i in mailable}
        logged = [delivery_log.entry(o, sent[o.ucc]["mail_from"], sent[o.ucc].get("sha256", ""))
                  for o in outcomes if o.stage == "delivered"]
        intended = {e["ucc"]: e["at"] for e in intent}
        logged += [delivery_log.not_sent(i["ucc"], str(r), intended.get(i["ucc"])) for i, r in zip(batch.items, results)
                   if isinstance(r, (StateLostError, LeaseLostError))]  # refused at the claim: nothing left
        await asyncio.to_thread(delivery_log.append, ctx.store, batch.run_id, batch.shard, logged, end)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    tally = dict(batch.dropped)
    for o in outcomes:
        tally[o.status] = tally.get(o.status, 0) + 1
    batch.timed("mail", started)
    return {"shard": batch.shard, "tally": tally, "cpu_s": batch.cpu_s, "notes": sum(tally.values()),
            "waits": batch.waits}


async def _mail_one(batch: Batch, item: dict, ctx: MailContext) -> Outcome:
    """Build, claim, send, record. The claim is taken only once the message is ready to leave
    (PDF read, message built, a relay answering), just before it does: a failure before that
    leaves no claim, and a crash leaves only the mails then in flight as unconfirmed."""
    outcome = _not_mailable(item)
    if outcome is not None:
        await ctx.redis(ctx.state.record, [outcome])
        return outcome
    async with ctx.sending:
        ucc, mid = item["ucc"], item["message_id"]
        try:
            pdf = item["pdf"]
            if isinstance(pdf, Exception):  # its archived note could not be read (_attach)
                raise pdf
            message = build_message(ctx.letter, item["name"], item["email"], batch.trade_date, ucc, mid, pdf,
                                    ctx.note_link(batch.run_id, ucc, batch.trade_date))
            if ctx.dkim is not None:
                message = ctx.dkim.sign(message)
        except Exception as e:  # storage, or a message that cannot be built: nothing has left
            outcome = Outcome(ucc, "delivered", "failed", reason=f"mail not built, nothing sent: {e}"[:300])
            await ctx.redis(ctx.state.record, [outcome])
            return outcome
        await ctx.pool.ready()
        resend = ctx.force or (ctx.resend_unconfirmed and await ctx.redis(_is_unconfirmed, ucc, ctx))
        token = claim_token(batch.lease)
        claimed = await ctx.state.claim_mail_async(ucc, mid, ctx.epoch, batch.lease, _unrecorded(ctx), ctx.redis,
                                                   token, bool(resend))
        outcome = await _send(item, ctx, mid, message, token) if claimed else \
            await ctx.redis(_already_claimed, ucc, ctx)
        if resend and not ctx.force:  # the first mail may have reached the client: kept from now on
            outcome.extra["possible_duplicate"] = True
        if outcome.status != "skipped":
            _record(ctx, outcome)
    return outcome


def _attach(store: Store, trade_date: str, items: list[dict]) -> None:
    """Each item's attachment and its SHA-256 and MD5 (hex), before the batch's "sending"
    entry, so the delivery log names the exact bytes each mail carries (and `verify` can prove
    the archive is what the client got). A note archived by an earlier attempt is read from the
    archive, a resent batch's together (a round trip each); one that cannot be read keeps its
    error as its `pdf`, and fails alone, unsent."""
    archived = [item for item in items if item["pdf"] is None]
    if archived:
        with ThreadPoolExecutor(min(16, len(archived)), "archive") as reads:
            names = [keys.signed_pdf_key(trade_date, item["ucc"]) for item in archived]
            for item, pdf in zip(archived, reads.map(partial(_or_storage_error, store.get), names)):
                item["pdf"] = pdf
    read = [item for item in items if not isinstance(item["pdf"], Exception)]
    for item, md5 in zip(read, md5_hex_all([item["pdf"] for item in read])):
        item["sha256"], item["md5"] = hashlib.sha256(item["pdf"]).hexdigest(), md5


def _record(ctx: MailContext, outcome: Outcome) -> None:
    """A relay's reply goes to Redis with the next claim, in its round trip (one a mail, not
    two), or RECORD_WAIT_S later if no claim comes first; if Redis fails then, the delivery
    log still gets it at the end of the batch, and a resumed run restores it from there."""
    ctx.unrecorded.append(outcome)
    if ctx.record_timer is None:
        ctx.record_timer = asyncio.get_running_loop().call_later(RECORD_WAIT_S, _flush_later, ctx)


def _flush_later(ctx: MailContext) -> None:
    task = asyncio.get_running_loop().create_task(_flush_records(ctx))
    ctx.flushes.add(task)
    task.add_done_callback(ctx.flushes.discard)


def _unrecorded(ctx: MailContext) -> list[Outcome]:
    if ctx.record_timer is not None:
        ctx.record_timer.cancel()
        ctx.record_timer = None
    outcomes, ctx.unrecorded = ctx.unrecorded, []
    return outcomes


async def _flush_records(ctx: MailContext) -> None:
    outcomes = _unrecorded(ctx)
    try:
        await ctx.redis(ctx.state.record, outcomes)
    except Exception as e:  # redis errors of every kind: the outcomes are not lost, they are in the batch's log
        log.warning("%d outcomes not recorded in Redis (kept in the delivery log): %s", len(outcomes), e)


def _is_unconfirmed(ucc: str, ctx: MailContext) -> bool:
    return ctx.state.accounts([ucc]).get(ucc, {}).get("status") == "unconfirmed"


@lru_cache(maxsize=8)
def _envelope_sender(header: str) -> str:
    return parseaddr(header)[1]


def _not_mailable(item: dict) -> Outcome | None:
    if not item["ecn"]:
        return Outcome(item["ucc"], "archived", "physical", reason="no ECN consent: physical dispatch")
    if not EMAIL.match(item["email"] or ""):
        return Outcome(item["ucc"], "archived", "physical", reason="missing or malformed e-mail: physical dispatch")
    return None


def _already_claimed(ucc: str, ctx: MailContext) -> Outcome:
    """Someone mailed, or tried to: a rerun, or Ray re-running this batch after a crash. With
    no outcome recorded, the mail may have reached the relay: unconfirmed, not resent. A
    forced rerun's claim is refused only when its own earlier attempt holds it: only an
    outcome recorded since that claim was taken is that attempt's, and the run's earlier
    delivery says nothing of whether this mailing left. Both times are that attempt's
    mailer's clock, but for a record Redis rebuilt from storage just before the claim (the
    rebuilding host's clock). Where the claim's time is not known, neither is the answer."""
    record = ctx.state.accounts([ucc]).get(ucc, {})
    mid = record.get("message_id") or message_id(ctx.state.run_id, ucc, ctx.key, ctx.mid_domain)
    if ctx.force and record.get("stage") == "delivered":
        since = ctx.state.claim_time(ucc)  # 0.0: not known
        if not (since and record.get("updated", 0.0) >= since):
            return Outcome(ucc, "delivered", "unconfirmed", message_id=mid, reason=forced_unanswered(
                ctx.state.run_id, ucc, "an earlier attempt of this rerun holds its claim, and no answer of the relay's was recorded"))
        if record.get("status") == "failed":  # that attempt's outcome, as recorded: never logged as a delivery
            return Outcome(ucc, "delivered", "failed", reason=record.get("reason", ""), message_id=mid)
    if record.get("stage") == "delivered" and not (ctx.force and record.get("status") == "unconfirmed"):
        return Outcome(ucc, "delivered", "skipped", reason="already delivered", message_id=mid,
                       reply=record.get("reply", ""))
    if record.get("status") == "unconfirmed":
        return Outcome(ucc, "delivered", "unconfirmed", reason=record.get("reason", ""), message_id=mid)
    return Outcome(ucc, "delivered", "unconfirmed", message_id=mid, reason=(
        "claimed by an attempt that ended before the relay's answer: settle with reconcile --relay-log, "
        "or rerun --unconfirmed (same Message-ID)"))


def forced_unanswered(run_id: str, ucc: str, why: str) -> str:
    """A forced mail's answer lost. Its Message-ID is the run's earlier mail's, so the relay's log
    cannot tell the two apart: mailing it again is the one way to be sure, at a possible extra copy."""
    return f"{why}: this forced mail may or may not have left; {forced_again(run_id, ucc)} (a possible extra copy)"


def forced_again(run_id: str, ucc: str) -> str:
    """The command a forced mail that failed, or whose answer was lost, is sent again with."""
    return f"rerun {run_id} --accounts {ucc} --force mails it again"


async def _send(item: dict, ctx: MailContext, mid: str, message: bytes, token: str) -> Outcome:
    ucc = item["ucc"]
    try:
        reply, attempts = await send_with_retry(ctx.pool, ctx.policy, item["mail_from"], item["email"], message)
    except UnconfirmedMailError as e:  # the claim stays: never resent blindly
        return Outcome(ucc, "delivered", "unconfirmed", message_id=mid, extra={"attempts": e.attempts},
                       reason=forced_unanswered(ctx.state.run_id, ucc, str(e)) if ctx.force else
                       f"{e}: settle with reconcile --relay-log, or rerun --unconfirmed (same Message-ID)")
    except QuotaError as e:
        await ctx.redis(ctx.state.release_mail, ucc, token)
        return Outcome(ucc, "delivered", "failed", reason=str(e), message_id=mid, extra={"attempts": e.attempts})
    except PermanentMailError as e:
        await ctx.redis(ctx.state.release_mail, ucc, token)
        return Outcome(ucc, "delivered", "failed", reason=f"smtp permanent: {e}", message_id=mid,
                       extra={"attempts": e.attempts})
    except TransientMailError as e:
        await ctx.redis(ctx.state.release_mail, ucc, token)
        return Outcome(ucc, "delivered", "failed", reason=f"smtp gave up after {e.attempts} attempts: {e}",
                       message_id=mid, extra={"attempts": e.attempts})
    return Outcome(ucc, "delivered", message_id=mid, reply=reply, extra={"attempts": attempts})
