"""Bounces none forged, none lost, none twice (issue 32, section 2): each attack or accident on
`bounces` as a broker's mailbox sees it, against a run recorded in a real Redis and a store."""

from __future__ import annotations

import hashlib
import imaplib
import json
import mailbox
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from pipeline.__main__ import main
from pipeline.followup import bounces
from pipeline.mail import verp
from pipeline.mail.smtp_sink import dsn
from pipeline.record import delivery_log, keys, report
from pipeline.record.lease import reader
from pipeline.record.manifest import SplitResult, save_manifest
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import ROOT, Settings
from tests import servers
from tests.conftest import TRADE_DATE
from tests.test_bounces import deliver

UCCS = [f"C{n:07d}" for n in range(1, 21)]


def a_run(redis_url: str, keys_dir: Path, store: Path, closed: bool = False) -> tuple[Settings, RunState, str]:
    """A run whose accounts were all mailed, in Redis and in storage, with a report."""
    run_id = f"b-{uuid.uuid4().hex[:8]}"
    settings = Settings(store_url=str(store), redis_url=redis_url, token_key_file=str(keys_dir / "token.key"))
    state = RunState(redis_url, run_id)
    state.start({"date": TRADE_DATE, "finished": 1.0, "bounce_window_h": 72, "message_ids": "keyed",
                 "store_url": str(store), **({"closed_at": 2.0} if closed else {})})
    key = settings.hmac_key()
    state.record([Outcome(u, "delivered", message_id=keys.message_id(run_id, u, key), reply="250 ok") for u in UCCS])
    for shard in range(10):  # the shards as a split writes them, each account in its own
        open_store(str(store)).put(keys.shard_key(run_id, shard), "".join(
            json.dumps({"ucc": u}) + "\n" for u in UCCS if keys.shard_of(u, 10) == shard).encode())
    save_manifest(open_store(str(store)), run_id, SplitResult(list(range(10)), 10, len(UCCS)))
    report.write(open_store(str(store)), state, run_id, {"run_id": run_id, "trade_date": TRADE_DATE,
                                                        "accounts": len(UCCS)}, [])
    return settings, state, run_id


def returned(ucc: str, mid: str) -> bytes:
    return f"From: notes@broker.example.com\r\nTo: {ucc.lower()}@clients.test\r\nMessage-ID: {mid}\r\n\r\n".encode()


def a_dsn(settings: Settings, run_id: str, ucc: str, kind: str = "bounced", named: str | None = None) -> bytes:
    """A DSN to `ucc`'s VERP address; its returned headers name `named`'s Message-ID (default: its own)."""
    v = verp.Verp(settings.bounce_local, settings.bounce_domain, settings.hmac_key())
    mid = keys.message_id(run_id, named or ucc, settings.hmac_key())
    return dsn(kind, v.address(run_id, ucc), f"{ucc.lower()}@clients.test", returned(named or ucc, mid))


