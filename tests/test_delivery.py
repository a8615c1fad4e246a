"""Delivery against a real SMTP server that misbehaves on purpose: every account ends either
delivered exactly once (counted at the server by Message-ID) or failed with the reason."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import random
import smtplib
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from pipeline.cluster.driver import RunRequest, run_day
from pipeline.embedded import free_port, start_smtp_sink
from pipeline.mail.message import (
    ConnectError,
    Letter,
    PermanentMailError,
    RelayDownError,
    TransientMailError,
    UnconfirmedMailError,
    build_message,
)
from pipeline.mail.relay import PoolOptions, RetryPolicy, SmtpPool, send_with_retry
from pipeline.mail.smtp_sink import DATA_LIMIT, Faults, OutboxHandler, SinkController, has_long_line
from pipeline.record import keys
from pipeline.record.state import RunState
from pipeline.settings import parse_smtp_url
from pipeline.stages import Batch
from tests import servers
from tests.conftest import TRADE_DATE
from tests.helpers import attachment, client_rows, outbox_messages

LETTER = Letter("Notes <notes@broker.example.com>", "Desk <desk@broker.example.com>")


def received(outbox: Path) -> Counter:
    return Counter(m["Message-ID"] for m in outbox_messages(outbox))


def report_rows(settings, run_id: str) -> dict[str, dict]:
    path = Path(settings.store_url) / keys.report_keys(run_id)[1]
    return {r["ucc"]: r for r in csv.DictReader(path.open())}


@pytest.mark.parametrize("chunking", [True, False])
def test_faults_end_in_delivered_once_or_failed_or_unconfirmed_with_the_reason(ray_session, settings, day, smtp_server,
                                                                                chunking):
    """The same faults to a relay offering CHUNKING (the mails as BDAT) and to one that does not (DATA)."""
    clients = client_rows(day)
    emails = {c["email"]: u for u, c in clients.items()}
    by_ucc = sorted(clients)
    rejected, tempfail, dropped = by_ucc[1], by_ucc[2], by_ucc[3]
    server = smtp_server(refuse_connections=2, reject={clients[rejected]["email"]}, chunking=chunking,
                         tempfail_once={clients[tempfail]["email"]}, drop_once={clients[dropped]["email"]})
    faulty = settings.__class__(**{**settings.__dict__, "smtp_url": server.url})

    summary = run_day(faulty, RunRequest(TRADE_DATE, str(day)))

    counts = received(server.outbox)
    assert all(n == 1 for n in counts.values()), f"duplicates: {[m for m, n in counts.items() if n > 1]}"
    delivered_to = {emails[m["To"].addresses[0].addr_spec] for m in outbox_messages(server.outbox)}
    rows = report_rows(settings, summary["run_id"])
    for ucc, row in rows.items():
        if row["status"] == "delivered":
            assert ucc in delivered_to and row["message_id"]
        else:
            assert row["status"] in ("failed", "unconfirmed") and row["reason"], row
    assert rows[rejected]["status"] == "failed" and "550" in rows[rejected]["reason"]
    assert rows[rejected]["physical_dispatch"] == "Y"
    assert tempfail in delivered_to, "a 451 is retried"
    assert rows[dropped]["status"] == "unconfirmed" and rows[dropped]["message_id"], "a drop after the dot is not"
    assert dropped not in delivered_to
    assert (summary["delivered"], summary["unconfirmed"]) == (summary["accounts"] - 2, 1)
    report = json.loads((Path(settings.store_url) / keys.report_keys(summary["run_id"])[0]).read_text())
    assert rejected in report["physical_dispatch"]


def test_a_mailer_killed_mid_batch_mails_no_account_twice(ray_session, settings, smtp_server, tmp_path):
    """The mailer dies mid-batch; Ray does not run the batch again (the fleet's RECOVERY), the
    fleet resends it to a new mailer, and the mail guard leaves the mails then in flight
    unconfirmed, never sent twice."""
    import ray

    from actors.mailer import MailerActor
    from pipeline.cluster.fleet import RECOVERY

    server = smtp_server(delay_ms=3)
    slow = settings.__class__(**{**settings.__dict__, "smtp_url": server.url, "smtp_connections": 2})
    run_id = f"kill-mail-{uuid.uuid4().hex[:6]}"
    pdf = b"%PDF-1.7\n" + b"0" * 20_000
    uccs = [f"M{i:05d}" for i in range(150)]
    items = [{"ucc": u, "name": "Client", "email": f"{u.lower()}@example.com", "pan": "ABCPD1234E", "ecn": True,
              "pdf": pdf} for u in uccs]
    RunState(settings.redis_url, run_id).start({})
    lease = RunState(settings.redis_url, run_id).take_lease(120).token
    actor = MailerActor.options(name=f"mailer-{run_id}", **RECOVERY).remote(slow, run_id)
    ref = actor.send.remote(Batch(run_id, TRADE_DATE, 0, items, lease=lease))
    deadline = time.monotonic() + 60
    while len(list(server.outbox.glob("*.eml"))) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    ray.kill(actor, no_restart=False)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=120)

    again = MailerActor.options(name=f"mailer-again-{run_id}", **RECOVERY).remote(slow, run_id)
    result = ray.get(again.send.remote(Batch(run_id, TRADE_DATE, 0, items, lease=lease)), timeout=120)

    counts = received(server.outbox)
    assert 10 <= sum(counts.values()) < len(uccs) + 1
    assert all(n == 1 for n in counts.values()), "an account was mailed twice"
    state = RunState(settings.redis_url, run_id)
    records = state.accounts(uccs)
    mailed = {m.split(".")[1].split("@")[0] for m in counts}
    unresolved = []
    for ucc in uccs:
        rec = records[ucc]
        if rec["stage"] == "delivered":
            assert ucc in mailed
        else:
            assert rec["status"] == "unconfirmed" and "rerun --unconfirmed" in rec["reason"], rec
            unresolved.append(ucc)
    assert len(unresolved) <= slow.smtp_connections, "only mails in flight at the kill may be unconfirmed"
    assert result["notes"] == len(uccs)


def test_each_mailing_entry_of_the_log_names_the_sha256_of_the_attachment_the_relay_received(settings, smtp_sink):
    """What the client got, proved from the record: the "sending" and "delivered" entries of the
    delivery log carry the SHA-256 of the exact PDF attached, whether this attempt signed it or
    read it from the archive (an earlier attempt's), as the relay's received .eml shows."""
    from pipeline.record import delivery_log
    from pipeline.record.storage import open_store
    from pipeline.stages import mail_context, mail_stage

    run_id = f"sha-{uuid.uuid4().hex[:6]}"
    store, state = open_store(settings.store_url), RunState(settings.redis_url, run_id)
    state.start({})
    lease = state.take_lease(120).token
    items = [{"ucc": f"H{i:03d}", "name": "Client", "email": f"h{i}@example.com", "pan": "ABCPD1234E", "ecn": True,
              "pdf": b"%PDF-1.7\n" + bytes([i]) * 5000} for i in range(6)]
    for item in items[3:]:  # archived by an earlier attempt: mailed from the archive
        store.put(keys.signed_pdf_key(TRADE_DATE, item["ucc"]), item.pop("pdf") + b"archived")
        item["pdf"] = None

    async def mail() -> dict:
        ctx = mail_context(settings, state, store)
        try:
            return await mail_stage(Batch(run_id, TRADE_DATE, 0, items, lease=lease), ctx)
        finally:
            await ctx.pool.close()

    assert run(mail())["tally"] == {"ok": 6}
    attached = {m["Message-ID"]: hashlib.sha256(attachment(m)[1]).hexdigest() for m in outbox_messages(smtp_sink.outbox)}
    logged = [e for e in delivery_log.entries(store, run_id, 0) if e["status"] in ("sending", "delivered")]
    assert sorted(e["status"] for e in logged) == ["delivered"] * 6 + ["sending"] * 6
    assert all(e["sha256"] == attached[e["message_id"]] for e in logged), "the log names other bytes than were mailed"
    archived = items[3]["ucc"]
    assert attached[next(e["message_id"] for e in logged if e["ucc"] == archived)] == hashlib.sha256(
        store.get(keys.signed_pdf_key(TRADE_DATE, archived))).hexdigest()


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def message(i: int) -> bytes:
    return build_message(LETTER, "Client", f"c{i}@example.com", TRADE_DATE, f"C{i}", f"<m{i}@x>", b"%PDF-1.7")


def test_a_refused_recipient_leaves_a_connection_that_is_reset_before_reuse(smtp_server):
    server = smtp_server(reject={"c1@example.com"})

    async def go():
        pool = SmtpPool([parse_smtp_url(server.url)], PoolOptions(size=1))
        with pytest.raises(Exception, match="550"):
            await pool.send("notes@broker.example.com", "c1@example.com", message(1))
        reply = await pool.send("notes@broker.example.com", "c2@example.com", message(2))  # no 503 nested MAIL
        relay = pool.relays[0]
        await pool.close()
        return reply, relay

    reply, relay = run(go())
    assert reply.startswith("OK")
    assert [m["Message-ID"] for m in outbox_messages(server.outbox)] == ["<m2@x>"]


def test_a_421_connection_is_never_reused_and_a_new_one_is_made(smtp_server):
    server = smtp_server(refuse_connections=1)

    async def go():
        pool = SmtpPool([parse_smtp_url(server.url)], PoolOptions(size=1))
        relay = pool.relays[0]
        with pytest.raises(ConnectError, match="421"):
            await relay.send("notes@broker.example.com", "c1@example.com", message(1))
        await relay.send("notes@broker.example.com", "c1@example.com", message(1))
        await pool.close()

    run(go())
    assert len(outbox_messages(server.outbox)) == 1


def test_a_relay_that_refuses_trips_its_breaker_and_the_send_waits_instead_of_failing(smtp_server):
    server = smtp_server(refuse_connections=3)

    async def go():
        pool = SmtpPool([parse_smtp_url(server.url)], PoolOptions(size=1))
        started = time.monotonic()
        reply = await pool.send("notes@broker.example.com", "c1@example.com", message(1))
        waited = time.monotonic() - started
        await pool.close()
        return reply, waited, pool.relays[0].breaker.closed()

    reply, waited, closed = run(go())
    assert reply.startswith("OK") and closed
    assert 0.5 * (1 + 2 + 4) * 0.9 < waited < 10, "three refusals: probes after 0.5, 1 and 2 s"


def test_a_relay_that_never_greets_fails_its_mails_after_the_patience_not_per_mail(tmp_path):
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts connections, never says a word
    port = silent.getsockname()[1]

    async def go():
        pool = SmtpPool([parse_smtp_url(f"smtp://127.0.0.1:{port}")],
                        PoolOptions(size=2, connect_timeout_s=0.5, patience_s=2.0))
        started = time.monotonic()
        results = await asyncio.gather(*(send_with_retry(pool, RetryPolicy(), "n@broker.example.com",
                                                         f"c{i}@example.com", message(i)) for i in range(8)),
                                       return_exceptions=True)
        await pool.close()
        return results, time.monotonic() - started

    try:
        results, took = run(go())
    finally:
        silent.close()
    assert all(isinstance(r, RelayDownError) for r in results), results
    assert "no relay reachable" in str(results[0])
    assert took < 6, f"8 mails to a silent relay took {took:.1f} s: bounded by the patience, not linear"


def test_a_relay_down_past_its_patience_is_waited_for_until_the_run_s_deadline(tmp_path):
    """CN_SMTP_PATIENCE_S of 1 s, the relay (the sink, a process of its own) stopped for 4 s,
    the run's deadline a minute off: the mail waits and leaves once the relay is back, and the
    outage is told as it begins and as it ends (what the run's page shows). Before, the mail
    failed after 1 s ("no relay reachable"), whatever time the day had left."""
    relay = start_smtp_sink(tmp_path / "outbox", tmp_path / "sink.log")
    port = int(relay.url.rsplit(":", 1)[1])
    relay.stop()
    told, back = [], []

    def restart() -> None:
        time.sleep(4)
        back.append(start_smtp_sink(tmp_path / "outbox", tmp_path / "sink.log", port=port))

    async def go():
        pool = SmtpPool([parse_smtp_url(relay.url)], PoolOptions(size=1, patience_s=1.0,
                                                                 deadline_at=time.time() + 60))
        pool.told = told.append
        started = time.monotonic()
        restarting = asyncio.get_running_loop().run_in_executor(None, restart)
        reply = await pool.send("notes@broker.example.com", "c1@example.com", message(1))
        await restarting
        await pool.close()
        return reply, time.monotonic() - started

    try:
        reply, waited = run(go())
    finally:
        for service in back:
            service.stop()
    assert reply.startswith("OK") and waited > 3.5, (reply, waited)
    assert len(told) == 2 and told[0] > 0 and told[1] == 0.0, told
    assert len(outbox_messages(tmp_path / "outbox")) == 1


@pytest.mark.parametrize("silent_at, error", [(b"DATA", TransientMailError), (b".", UnconfirmedMailError)])
def test_a_relay_silent_mid_transaction_is_given_up_at_the_deadline_and_its_connection_closed(silent_at, error):
    """One deadline a transaction (timeout_s): a relay that stops answering at DATA leaves the
    mail transient (resent on a new connection); one silent after the message's dot leaves it
    unconfirmed: it may have the message, so it is never resent blindly."""
    sessions = []

    async def session(reader, writer):
        sessions.append(writer)
        writer.write(b"220 relay\r\n")
        while line := await reader.readline():
            verb = line.split()[0].upper()
            if verb == b"DATA" and silent_at != b"DATA":
                writer.write(b"354 go on\r\n")
                while await reader.readline() not in (b".\r\n", b""):
                    pass
                if silent_at != b".":
                    writer.write(b"250 queued\r\n")
            elif verb != b"DATA":
                writer.write(b"250 ok\r\n")

    async def go():
        server = await asyncio.start_server(session, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = SmtpPool([parse_smtp_url(f"smtp://127.0.0.1:{port}")], PoolOptions(size=1, timeout_s=0.5))
        started = time.monotonic()
        with pytest.raises(error):
            await pool.send("notes@broker.example.com", "c1@example.com", message(1))
        took, idle = time.monotonic() - started, list(pool.relays[0]._idle)
        await pool.close()
        server.close()
        return took, idle

    took, idle = run(go())
    assert 0.5 <= took < 3 and idle == [] and len(sessions) == 1


def pipelining_relay(sessions: list, reads: list, cut: int = 1000, after_refused_rcpt: bytes = b"554 no valid recipients",
                     chunking: bool = False, messages: list | None = None):
    """A relay offering PIPELINING (RFC 2920), and CHUNKING (RFC 3030) if told, that answers
    what each read brought in one write, as Postfix's smtpd flushes its replies, cut into
    pieces of `cut` bytes. It refuses c1@; the messages it takes go to `messages`."""

    async def session(reader, writer):
        sessions.append(writer)
        writer.write(b"220 relay\r\n")
        buffered, refused, in_data, chunk_left, data = b"", False, False, 0, b""
        while chunk := await reader.read(65536):
            reads.append(chunk)
            buffered += chunk
            replies = b""
            while buffered and (chunk_left or b"\n" in buffered):
                if chunk_left:  # a BDAT chunk's bytes, read whatever the envelope's replies were
                    take = buffered[:chunk_left]
                    data, buffered, chunk_left = data + take, buffered[len(take):], chunk_left - len(take)
                    if not chunk_left:
                        taken = not refused
                        replies += b"250 2.0.0 queued as 7\r\n" if taken else after_refused_rcpt + b"\r\n"
                        if taken and messages is not None:
                            messages.append(data)
                    continue
                line, buffered = buffered.split(b"\n", 1)
                if in_data:
                    if line == b".\r":
                        in_data, replies = False, replies + b"250 2.0.0 queued as 7\r\n"
                        if messages is not None:
                            messages.append(data)
                    else:
                        data += line + b"\n"
                    continue
                verb = line[:4].upper()
                if verb == b"EHLO":
                    replies += b"250-relay\r\n250-PIPELINING\r\n" + (b"250-CHUNKING\r\n" if chunking else b"") + \
                        b"250 HELP\r\n"
                elif verb == b"RCPT":
                    refused = b"c1@" in line
                    replies += b"550 5.1.1 user unknown\r\n" if refused else b"250-2.1.5 recipient\r\n250 2.1.5 ok\r\n"
                elif verb == b"DATA":
                    reply = after_refused_rcpt if refused else b"354 go on"
                    in_data, data, replies = reply.startswith(b"354"), b"", replies + reply + b"\r\n"
                elif verb == b"BDAT":
                    chunk_left, data = int(line.split()[1]), b""
                else:
                    replies += b"250 2.0.0 ok\r\n"
            for i in range(0, len(replies), cut):
                writer.write(replies[i:i + cut])
                await writer.drain()
                await asyncio.sleep(0.002)

    return session


def through_relay(session, sends: list[tuple[str, bytes]]) -> list:
    """Each mail's reply, or its error, sent in turn through a pool of one connection to a
    relay serving `session`."""

    async def go():
        server = await asyncio.start_server(session, "127.0.0.1", 0)
        pool = SmtpPool([parse_smtp_url(f"smtp://127.0.0.1:{server.sockets[0].getsockname()[1]}")],
                        PoolOptions(size=1, timeout_s=5))
        replies = []
        for recipient, data in sends:
            try:
                replies.append(await pool.send("n@broker.example.com", recipient, data))
            except Exception as e:
                replies.append(e)
        await pool.close()
        server.close()
        return replies

    return run(go())


@pytest.mark.parametrize("chunking", [False, True])
@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_a_relay_offering_pipelining_gets_mail_rcpt_and_data_in_one_write_and_its_replies_read_however_cut(
        cut, chunking):
    """Two round trips a mail, not four; with CHUNKING offered too, one: MAIL, RCPT and
    `BDAT n LAST` with the message in one write, byte for byte (no end mark, nothing stuffed).
    The relay's replies to a group come back in one write, or cut into pieces (a multi-line
    reply among them): all are read, and the connection carries the next mail."""
    sessions, reads, taken = [], [], []
    mails = {i: message(i) for i in (2, 3)}
    relay = pipelining_relay(sessions, reads, cut, chunking=chunking, messages=taken)

    assert through_relay(relay, [(f"c{i}@example.com", m) for i, m in mails.items()]) == ["2.0.0 queued as 7"] * 2
    assert taken == list(mails.values())
    groups = [r for r in reads if r.startswith(b"MAIL")]
    assert groups == [b"MAIL FROM:<n@broker.example.com>\r\nRCPT TO:<c%d@example.com>\r\n" % i +
                      (b"BDAT %d LAST\r\n" % len(m) + m if chunking else b"DATA\r\n") for i, m in mails.items()]
    assert len(sessions) == 1


@pytest.mark.parametrize("data_reply, sessions_after, chunking", [(b"554 5.5.1 no valid recipients", 1, False),
                                                                  (b"354 go on", 2, False),
                                                                  (b"554 5.5.1 no valid recipients", 1, True)])
def test_a_refused_recipient_in_a_pipelined_group_fails_on_its_own_reply(data_reply, sessions_after, chunking):
    """The mail fails on the RCPT's 550, not on DATA's answer after it. A DATA refused too
    leaves the connection reset and reused; a relay that said 354 all the same waits for data
    nobody will send: that connection is closed, and the next mail takes a new one. With BDAT,
    the relay reads the chunk sent with the refused RCPT and refuses it: nothing is taken, and
    the session, reset, carries the next mail."""
    sessions, reads, taken = [], [], []
    relay = pipelining_relay(sessions, reads, after_refused_rcpt=data_reply, chunking=chunking, messages=taken)

    refused, reply = through_relay(relay, [("c1@example.com", message(1)), ("c2@example.com", message(2))])

    assert isinstance(refused, PermanentMailError) and "550 5.1.1 user unknown" in str(refused)
    assert reply == "2.0.0 queued as 7" and len(taken) == 1
    assert len(sessions) == sessions_after
    assert (b"RSET\r\n" in reads) == (sessions_after == 1)
    assert b"".join(reads).count(b" LAST\r\n") == (2 if chunking else 0)


def bdat_relay(sessions: list, refused: bytes = b""):
    """A relay offering PIPELINING and CHUNKING that takes a BDAT chunk and never answers; or,
    told `refused`, answers MAIL, refuses RCPT with it, and hangs up."""

    async def session(reader, writer):
        sessions.append(writer)
        writer.write(b"220 relay\r\n")
        while line := await reader.readline():
            verb = line[:4].upper()
            if verb == b"EHLO":
                writer.write(b"250-relay\r\n250-PIPELINING\r\n250-CHUNKING\r\n250 HELP\r\n")
            elif verb == b"RCPT" and refused:
                writer.write(b"250 2.1.0 ok\r\n" + refused + b"\r\n")  # MAIL's, then RCPT's: and gone
                await writer.drain()
                writer.close()
                return
            elif verb == b"BDAT":
                await reader.readexactly(int(line.split()[1]))  # taken, never answered

    return session


def test_a_relay_silent_after_the_bdat_chunk_leaves_the_mail_unconfirmed_never_resent():
    """The message leaves with the envelope: no reply by the deadline may mean the relay has it."""
    sessions = []

    async def go():
        server = await asyncio.start_server(bdat_relay(sessions), "127.0.0.1", 0)
        pool = SmtpPool([parse_smtp_url(f"smtp://127.0.0.1:{server.sockets[0].getsockname()[1]}")],
                        PoolOptions(size=1, timeout_s=0.5))
        with pytest.raises(UnconfirmedMailError):
            await send_with_retry(pool, RetryPolicy(), "n@broker.example.com", "c2@example.com", message(2))
        await pool.close()
        server.close()

    run(go())
    assert len(sessions) == 1, "never sent again"


@pytest.mark.parametrize("refused, error", [(b"550 5.1.1 user unknown", PermanentMailError),
                                             (b"451 4.3.0 try later", TransientMailError)])
def test_a_relay_that_refuses_the_envelope_then_hangs_up_leaves_the_mail_refused_not_unconfirmed(refused, error):
    """Its BDAT chunk left with the envelope, but a refused RCPT means the relay holds no
    transaction to deliver: the refusal stands (a 4xx retried), however the session ends."""
    [result] = through_relay(bdat_relay([], refused), [("c2@example.com", message(2))])
    assert type(result) is error and refused.decode()[:3] in str(result)


def test_a_connection_idle_past_bdat_fresh_s_sends_data_first_a_fresh_one_bdat():
    """A connection that has not answered for a while may have died unseen: its mail goes as
    DATA, whose envelope's round trip proves the session before the message leaves."""
    from pipeline.mail import relay as relay_module

    sessions, reads, taken = [], [], []
    mails = [message(i) for i in (2, 3, 4)]

    async def go():
        server = await asyncio.start_server(pipelining_relay(sessions, reads, chunking=True, messages=taken),
                                            "127.0.0.1", 0)
        pool = SmtpPool([parse_smtp_url(f"smtp://127.0.0.1:{server.sockets[0].getsockname()[1]}")],
                        PoolOptions(size=1, timeout_s=5))
        await pool.send("n@broker.example.com", "c2@example.com", mails[0])
        await pool.send("n@broker.example.com", "c3@example.com", mails[1])
        pool.relays[0]._idle[0].replies.answered -= relay_module.BDAT_FRESH_S  # its relay's last reply, long ago
        await pool.send("n@broker.example.com", "c4@example.com", mails[2])
        await pool.close()
        server.close()

    run(go())
    groups = [r for r in reads if r.startswith(b"MAIL")]
    assert [g.split(b"\r\n")[2][:4] for g in groups] == [b"BDAT", b"BDAT", b"DATA"]
    assert taken == mails and len(sessions) == 1


def test_postfix_offers_chunking_and_a_message_sent_as_bdat_is_delivered_as_it_was_built():
    """Against Debian's Postfix (3.4 and later offer CHUNKING by default): its log's command
    counts say the session used BDAT and no DATA, and the mailbox has the message as built
    (Postfix stores it with LF line ends, after the headers it adds)."""
    mta, sent = servers.start_postfix({"@example.com": "clients"}, {"example.com"}, "bounces.example.net"), message(2)
    try:
        async def go():
            pool = SmtpPool([parse_smtp_url(mta.url)], PoolOptions(size=1, timeout_s=10))
            await pool.send("n@broker.example.com", "c2@example.com", sent)
            await pool.close()

        run(go())
        inbox, deadline = mta.root / "vmail" / "clients" / "new", time.monotonic() + 30
        while not (inbox.exists() and any(inbox.iterdir())) or b" disconnect from " not in (mta.root / "maillog").read_bytes():
            assert time.monotonic() < deadline, (mta.root / "maillog").read_text()[-3000:]
            time.sleep(0.1)
        [delivered] = [f.read_bytes() for f in inbox.iterdir()]
        log = (mta.root / "maillog").read_text()
    finally:
        mta.stop()
    assert " bdat=1 " in log and " data=" not in log, log[-1500:]
    assert delivered.replace(b"\n", b"\r\n").endswith(b"\r\n" + sent)


def test_the_sink_offers_pipelining_and_answers_a_group_in_one_write_unless_told_not_to(smtp_server):
    """Its replies to a pipelined group come back together, after one delay (a round trip);
    with "pipelining": false it offers none, as SES does not."""
    import socket

    for offered in (True, False):
        server = smtp_server(f"o{offered}", delay_ms=20, pipelining=offered)
        host, port = server.url.removeprefix("smtp://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.recv(1024)
            s.sendall(b"EHLO client\r\n")
            time.sleep(0.3)
            assert (b"250-PIPELINING" in s.recv(4096)) == offered
            if offered:
                s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n")
                started = time.monotonic()
                first = s.recv(4096)
                assert [line[:3] for line in first.splitlines()] == [b"250", b"250", b"354"]
                assert time.monotonic() - started < 0.2  # one delay of 20 ms, not three waits one after another


def test_the_sink_offers_chunking_and_keeps_a_bdat_message_as_it_keeps_data_s_unless_told_not_to(smtp_server):
    """CHUNKING as Postfix offers it: the message in two chunks, the envelope and the last
    pipelined with it, is kept byte for byte, a group answered in one write; a chunk sent after a
    refused recipient is read and refused, and the session goes on; a chunk past the size limit
    is refused after the group's other replies, then the session ends; "chunking": false offers none."""
    import socket

    def answered(s) -> list[bytes]:
        return [line[:3] for line in s.recv(4096).splitlines()]  # the group's replies, in one write

    body = b"Message-ID: <bdat@x>\r\nSubject: two chunks\r\n\r\n.a line with a leading dot\r\n"
    server = smtp_server("chunking", delay_ms=20, reject={"gone@d.example"})
    host, port = server.url.removeprefix("smtp://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.recv(1024)
        s.sendall(b"EHLO client\r\n")
        time.sleep(0.3)
        assert b"250-CHUNKING" in s.recv(4096)
        s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<gone@d.example>\r\nBDAT 5 LAST\r\nabcde")
        assert answered(s) == [b"250", b"550", b"554"]
        s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nBDAT 20\r\n" + body[:20])
        assert answered(s) == [b"250", b"250", b"250"]
        s.sendall(b"BDAT %d LAST\r\n" % len(body[20:]) + body[20:])
        assert answered(s) == [b"250"]
        s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nBDAT %d LAST\r\nab" % (DATA_LIMIT + 1))
        assert answered(s) == [b"250", b"250", b"552"] and s.recv(4096) == b"", "said, then the session ends"
    with socket.create_connection((host, int(port))) as s:
        s.recv(1024)
        s.sendall(b"EHLO client\r\n")
        time.sleep(0.3)
        s.recv(4096)
        s.sendall(b"BDAT 3 LAST\r\nabc")
        assert answered(s) == [b"503"], "a chunk before MAIL: read, refused"
        s.sendall(b"BDAT 4 FIRST\r\nQUIT")
        assert answered(s) == [b"501"], "its chunk read: QUIT is not taken as a command"
        s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n")
        assert answered(s) == [b"250", b"250", b"354"]
        s.sendall(b"x" * (DATA_LIMIT + 10))
        assert answered(s) == [b"552"] and s.recv(4096) == b"", "DATA past the limit: said, then the session ends"
    [kept] = server.outbox.glob("*.eml")
    assert kept.read_bytes() == body
    plain = smtp_server("no-chunking", chunking=False)
    host, port = plain.url.removeprefix("smtp://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.recv(1024)
        s.sendall(b"EHLO client\r\n")
        time.sleep(0.3)
        assert b"CHUNKING" not in s.recv(4096)


def test_the_sink_refuses_a_line_over_rfc_5321_s_length_in_data_or_bdat_and_keeps_one_at_it(smtp_server):
    """A line of 999 bytes is kept (RFC 5321's 998, and room for DATA's dot-stuffing: aiosmtpd's
    limit, as Postfix's is its own); one byte more is refused with 500, whether the message came by
    DATA or as a BDAT chunk, wherever in it the line is."""
    import socket

    server = smtp_server("lines")
    host, port = server.url.removeprefix("smtp://").split(":")
    rng = random.Random(5321)
    with socket.create_connection((host, int(port))) as s:
        s.recv(1024)
        s.sendall(b"EHLO client\r\n")
        time.sleep(0.3)
        s.recv(4096)
        for n, size in enumerate((999, 999, 1000, 1000, 4000)):  # by DATA, BDAT, DATA, BDAT, DATA
            lines = [b"x" * rng.randrange(1, 77) for _ in range(rng.randrange(0, 60))]
            lines.insert(rng.randrange(0, len(lines) + 1), b"y" * size)
            body = b"Message-ID: <line-%d@x>\r\n\r\n" % n + b"\r\n".join(lines) + b"\r\n"
            if n % 2:
                s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nBDAT %d LAST\r\n" % len(body) + body)
            else:
                s.sendall(b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n")
                time.sleep(0.2)
                s.recv(4096)
                s.sendall(body + b".\r\n")
            time.sleep(0.2)
            assert s.recv(4096).splitlines()[-1][:3] == (b"250" if size < 1000 else b"500"), (n, size)
    assert len(list(server.outbox.glob("*.eml"))) == 2


def test_a_long_line_is_found_wherever_it_is_as_by_cutting_the_message_into_lines():
    """Lines of the limit's length and one either side, a lone CR or LF now and then, a CRLF inside
    a line rarely: every answer as splitting the whole message gives it, long lines among them."""
    rng = random.Random(3030)
    answers = Counter()
    for _ in range(4000):
        limit = rng.choice([0, 1, 2, 3, 5, 8, 13, 998, 999])
        sizes = [rng.choice([0, 1, max(limit - 1, 0), limit, limit + 1, rng.randrange(0, 2 * limit + 3)])
                 for _ in range(rng.randrange(0, 8))]
        parts = [bytes(rng.choices(b"ab.\r\n", weights=(40, 40, 10, 1, 1), k=size)) for size in sizes]
        content = b"\r\n".join(parts)
        long = max(map(len, content.split(b"\r\n"))) > limit
        assert has_long_line(content, limit) == long, (limit, sizes)
        answers[long] += 1
    assert min(answers[True], answers[False]) > 1000, answers


def test_connections_are_reused_capped_swept_and_bounded(smtp_server):
    server = smtp_server(delay_ms=20)

    async def go():
        pool = SmtpPool([parse_smtp_url(server.url)], PoolOptions(size=1, max_messages=2, idle_s=0.2, wait_s=0.05))
        relay = pool.relays[0]
        await pool.send("n@broker.example.com", "c1@example.com", message(1))
        first = relay._idle[0]
        await pool.send("n@broker.example.com", "c2@example.com", message(2))
        reused_then_retired = not relay._idle and first.sent == 2  # cap reached: closed
        await pool.send("n@broker.example.com", "c3@example.com", message(3))
        replaced = relay._idle[0] is not first
        await asyncio.sleep(0.5)
        swept = relay._idle == []
        slow = asyncio.ensure_future(pool.send("n@broker.example.com", "c4@example.com", message(4)))
        await asyncio.sleep(0.001)
        with pytest.raises(TransientMailError, match="no free connection"):
            await pool.send("n@broker.example.com", "c5@example.com", message(5))
        await slow
        await pool.close()
        return reused_then_retired, replaced, swept

    assert run(go()) == (True, True, True)
    assert len(outbox_messages(server.outbox)) == 4


def test_mail_is_spread_across_relays(smtp_server):
    a, b = smtp_server("relay-a"), smtp_server("relay-b")

    async def go():
        pool = SmtpPool([parse_smtp_url(a.url), parse_smtp_url(b.url)], PoolOptions(size=2))
        await asyncio.gather(*(pool.send("n@broker.example.com", f"c{i}@example.com", message(i)) for i in range(10)))
        await pool.close()

    run(go())
    assert len(outbox_messages(a.outbox)) == len(outbox_messages(b.outbox)) == 5


def test_starttls_and_auth_are_spoken_when_the_relay_requires_them(tmp_path):
    from pipeline.embedded import start_smtp_sink
    from tests.servers import make_tls_certificate

    cert, key = make_tls_certificate(tmp_path / "tls")
    server = start_smtp_sink(tmp_path / "tls-outbox", tmp_path / "tls.log",
                             ["--tls", str(cert), str(key), "--login", "relayuser:s3cret"])
    host_port = server.url.removeprefix("smtp://")
    options = PoolOptions(size=1, starttls="always", ca_file=str(cert), helo="notes.broker.example.com")

    async def send(url: str):
        pool = SmtpPool([parse_smtp_url(url)], options)
        try:
            return await pool.send("notes@broker.example.com", "c1@example.com", message(1))
        finally:
            await pool.close()

    try:
        assert run(send(f"smtp://relayuser:s3cret@{host_port}")).startswith("OK")
        with pytest.raises(PermanentMailError, match="535"):
            run(send(f"smtp://relayuser:wrong@{host_port}"))
        with pytest.raises(PermanentMailError, match="530"):  # no AUTH: the relay refuses to relay
            run(send(f"smtp://{host_port}"))
    finally:
        server.stop()
    assert len(outbox_messages(tmp_path / "tls-outbox")) == 1


def test_with_starttls_always_a_relay_that_offers_no_tls_gets_no_mail(smtp_sink):
    """cluster.env's CN_SMTP_STARTTLS=always: a relay without STARTTLS, or a path that strips
    it from the EHLO reply, is never sent the message in the clear: it is a relay that cannot be
    used, waited out as an outage (here for a second), and the mail fails saying why."""
    options = PoolOptions(size=1, starttls="always", helo="notes.broker.example.com", patience_s=1.0)

    async def send():
        pool = SmtpPool([parse_smtp_url(smtp_sink.url)], options)
        try:
            return await pool.send("notes@broker.example.com", "c1@example.com", message(1))
        finally:
            await pool.close()

    with pytest.raises(TransientMailError, match="STARTTLS"):
        run(send())
    assert outbox_messages(smtp_sink.outbox) == []


def test_clients_without_consent_or_a_usable_address_are_listed_for_paper(ray_session, settings, day, smtp_sink):
    with (day / "clients.csv").open(newline="") as f:
        clients = list(csv.DictReader(f))
    traded = {r["ucc"] for r in csv.DictReader((day / "trades.csv").open(newline=""))}
    chosen = [c for c in clients if c["ucc"] in traded][:3]
    no_consent, no_email, bad_email = (c["ucc"] for c in chosen)
    chosen[0]["ecn_opt_in"], chosen[1]["email"], chosen[2]["email"] = "N", "", "not-an-address"
    with (day / "clients.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, clients[0].keys())
        writer.writeheader()
        writer.writerows(clients)

    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))

    rows = report_rows(settings, summary["run_id"])
    report = json.loads((Path(settings.store_url) / keys.report_keys(summary["run_id"])[0]).read_text())
    for ucc in (no_consent, no_email, bad_email):
        assert rows[ucc]["status"] == "physical" and rows[ucc]["physical_dispatch"] == "Y"
        assert ucc in report["physical_dispatch"]
        assert (Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, ucc)).exists(), "archived for paper"
    subjects = " ".join(m["Subject"] for m in outbox_messages(smtp_sink.outbox))
    assert not any(u in subjects for u in (no_consent, no_email, bad_email))
    assert summary["delivered"] == summary["accounts"] - 3


def test_the_sinks_fast_data_reader_keeps_and_answers_what_aiosmtpds_own_does(tmp_path):
    """The sink reads DATA to its end mark instead of by line; the outbox and the replies must
    not tell the two apart: dot-stuffed lines, a lone dot in the body, lines ending in a dot,
    a bare LF, a line one byte too long, an empty message."""
    messages = [b"Message-ID: <a@x>\r\n\r\nbody\r\n",
                b"Message-ID: <b@x>\r\n\r\n.starts with a dot\r\n.\r\n..two\r\nends with a dot.\r\n",
                b".a first line with a dot\r\nMessage-ID: <c@x>\r\n\r\nx",
                b"Message-ID: <d@x>\r\n\r\n" + b"Regards.\r\n" * 3000,
                b"Message-ID: <e@x>\r\n\r\n" + b"y" * 999 + b"\r\nbare\nlf\r\n",
                b"Message-ID: <f@x>\r\n\r\n" + b"z" * 1000 + b"\r\n", b""]
    seen = {}
    for name, controller in (("sink", SinkController), ("aiosmtpd", Controller)):
        port, handler = free_port(), OutboxHandler(tmp_path / name, Faults())
        handler.controller = server = controller(handler, hostname="127.0.0.1", port=port, decode_data=False,
                                                 server_kwargs={"data_size_limit": DATA_LIMIT})
        server.start()
        replies = []
        try:
            with smtplib.SMTP("127.0.0.1", port) as s:
                for m in messages:
                    try:
                        replies.append(s.sendmail("a@b.example", ["c@d.example"], m) or 250)
                    except smtplib.SMTPDataError as e:
                        replies.append(e.smtp_code)
        finally:
            server.stop()
        seen[name] = replies, {p.name: p.read_bytes() for p in (tmp_path / name).glob("*.eml")}
    assert seen["sink"] == seen["aiosmtpd"]
    assert seen["sink"][0] == [250, 250, 250, 250, 250, 500, 250]
    assert messages[1] in seen["sink"][1].values()  # smtplib stuffed its dots, the sink took them out


@pytest.mark.parametrize("arg", ["<a@b.example>", "<notes+r1-O1-x=y@bounce.broker.example.com> SIZE=1234",
                                 "<a@b>  BODY=8BITMIME", "<>", "<a..b@c>", "<.a@b>", '<"q u"@b>', "<a@[1.2.3.4]>",
                                 "a@b", " <a@b>", "<a@b", "<a@b.>", "<a@b..c>", "<é@b>", "<a@b>x"])
def test_the_sinks_fast_address_reader_reads_what_aiosmtpds_own_does(arg):
    from aiosmtpd.smtp import SMTP

    from pipeline.mail.smtp_sink import FaultySMTP
    assert FaultySMTP(None)._getaddr(arg) == SMTP(None)._getaddr(arg)
