"""A local SMTP server that keeps what it receives: one .eml file per message in a folder.

The embedded default's relay, and the tests' and benchmarks' real SMTP peer. Files are
named by Message-ID; a second message with the same Message-ID is kept as a second file,
so a double delivery is visible, never hidden. A message counts as received only when the
server has answered 250 to it.

It can misbehave on purpose (--faults FILE, JSON), the way relays do:
  delay_ms            wait before every reply it sends (a relay on the LAN, not loopback);
                      replies to pipelined commands go back together, after one wait
  pipelining          false: not offered in the EHLO reply (SES does not offer it)
  chunking            false: CHUNKING (BDAT, RFC 3030) not offered (offered by default, as Postfix does)
  refuse_connections  answer this many connections with 421 and hang up
  throttle_connections  greet this many connections as Gmail does a sender it throttles:
                      "421 4.7.0 Try again later, closing connection."
  reject              recipients answered 550 at RCPT (permanent)
  tempfail_once       recipients whose first message gets 451 after DATA
  drop_once           recipients whose first message is never answered: the
                      connection drops after the data, before the 250
  accept_then_drop    recipients whose first message is kept, but the connection
                      drops before the 250 reaches the client (an ambiguous send)
  hold_after          N: the message after the Nth kept is kept, and its 250 held back for
                      HOLD_S (a relay that has the mail and has not said so yet): a client
                      killed meanwhile had that mail in flight
  outage              {"after": N, "seconds": S}: after the Nth message kept, the
                      server stops listening and drops every connection for S s
  rate                messages a second it takes (a bucket of one second's worth), as
                      Amazon SES does: above it "454 Throttling failure: Maximum sending
                      rate exceeded" after the data
  daily_quota         messages it takes until SIGUSR1 (a new day): then "454 Throttling
                      failure: Daily message quota exceeded"
  With rate or daily_quota, every answer to a message is listed in OUTBOX.replies as
  "UNIX-TIME accepted|throttle|quota": what the relay saw, second by second.
--tls CERT KEY requires STARTTLS; --login USER:PASSWORD requires AUTH.
--bounce-rate R --bounces MAILDIR: after the 250, a share R of the recipients (chosen by a
hash of the address: half permanent "5.1.1 user unknown", half "4.2.2 mailbox full" delays)
get an RFC 3464 DSN sent back to the message's envelope sender, as a remote MTA would,
delivered into MAILDIR (the bounce mailbox) and listed in MAILDIR.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import ssl
import time
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from itertools import repeat
from pathlib import Path

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import MISSING, SMTP, AuthResult, syntax

DATA_LIMIT = 64 * 1024 * 1024
HOLD_S = 120.0
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
PLAIN_ADDRESS = re.compile(rf"<({_ATOM}(?:\.{_ATOM})*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)>")  # RFC 5322 dot-atoms
MESSAGE_ID = re.compile(rb"^message-id:[ \t]*([^\r\n]*(?:\r\n[ \t][^\r\n]*)*)", re.I | re.M)


@dataclass
class Faults:
    delay_ms: float = 0
    refuse_connections: int = 0
    reject: set[str] = field(default_factory=set)
    tempfail_once: set[str] = field(default_factory=set)
    drop_once: set[str] = field(default_factory=set)
    accept_then_drop: set[str] = field(default_factory=set)
    outage: dict = field(default_factory=dict)
    bounce_rate: float = 0.0
    bounces: Path | None = None
    rate: float = 0.0
    daily_quota: int = 0
    throttle_connections: int = 0
    pipelining: bool = True
    hold_after: int = 0
    chunking: bool = True

    @classmethod
    def load(cls, path: Path | None) -> "Faults":
        if path is None:
            return cls()
        raw = json.loads(path.read_text())
        return cls(raw.get("delay_ms", 0), raw.get("refuse_connections", 0),
                   *(set(raw.get(k, [])) for k in ("reject", "tempfail_once", "drop_once", "accept_then_drop")),
                   raw.get("outage", {}), raw.get("bounce_rate", 0.0), Path(raw["bounces"]) if raw.get("bounces") else None,
                   raw.get("rate", 0.0), raw.get("daily_quota", 0), raw.get("throttle_connections", 0),
                   raw.get("pipelining", True), raw.get("hold_after", 0), raw.get("chunking", True))


class OutboxHandler:
    def __init__(self, outbox: Path, faults: Faults):
        self.outbox, self.faults = outbox, faults
        self.kept, self.sessions, self.controller = 0, set(), None
        self.today, self.tokens, self.filled = 0, faults.rate, time.monotonic()
        self.replies = outbox.with_name(outbox.name + ".replies").open("a", buffering=1) \
            if faults.rate or faults.daily_quota else None
        outbox.mkdir(parents=True, exist_ok=True)

    def new_day(self) -> None:
        self.today = 0
        print("a new day: the daily quota is reset", flush=True)

    def _limited(self) -> str | None:
        """SES's answers above its limits (their wording, which is what clients match)."""
        if self.faults.daily_quota and self.today >= self.faults.daily_quota:
            return self._reply("quota", "454 Throttling failure: Daily message quota exceeded.")
        if self.faults.rate:
            now = time.monotonic()
            self.tokens = min(self.faults.rate, self.tokens + (now - self.filled) * self.faults.rate)
            self.filled = now
            if self.tokens < 1:
                return self._reply("throttle", "454 Throttling failure: Maximum sending rate exceeded.")
            self.tokens -= 1
        return None

    def _reply(self, kind: str, reply: str | None = None) -> str | None:
        if self.replies:
            self.replies.write(f"{time.time():.6f} {kind}\n")
        return reply

    async def handle_EHLO(self, server, session, envelope, hostname, responses) -> list[str]:
        """PIPELINING (RFC 2920), as Postfix and Haraka offer it (FaultySMTP.push answers that
        way), and CHUNKING (RFC 3030), as Postfix does, by a server that reads BDAT (FaultySMTP;
        a test may serve this handler with aiosmtpd's own class, which does not)."""
        session.host_name = hostname
        if self.faults.pipelining:
            responses.insert(-1, "250-PIPELINING")
        if self.faults.chunking and isinstance(server, FaultySMTP):
            responses.insert(-1, "250-CHUNKING")
        return responses

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options) -> str:
        if address in self.faults.reject:
            return f"550 5.1.1 <{address}>: Recipient address rejected: User unknown"  # as Postfix says it
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope) -> str:
        rcpt = envelope.rcpt_tos[0] if envelope.rcpt_tos else ""
        if rcpt in self.faults.tempfail_once:
            self.faults.tempfail_once.discard(rcpt)
            return "451 4.3.0 temporary failure, try again"
        if rcpt in self.faults.drop_once:
            self.faults.drop_once.discard(rcpt)
            server.transport.close()
            return "421 closing"  # never reaches the client: the transport is gone
        limited = self._limited()
        if limited:
            return limited
        kept = self._keep(envelope.original_content or envelope.content)
        self.kept += 1
        self.today += 1
        self._reply("accepted")
        kind = bounce_kind(rcpt, self.faults.bounce_rate)
        if kind and self.faults.bounces:
            self._bounce(kind, envelope.mail_from, rcpt, envelope.original_content or envelope.content)
        if rcpt in self.faults.accept_then_drop:
            self.faults.accept_then_drop.discard(rcpt)
            server.transport.close()
        if self.faults.hold_after and self.kept == self.faults.hold_after + 1:
            await asyncio.sleep(HOLD_S)
        if self.faults.outage and self.kept == self.faults.outage["after"]:
            asyncio.get_running_loop().call_later(0.01, self._outage, self.faults.outage["seconds"])
        return "250 OK queued as " + kept

    def _outage(self, seconds: float) -> None:
        """Down as a crashed relay is: nothing listens, every connection is cut."""
        self.controller.server.close()
        for session in list(self.sessions):
            session.transport.close()
        print(f"outage for {seconds} s after {self.kept} messages", flush=True)
        asyncio.get_running_loop().call_later(seconds, lambda: asyncio.ensure_future(self._back()))

    async def _back(self) -> None:
        self.controller.server = await self.controller._create_server()
        print("back after the outage", flush=True)

    def _bounce(self, kind: str, mail_from: str, rcpt: str, data: bytes) -> None:
        box = self.faults.bounces
        for sub in ("new", "cur", "tmp"):
            (box / sub).mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns()}.{uuid.uuid4().hex[:8]}.sink"
        (box / "tmp" / name).write_bytes(dsn(kind, mail_from, rcpt, data))
        os.replace(box / "tmp" / name, box / "new" / name)
        with box.with_suffix(".jsonl").open("a") as f:
            f.write(json.dumps({"kind": kind, "mail_from": mail_from, "rcpt": rcpt}) + "\n")

    def _keep(self, data: bytes) -> str:
        end = data.find(b"\r\n\r\n")  # the headers are all it needs: parsing a 50 KB body cost 0.4 ms
        found = MESSAGE_ID.search(data, 0, end if end >= 0 else len(data))
        mid = b" ".join(found[1].split()) if found else str(len(os.listdir(self.outbox))).encode()
        name = hashlib.sha256(mid).hexdigest()[:32]
        path, n = self.outbox / f"{name}.eml", 1
        while path.exists():
            n += 1
            path = self.outbox / f"{name}.{n}.eml"
        tmp = self.outbox / f".{path.name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path.stem


