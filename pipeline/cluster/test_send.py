"""`test-send --to ADDRESS`: one note rendered, signed and mailed to an address the operator
names, outside any run (as listmonk's test send): the template, the signing key or token, the
owner password and the relay proved in one command, before a day depends on them.

The note is a synthetic client's (or the first client of `--input`'s day), its number marked
TEST, its e-mail replaced by the operator's address. Nothing goes into the broker's record: the
signed note is kept in a temporary folder, and the throwaway run's keys leave Redis at the end.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import smtplib
import ssl
import tempfile
import uuid
from pathlib import Path

from pipeline import credentials
from pipeline.cluster.first_notes import mail_notes
from pipeline.day import trading_calendar
from pipeline.day.dumps import EMAIL
from pipeline.day.split import first_accounts, make_plan, shard_line
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.errors import CannotRun
from pipeline.record import keys
from pipeline.record.lease import held
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import Settings
from pipeline.stages import Batch, broker

TEST_NOTE = "TEST-00000001"


class NothingToSend(CannotRun, RuntimeError):
    """The input named no client whose note could be made."""


class RelayUnreachable(CannotRun, ConnectionError):
    """The relay refused, or did not greet within ANSWER_S: said at once, not after the day's patience."""


ANSWER_S = 8.0  # a test send answers in seconds, as listmonk's does


def test_send(settings: Settings, to: str, trade_date: str, input_url: str = "") -> dict:
    if not EMAIL.match(to):
        raise NothingToSend(f"--to {to!r} is not an e-mail address a relay takes (ASCII, user@domain)")
    for target in settings.smtp():
        _greets(target, settings.smtp_ca_file)
    # one mail, not a day: a relay that stops answering mid-way is said within seconds too
    settings = dataclasses.replace(settings, smtp_patience_s=ANSWER_S, smtp_wait_s=ANSWER_S, smtp_attempts=1)
    run_id = f"test-send-{uuid.uuid4().hex[:8]}"
    resolved, signer = credentials.read(settings)
    state = RunState(settings.redis_url, run_id, 3600)
    with tempfile.TemporaryDirectory(prefix="cn-test-send-") as tmp:
        if not input_url:
            write_dumps(Path(tmp) / "input", SynthOptions(dt.date.fromisoformat(trade_date), 3, seed=7))
        inputs, store = open_store(input_url or f"{tmp}/input"), open_store(f"{tmp}/store")
        plan = make_plan(inputs, trade_date, settings.shard_size, 1, holidays_file=settings.holidays_file,
                         entity=broker(settings.broker_file))
        _, accounts = first_accounts(inputs, plan, trade_date, 1)
        if not accounts:
            raise NothingToSend(f"{inputs.url}: no client near the top of clients.csv traded on {trade_date}")
        ucc, client, trades = accounts[0]
        account = json.loads(shard_line(ucc, client, trades, TEST_NOTE))
        account["client"].update(email=to, ecn_opt_in="Y")
        state.start({"date": trade_date, "input": "test send", "finished": ""})
        try:
            with held(state, settings.lease_s) as lease:
                batch = Batch(run_id, trade_date, 0, lease=lease.token,
                              settles=trading_calendar.settlement_dates(trade_date, settings.holidays_file),
                              broker_file=settings.broker_file)
                result = mail_notes(settings, resolved, signer, batch, [account], store, state)
            record = state.accounts([ucc]).get(ucc, {})
        finally:
            _forget(state)
    status = "delivered" if result["tally"].get("ok") else record.get("status") or "failed"
    return {"to": to, "client": ucc, "note": TEST_NOTE, "status": status, "message_id": record.get("message_id", ""),
            "reply": record.get("reply", ""), "reason": record.get("reason", ""), "relays": resolved.relays()}


def _greets(target, ca_file: str = "") -> None:
    """The relay answers with its greeting within ANSWER_S, before a note is made for it; an
    smtps:// relay's certificate checked as the mailers check it (CN_SMTP_CA_FILE, else the
    system's CAs)."""
    try:
        if target.implicit_tls:
            client = smtplib.SMTP_SSL(target.host, target.port, timeout=ANSWER_S,
                                      context=ssl.create_default_context(cafile=ca_file or None))
        else:
            client = smtplib.SMTP(target.host, target.port, timeout=ANSWER_S)
        client.close()
    except (OSError, smtplib.SMTPException) as e:
        silent = isinstance(e, TimeoutError) or "timed out" in str(e)  # smtplib says a silent greeting its way
        said = f"did not answer within {ANSWER_S:g} s" if silent else f"refused: {e}"
        raise RelayUnreachable(f"the relay {target.url()} {said} (SMTP_URL, or --smtp)") from None


def _forget(state: RunState) -> None:
    """The throwaway run leaves no trace in Redis: not in the list of runs, no keys."""
    state.r.zrem(keys.RUNS, state.run_id)
    for key in state.r.scan_iter(f"cn:run:{state.run_id}:*"):
        state.r.delete(key)
