"""The per-shard work of stages 2-4, as plain functions over a batch.

A batch is what travels between stages through Ray's object store: the accounts of one
shard, with their PDF bytes once rendered, plus the CPU time each stage spent on it. The
same functions run inside Ray tasks and actors and in the benchmark's sequential loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from email.utils import parseaddr
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from pipeline import keys
from pipeline.charges import compute
from pipeline.dumps import EMAIL, Client, Trade
from pipeline.mail import (Letter, PermanentMailError, PoolOptions, RetryPolicy, SmtpPool, TransientMailError,
                           build_message, message_id, send_with_retry)
from pipeline.notes import build_note
from pipeline.render import TEMPLATES, RenderError, render
from pipeline.sign import SignatureInfo, SignError, protect
from pipeline.state import Outcome, RunState, StateWriter, rank
from pipeline.storage import Store


@dataclass
class Batch:
    run_id: str
    trade_date: str
    shard: int
    items: list[dict] = field(default_factory=list)  # ucc, name, email, pan, ecn, pdf
    cpu_s: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # accounts that left the batch early, by status
    settles: dict[str, str] = field(default_factory=dict)  # exchange -> settlement date (ISO)

    def drop(self, status: str) -> None:
        self.dropped[status] = self.dropped.get(status, 0) + 1

    def timed(self, stage: str, started: float) -> None:
        self.cpu_s[stage] = self.cpu_s.get(stage, 0.0) + time.process_time() - started


@lru_cache(maxsize=1)
def broker() -> dict:
    return json.loads((TEMPLATES / "broker.json").read_text())


def load_shard(store: Store, run_id: str, shard: int) -> list[dict]:
    return [json.loads(line) for line in store.get(keys.shard_key(run_id, shard)).decode().splitlines()]


def render_stage(batch: Batch, accounts: list[dict], state: RunState, only: set[str] | None = None,
                 render_note: Callable[[dict], bytes] = render, force: bool = False) -> Batch:
    """Render every account of the shard that still needs it; an account already archived is
    passed on to be mailed from the archive, one already delivered is left alone (unless
    `force`: then it is mailed again, from the archive). `only` limits a targeted rerun.
    `render_note` lets the Ray task render a huge note as page ranges in parallel."""
    started = time.process_time()
    records = state.accounts([a["ucc"] for a in accounts])
    with StateWriter(state) as writer:
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
            if reached >= rank("archived"):
                batch.items.append(item)
                continue
            try:
                item["pdf"] = render_note(_note(account, client, batch.trade_date, batch.settles))
            except Exception as e:  # one account's bad data fails that account, never its shard-mates
                why = str(e) if isinstance(e, RenderError) else f"{type(e).__name__}: {e}"
                writer.add(Outcome(ucc, "rendered", "failed", reason=f"render: {why}"[:300]))
                batch.drop("failed")
                continue
            batch.items.append(item)
            writer.add(Outcome(ucc, "rendered"))
    batch.timed("render", started)
    return batch


def _note(account: dict, client: Client, trade_date: str, settles: dict[str, str]) -> dict:
    trades = [Trade.from_row(r) for r in account["trades"]]
    b = broker()
    charges = compute(trades, trade_date, client.gst_state_code == b["gst_state_code"], b["tariff"])
    return build_note(client, trades, charges, b, trade_date, account["note_no"], settles)


def sign_stage(batch: Batch, signer, owner_password: str, encryption: str, store: Store,
               state: RunState, info: SignatureInfo = SignatureInfo()) -> Batch:
    """Sign and encrypt, then archive: the signed PDF is in storage before any mail leaves."""
    started = time.process_time()
    kept = []
    with StateWriter(state) as writer:
        for item in batch.items:
            if item["pdf"] is None:
                kept.append(item)
                continue
            try:
                item["pdf"] = protect(item["pdf"], item["pan"], owner_password, signer, info, encryption)
            except SignError as e:
                writer.add(Outcome(item["ucc"], "signed", "failed", reason=f"sign: {e}"))
                batch.drop("failed")
                continue
            writer.add(Outcome(item["ucc"], "signed"))
            try:
                store.put(keys.signed_pdf_key(batch.trade_date, item["ucc"]), item["pdf"])
            except Exception as e:  # storage errors come in many types (OSError, botocore)
                writer.add(Outcome(item["ucc"], "archived", "failed", reason=f"archive: {e}"))
                batch.drop("failed")
                continue
            writer.add(Outcome(item["ucc"], "archived"))
            kept.append(item)
    batch.items = kept
    batch.timed("sign", started)
    return batch


@dataclass
class MailContext:
    pool: SmtpPool
    state: RunState
    store: Store
    letter: Letter
    policy: RetryPolicy = RetryPolicy()
    force: bool = False
    sending: asyncio.Semaphore | None = None  # one per connection: claim only what can leave now

    def __post_init__(self) -> None:
        if self.sending is None:
            self.sending = asyncio.Semaphore(sum(r.options.size for r in self.pool.relays))


def mail_context(settings, state: RunState, store: Store, force: bool = False) -> MailContext:
    """Everything a mailer holds; call it on the event loop that will send."""
    options = PoolOptions(size=settings.smtp_connections, idle_s=settings.smtp_idle_s, wait_s=settings.smtp_wait_s,
                          max_messages=settings.smtp_max_per_conn, helo=settings.smtp_helo or None,
                          starttls=settings.smtp_starttls, ca_file=settings.smtp_ca_file or None)
    b = broker()
    letter = Letter(settings.mail_from, settings.mail_reply_to, b["name"], b["compliance_officer"]["email"])
    return MailContext(SmtpPool(settings.smtp(), options), state, store, letter,
                       RetryPolicy(attempts=settings.smtp_attempts), force)


async def mail_stage(batch: Batch, ctx: MailContext) -> dict:
    """Mail every item; returns the batch's tally (small: this is what the driver fetches)."""
    started = time.process_time()
    outcomes = await asyncio.gather(*(_mail_one(batch, item, ctx) for item in batch.items))
    tally = dict(batch.dropped)
    for o in outcomes:
        tally[o.status] = tally.get(o.status, 0) + 1
    batch.timed("mail", started)
    return {"shard": batch.shard, "tally": tally, "cpu_s": batch.cpu_s, "notes": sum(tally.values())}