def has_long_line(content: bytes, limit: int) -> bool:
    """Whether a line of `content` (the bytes between two CRLFs) is longer than `limit`. Such a
    line holds one of the windows of (limit + 1) // 2 bytes that start at multiples of that, with
    no CRLF in it; only where a window has none are the lines measured. A message of 76-byte
    base64 lines has one in every window: ~100 finds for a note, in C, 17 us, where cutting it into
    its ~650 lines took 63 us, on the cores the run uses."""
    width = max(1, (limit + 1) // 2)
    windows = range(0, len(content) - width + 1, width)
    if -1 not in map(content.find, repeat(b"\r\n"), windows, range(width, len(content) + 1, width)):
        return False
    return max(map(len, content.split(b"\r\n"))) > limit


def bounce_kind(rcpt: str, rate: float) -> str:
    """"bounced", "deferred" or "": a fixed choice per address, half of `rate` each."""
    x = int.from_bytes(hashlib.sha256(rcpt.encode()).digest()[:8], "big") / 2 ** 64
    return "bounced" if x < rate / 2 else "deferred" if x < rate else ""


def dsn(kind: str, mail_from: str, rcpt: str, original: bytes) -> bytes:
    """A DSN as Postfix writes one (RFC 3464 multipart/report, the original's headers returned)."""
    status, action, diag = (("5.1.1", "failed", "smtp; 550 5.1.1 <{r}>: Recipient address rejected: User unknown")
                            if kind == "bounced" else
                            ("4.2.2", "delayed", "smtp; 452 4.2.2 <{r}>: Mailbox full, try again later"))
    headers = original.split(b"\r\n\r\n", 1)[0].decode("ascii", "replace")
    boundary = f"dsn-{uuid.uuid4().hex}"
    text = ("I'm sorry to have to inform you that your message could not be delivered to one or more recipients."
            if kind == "bounced" else "This is a delivery status notification: your message has not yet been "
            "delivered. The mail system will keep trying.")
    return "\r\n".join([
        "Return-Path: <>", f"Delivered-To: {mail_from}", "From: MAILER-DAEMON@mx.client.example (Mail Delivery System)",
        f"To: {mail_from}", f"Subject: {'Undelivered Mail Returned to Sender' if kind == 'bounced' else 'Delayed Mail'}",
        f"Date: {formatdate()}", f"Message-ID: <{uuid.uuid4().hex}@mx.client.example>", "MIME-Version: 1.0",
        f'Content-Type: multipart/report; report-type=delivery-status; boundary="{boundary}"', "",
        f"--{boundary}", "Content-Type: text/plain; charset=us-ascii", "", text, "",
        f"--{boundary}", "Content-Type: message/delivery-status", "",
        "Reporting-MTA: dns; mx.client.example", "", f"Final-Recipient: rfc822; {rcpt}",
        f"Original-Recipient: rfc822;{rcpt}", f"Action: {action}", f"Status: {status}",
        "Remote-MTA: dns; mailstore.client.example", f"Diagnostic-Code: {diag.format(r=rcpt)}", "",
        f"--{boundary}", "Content-Type: text/rfc822-headers", "", headers, "", f"--{boundary}--", ""]).encode()


class FaultySMTP(SMTP):
    faults: Faults
    _held: list[str]  # replies waiting for the rest of a pipelined group (push)
    _chunks: list[bytes]  # the message's BDAT chunks so far
    line_length_limit = DATA_LIMIT + 5  # the stream's limit: smtp_DATA reads to the end mark, not by line

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        """aiosmtpd reads DATA a line at a time in Python: 4.4 ms of CPU for a 55 KB note, three
        times what our client spends sending it, on the same cores as the run it serves. This
        reads to the end mark in a call or two, then makes aiosmtpd's checks and replies."""
        if await self.check_helo_needed() or await self.check_auth_needed("DATA"):
            return
        if not self.envelope.rcpt_tos:
            return await self.push("503 Error: need RCPT command")
        if arg:
            return await self.push("501 Syntax: DATA")
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        data = bytearray()
        try:
            while data != b".\r\n" and not data.endswith(b"\r\n.\r\n"):
                data += await self._reader.readuntil(b".\r\n")
        except asyncio.CancelledError:
            self._writer.close()
            raise
        except asyncio.LimitOverrunError:  # the data stays in the reader: push would hold the reply
            await self._push_now("552 Error: Too much mail data")
            self.transport.close()
            return
        content = bytes(data[:-3])
        error = self._refusal(content)
        if error:
            self._set_post_data_state()
            return await self.push(error)
        if b"\r\n." in content:  # RFC 5321 4.5.2: a line's leading dot goes (a copy: only when there is one)
            content = content.replace(b"\r\n.", b"\r\n")
        self.envelope.content = self.envelope.original_content = content[1:] if content[:1] == b"." else content
        status = await self._call_handler_hook("DATA")
        self._set_post_data_state()
        await self.push("250 OK" if status is MISSING else status)

    async def smtp_BDAT(self, arg: str | None) -> None:
        """A chunk of the message (RFC 3030), kept until the one marked LAST, which is taken as
        DATA's message is: the same checks, hook, faults and reply. A chunk is read before its
        command is judged, as the RFC asks: a client pipelining it after a refused MAIL or RCPT
        has sent it anyway, and its bytes are not commands."""
        size, _, last = (arg or "").partition(" ")
        if not size.isdigit():
            return await self.push("501 5.5.4 Syntax: BDAT size [LAST]")
        if self.data_size_limit and int(size) + sum(map(len, self._chunks)) > self.data_size_limit:
            await self._push_now("552 5.3.4 Error: Too much mail data")  # now, not read into memory: the session ends
            self.transport.close()
            return
        try:
            self._chunks.append(await self._reader.readexactly(int(size)))
        except asyncio.IncompleteReadError:  # the client went away mid-chunk
            self.transport.close()
            return
        if last.upper() not in ("", "LAST"):  # its chunk read: the stream stays in step
            self._chunks = []
            return await self.push("501 5.5.4 Syntax: BDAT size [LAST]")
        if await self.check_helo_needed() or await self.check_auth_needed("BDAT"):
            self._chunks = []
            return
        if not self.envelope.mail_from:
            self._chunks = []
            return await self.push("503 5.5.1 Error: need MAIL command")
        if not last:
            return await self.push(f"250 2.0.0 {size} bytes received")
        content, self._chunks = b"".join(self._chunks), []
        error = "554 5.5.1 Error: no valid recipients" if not self.envelope.rcpt_tos else self._refusal(content)
        if error:
            self._set_post_data_state()
            return await self.push(error)
        self.envelope.content = self.envelope.original_content = content
        status = await self._call_handler_hook("DATA")
        self._set_post_data_state()
        await self.push("250 OK" if status is MISSING else status)

    def _refusal(self, content: bytes) -> str | None:
        """What refuses a message, whether DATA or BDAT brought it: its size, or a line too long."""
        if self.data_size_limit and len(content) > self.data_size_limit:
            return "552 Error: Too much mail data"
        if has_long_line(content, SMTP.line_length_limit - 2):
            return "500 Line too long (see RFC5321 4.5.3.1.6)"
        return None

    def _set_post_data_state(self) -> None:
        """A transaction's end (its message taken or refused, RSET, EHLO) drops its chunks too."""
        super()._set_post_data_state()
        self._chunks = []

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        """aiosmtpd parses every address with the email package's header parser, and defines a
        class each time: 0.11 ms a command, two a mail, on the cores the run uses. A plain
        <local@domain> (every address a run sends) needs none of it; anything else still gets it."""
        plain = PLAIN_ADDRESS.match(arg)
        if plain is None or (self.local_part_limit and len(plain[1].rpartition("@")[0]) > self.local_part_limit):
            return super()._getaddr(arg)
        return plain[1], arg[plain.end():].lstrip()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._held = []
        self.event_handler.sessions.add(self)

    def connection_lost(self, error) -> None:
        self.event_handler.sessions.discard(self)
        super().connection_lost(error)

    async def push(self, status: str | bytes) -> None:
        """A reply waits while more commands are already in (a client pipelining), then goes
        back with theirs, after one delay: a round trip each group, as Postfix's smtpd flushes
        its replies only once it has read all it was sent."""
        if self._reader._buffer:  # StreamReader's unread bytes: a pipelined command is waiting
            self._held.append(status)
            return
        if self.faults.delay_ms:
            await asyncio.sleep(self.faults.delay_ms / 1000)
        await self._push_now(status)

    async def _push_now(self, status: str | bytes) -> None:
        """The reply, after those held for its group."""
        if self._held:
            codec = "utf-8" if self.enable_SMTPUTF8 else "ascii"
            status = b"\r\n".join(r.encode(codec) if isinstance(r, str) else r for r in [*self._held, status])
            self._held = []
        await super().push(status)

    async def _handle_client(self) -> None:
        if self.faults.refuse_connections > 0:
            self.faults.refuse_connections -= 1
            await super().push("421 4.3.2 service not available, try later")
            self.transport.close()
            return
        if self.faults.throttle_connections > 0:
            self.faults.throttle_connections -= 1
            await super().push("421 4.7.0 Try again later, closing connection.")
            self.transport.close()
            return
        await super()._handle_client()


class SinkController(Controller):
    def factory(self):
        smtp = FaultySMTP(self.handler, **self.SMTP_kwargs)
        smtp.faults = self.handler.faults
        return smtp


def serve(host: str, port: int, outbox: Path, faults: Faults, tls: tuple[str, str] | None = None,
          login: str | None = None) -> None:
    kwargs = {"data_size_limit": DATA_LIMIT}
    if tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
        kwargs.update(tls_context=context, require_starttls=True)
    if login:
        user, _, password = login.partition(":")
        kwargs.update(authenticator=lambda server, session, envelope, mechanism, data: AuthResult(
            success=(data.login.decode(), data.password.decode()) == (user, password), handled=False),
            auth_require_tls=bool(tls), auth_required=True)
    handler = OutboxHandler(outbox, faults)
    controller = handler.controller = SinkController(handler, hostname=host, port=port,
                                                     server_kwargs=kwargs, decode_data=False)
    refuse, throttle = faults.refuse_connections, faults.throttle_connections
    faults.refuse_connections = faults.throttle_connections = 0
    controller.start()  # connects to itself once to check the server: not a client to refuse
    faults.refuse_connections, faults.throttle_connections = refuse, throttle
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, handler.new_day)
    print(f"smtp sink listening on {host}:{port}, outbox {outbox}", flush=True)
    loop.run_until_complete(stop.wait())
    controller.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--outbox", type=Path, required=True)
    parser.add_argument("--faults", type=Path, help="JSON file of faults to inject")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"), help="offer and require STARTTLS")
    parser.add_argument("--login", metavar="USER:PASSWORD", help="require AUTH with these credentials")
    parser.add_argument("--bounce-rate", type=float, default=0.0)
    parser.add_argument("--bounces", type=Path, metavar="MAILDIR")
    args = parser.parse_args()
    faults = Faults.load(args.faults)
    if args.bounce_rate:
        faults.bounce_rate, faults.bounces = args.bounce_rate, args.bounces
    serve(args.host, args.port, args.outbox, faults, args.tls, args.login)