def maildir(path: Path, messages: list[bytes]) -> Path:
    for sub in ("new", "cur", "tmp"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    for m in messages:
        (path / "new" / f"{uuid.uuid4().hex}.eml").write_bytes(m)
    return path


def logged(settings: Settings, run_id: str, *statuses: str) -> list[dict]:
    return [e for e in delivery_log.entries(open_store(settings.store_url), run_id) if e["status"] in statuses]


def test_a_tokenless_dsn_naming_a_message_id_anyone_could_compute_changes_nobody(redis_url, keys_dir, tmp_path):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    victim, genuine = UCCS[0], UCCS[1]
    unkeyed = "<" + hashlib.sha256(f"{run_id}/{victim}".encode()).hexdigest()[:24] + f".{victim}@contract-notes.invalid>"
    box = mailbox.mbox(tmp_path / "b.mbox")
    box.add(dsn("bounced", "rewritten@relay.example", "x@clients.test", returned(victim, unkeyed)))
    box.add(dsn("bounced", "rewritten@relay.example", "y@clients.test",
                returned(genuine, keys.message_id(run_id, genuine, settings.hmac_key()))))
    box.flush()

    result = bounces.collect(settings, run_id, [str(tmp_path / "b.mbox")])

    assert result["bounced"] == 1 and "bounce" not in state.accounts([victim])[victim], result
    assert state.accounts([genuine])[genuine]["bounce"]["kind"] == "bounced"
    assert keys.message_id(run_id, victim, settings.hmac_key()) != unkeyed


def unseen(imap_url: str) -> int:
    box = imaplib.IMAP4("127.0.0.1", int(imap_url.rsplit(":", 1)[1].split("/")[0]))
    box.login(servers.DOVECOT_USER, servers.DOVECOT_PASSWORD)
    box.select("INBOX")
    found = len((box.uid("SEARCH", None, "UNSEEN")[1][0] or b"").split())
    box.logout()
    return found


def test_a_shared_imap_mailbox_leaves_another_run_s_bounce_for_it(redis_url, keys_dir, tmp_path, imap_box):
    first_settings, first, e1 = a_run(redis_url, keys_dir, tmp_path / "s1")
    second_settings, second, e2 = a_run(redis_url, keys_dir, tmp_path / "s2")
    deliver(imap_box.url, [a_dsn(second_settings, e2, UCCS[3]), a_dsn(first_settings, e1, UCCS[2])])

    one = bounces.collect(first_settings, e1, [imap_box.url])
    assert (one["bounced"], one["left_for_other_runs"]) == (1, 1) and unseen(imap_box.url) == 1, one
    two = bounces.collect(second_settings, e2, [imap_box.url])
    assert two["bounced"] == 1 and second.accounts([UCCS[3]])[UCCS[3]]["bounce"]["kind"] == "bounced", two
    assert unseen(imap_box.url) == 0, "recorded by its own run, then seen"


def test_a_second_reader_of_a_run_exits_2_in_one_line_and_nothing_is_logged_twice(
        redis_url, keys_dir, tmp_path, imap_box, monkeypatch, capsys):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    deliver(imap_box.url, [a_dsn(settings, run_id, u) for u in UCCS[:5]])
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("CN_TOKEN_KEY_FILE", settings.token_key_file)
    with reader(redis.Redis.from_url(redis_url, decode_responses=True), keys.run_bounce_reader(run_id), "x", 30):
        assert main(["bounces", run_id, "--imap", imap_box.url]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "one reader at a time" in errors[0], errors
    assert unseen(imap_box.url) == 5, "the refused reader read nothing"
    assert main(["bounces", run_id, "--imap", imap_box.url]) == 0
    assert main(["bounces", run_id, "--imap", imap_box.url]) == 0
    assert len(logged(settings, run_id, "bounced")) == 5


@pytest.mark.parametrize("redis_after", ["kept", "restarted empty"])
def test_a_reader_killed_between_the_log_and_redis_logs_each_dsn_once_and_the_report_follows(
        redis_after, redis_url, keys_dir, tmp_path, monkeypatch):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    box = maildir(tmp_path / "box", [a_dsn(settings, run_id, u, "bounced" if n % 2 else "deferred")
                                     for n, u in enumerate(UCCS[:10])])

    def killed(*a, **kw):
        raise KeyboardInterrupt  # as SIGKILL would stop it: after the log, before Redis and the report

    with monkeypatch.context() as m:
        m.setattr(RunState, "bounce", killed)
        with pytest.raises(KeyboardInterrupt):
            bounces.collect(settings, run_id, [str(box)])
    assert len(logged(settings, run_id, "bounced", "deferred")) == 10 and "bounce" not in state.accounts([UCCS[1]])[UCCS[1]]
    if redis_after == "restarted empty":
        r = redis.Redis.from_url(redis_url)
        r.delete(*r.keys(f"cn:run:{run_id}:*"))

    again = bounces.collect(settings, run_id, [str(box)])

    entries = logged(settings, run_id, "bounced", "deferred")
    assert sorted(e["ucc"] for e in entries) == sorted(UCCS[:10]), "each DSN logged once"
    counts = state.counts()
    assert (counts["bounced"], counts["deferred"]) == (5, 5), again
    stored = json.loads(open_store(settings.store_url).get(keys.report_keys(run_id)[0]))
    assert (stored["bounced"], stored["deferred"]) == (5, 5), "the report equals the log after every pass"


def test_a_dsn_whose_token_and_message_id_disagree_is_recorded_for_the_token_and_flagged(
        redis_url, keys_dir, tmp_path):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    box = maildir(tmp_path / "box", [a_dsn(settings, run_id, UCCS[4], named=UCCS[5])])

    result = bounces.collect(settings, run_id, [str(box)])

    assert result["token_mismatch"] == 1 and result["bounced"] == 1, result
    [entry] = logged(settings, run_id, "bounced")
    assert entry["ucc"] == UCCS[4] and entry["token_mismatch"] is True
    rows = open_store(settings.store_url).get(keys.report_keys(run_id)[1]).decode()
    row = next(line for line in rows.splitlines() if line.startswith(UCCS[4]))
    assert "token_mismatch" in row and "bounce" not in state.accounts([UCCS[5]])[UCCS[5]]


def test_a_dsn_after_close_is_logged_as_refused_after_close_and_counted(redis_url, keys_dir, tmp_path):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store", closed=True)
    before = open_store(settings.store_url).get(keys.report_keys(run_id)[1])
    box = maildir(tmp_path / "box", [a_dsn(settings, run_id, UCCS[6])])

    result = bounces.collect(settings, run_id, [str(box)])
    again = bounces.collect(settings, run_id, [str(maildir(tmp_path / "box2", [a_dsn(settings, run_id, UCCS[6])]))])

    assert (result["refused_after_close"], result["bounced"], again["refused_after_close"]) == (1, 0, 1), result
    assert [e["ucc"] for e in logged(settings, run_id, "refused_after_close")] == [UCCS[6]], "logged once"
    assert "bounce" not in state.accounts([UCCS[6]])[UCCS[6]]
    assert open_store(settings.store_url).get(keys.report_keys(run_id)[1]) == before


def nested(depth: int, kind: str) -> bytes:
    """A message whose MIME nests `depth` levels deep, inside a DSN-looking envelope."""
    inner = b"Content-Type: text/plain\r\n\r\nhello\r\n"
    for n in range(depth):
        if kind == "message/rfc822":
            inner = b"Content-Type: message/rfc822\r\n\r\n" + inner
        else:
            inner = (f'Content-Type: multipart/mixed; boundary="b{n}"\r\n\r\n--b{n}\r\n'.encode() + inner
                     + f"\r\n--b{n}--\r\n".encode())
    return b"From: MAILER-DAEMON@x.example\r\nSubject: Undelivered Mail\r\n" + inner


@pytest.mark.parametrize("kind", ["message/rfc822", "multipart/mixed"])
def test_mime_nested_500_deep_is_refused_and_seen_and_the_genuine_dsn_beside_it_recorded(
        kind, redis_url, keys_dir, tmp_path):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    box = maildir(tmp_path / "box", [nested(500, kind), a_dsn(settings, run_id, UCCS[7])])

    result = bounces.collect(settings, run_id, [str(box)])

    assert result["bounced"] == 1 and result["refused"] == 1, result
    assert "not a readable message" in result["refused_first"][0]["why"] or "no failed" in result["refused_first"][0]["why"]
    assert not list((box / "new").iterdir()), "the poison message is seen too: never retried forever"


def test_a_200_mb_message_in_an_mbox_is_reported_by_its_size_without_being_read(redis_url, keys_dir, tmp_path):
    settings, _, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    path = tmp_path / "big.mbox"
    with path.open("wb") as f:
        f.write(b"From MAILER-DAEMON Thu Nov 20 10:00:00 2026\n" + a_dsn(settings, run_id, UCCS[8]).replace(b"\r\n", b"\n"))
        f.write(b"\nFrom MAILER-DAEMON Thu Nov 20 10:00:01 2026\nSubject: huge\n\n")
        line = b"x" * 1023 + b"\n"
        for _ in range(200 * 1024):
            f.write(line)
    code = ("import json, sys; from pathlib import Path; from pipeline.mail.mailbox import MboxSource; "
            "from pipeline.cluster.driver import peak_rss_mb; b = MboxSource(Path(sys.argv[1]), 5_000_000); "
            "found = [(m.size, m.raw is None) for m in b.unseen()]; print(json.dumps([found, peak_rss_mb()]))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, check=True)
    found, peak = json.loads(done.stdout)
    assert found[1][0] > 200_000_000 and found[1][1] and not found[0][1], found
    assert peak < 250, f"peak RSS {peak} MB: the message was read"


def test_an_mbox_with_no_from_line_says_so_in_one_line(redis_url, keys_dir, tmp_path, monkeypatch, capsys):
    settings, _, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    (tmp_path / "not.mbox").write_bytes(a_dsn(settings, run_id, UCCS[9]))
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("CN_TOKEN_KEY_FILE", settings.token_key_file)
    assert main(["bounces", run_id, "--mbox", str(tmp_path / "not.mbox")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not an mbox file" in errors[0], errors


def test_a_dsn_behind_100_000_headers_is_refused_as_too_large(redis_url, keys_dir, tmp_path):
    settings, state, run_id = a_run(redis_url, keys_dir, tmp_path / "store")
    padded = b"".join(f"X-Pad-{n}: y\r\n".encode() for n in range(100_000)) + a_dsn(settings, run_id, UCCS[10])
    box = maildir(tmp_path / "box", [padded])

    result = bounces.collect(settings, run_id, [str(box)])

    assert result["refused"] == 1 and "too large" in result["refused_first"][0]["why"], result
    assert "bounce" not in state.accounts([UCCS[10]])[UCCS[10]]


def test_a_follow_up_whose_run_recorded_an_hmac_key_never_makes_a_new_one(
        redis_url, keys_dir, tmp_path, monkeypatch, capsys):
    from pipeline.settings import key_id

    key_file = tmp_path / "keys" / "token.key"
    key_file.parent.mkdir()
    key_file.write_bytes((keys_dir / "token.key").read_bytes())
    settings, state, run_id = a_run(redis_url, tmp_path / "keys", tmp_path / "store")
    state.update_meta(token_key_file=str(key_file), token_key_id=key_id(settings.hmac_key()))
    box = maildir(tmp_path / "box", [a_dsn(settings, run_id, UCCS[11])])
    key_file.unlink()
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.chdir(tmp_path)

    assert main(["bounces", run_id, "--maildir", str(box)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is missing" in errors[0] and "never made anew" in errors[0], errors
    assert not key_file.exists() and not (tmp_path / ".keys").exists(), "no new key, here or where the run had it"
    key_file.write_text("another key")
    assert main(["bounces", run_id, "--maildir", str(box)]) == 2
    assert "is not the one the run signed" in capsys.readouterr().err