async def _mail_one(batch: Batch, item: dict, ctx: MailContext) -> Outcome:
    """Build, claim, send, record. The claim is taken only once the message is ready to leave
    (PDF read, message built), just before it does: a failure before that leaves no claim, and
    a crash leaves only the mails then in flight unresolved (reported, never resent)."""
    outcome = _not_mailable(item)
    if outcome is not None:
        ctx.state.record([outcome])
        return outcome
    async with ctx.sending:
        ucc, mid = item["ucc"], message_id(batch.run_id, item["ucc"])
        try:
            pdf = item["pdf"]
            if pdf is None:  # archived on an earlier attempt: mailed from the archive
                pdf = ctx.store.get(keys.signed_pdf_key(batch.trade_date, ucc))
            message = build_message(ctx.letter, item["name"], item["email"], batch.trade_date, ucc, mid, pdf)
        except Exception as e:  # storage, or a message that cannot be built: nothing has left
            outcome = Outcome(ucc, "delivered", "failed", reason=f"mail not built, nothing sent: {e}"[:300])
            ctx.state.record([outcome])
            return outcome
        if ctx.force:
            ctx.state.release_mail(ucc)
        claimed = ctx.state.claim_mail(ucc, mid)
        outcome = await _send(item, ctx, mid, message) if claimed else _already_claimed(ucc, ctx)
        if outcome.status != "skipped":
            ctx.state.record([outcome])  # right after the relay's answer: the delivery log
    return outcome


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
    """Someone mailed, or tried to: a rerun, or Ray re-running this batch after a crash."""
    record = ctx.state.accounts([ucc]).get(ucc, {})
    if record.get("stage") == "delivered":
        return Outcome(ucc, "delivered", "skipped", reason="already delivered")
    return Outcome(ucc, "delivered", "failed", reason=(
        "mail claimed by an earlier attempt that recorded no outcome; not resent "
        "(check the relay log, then rerun with --force)"))


async def _send(item: dict, ctx: MailContext, mid: str, message: bytes) -> Outcome:
    ucc = item["ucc"]
    try:
        reply, attempts = await send_with_retry(ctx.pool, ctx.policy, _envelope_sender(ctx.letter.sender),
                                                item["email"], message)
    except PermanentMailError as e:
        ctx.state.release_mail(ucc)
        return Outcome(ucc, "delivered", "failed", reason=f"smtp permanent: {e}", message_id=mid)
    except TransientMailError as e:
        ctx.state.release_mail(ucc)
        return Outcome(ucc, "delivered", "failed", reason=f"smtp gave up after {ctx.policy.attempts} attempts: {e}",
                       message_id=mid)
    return Outcome(ucc, "delivered", message_id=mid, reply=reply, extra={"attempts": attempts})
