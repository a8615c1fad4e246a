"""Mail a mailbox provider accepts: with CN_DKIM_KEY, CN_DKIM_SELECTOR and CN_DKIM_DOMAIN each
message leaves DKIM-signed, and dkimpy's verifier, asking a local DNS answer for the published
key, passes every message as the relay received it and fails a tampered one. A d= that does
not align with the From domain is refused in one line, before anything is sent."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dkim
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from dkim.canonicalization import Relaxed

from pipeline import credentials
from pipeline.mail import dkim_signer
from pipeline.mail.dkim_signer import DkimKeyError, dkim_from_pem, dns_record, relaxed_body
from pipeline.mail.message import Letter, build_message
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import ROOT, ConfigError, Settings
from tests.conftest import TRADE_DATE

SELECTOR, DOMAIN = "cn2026", "broker.example.com"
LETTER = Letter("Contract Notes <contract-notes@broker.example.com>", "Desk <desk@broker.example.com>")


@pytest.fixture(scope="module")
def dkim_pem() -> bytes:
    key = rsa.generate_private_key(65537, 2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def dkim_key_file(dkim_pem, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dkim") / "dkim.key.pem"
    path.write_bytes(dkim_pem)
    return path


def local_dns(pem: bytes):
    """A dnsfunc answering SELECTOR._domainkey.DOMAIN's TXT record as the broker would publish it."""
    name, value = dns_record(dkim_from_pem(pem, SELECTOR, DOMAIN, "test"))
    return lambda asked, timeout=5: value.encode() if asked.decode().rstrip(".") == name else None


def signed_message(pem: bytes, name: str = "Aarav Iyer") -> bytes:
    raw = build_message(LETTER, name, "c1@example.com", TRADE_DATE, "C1", "<m1@x>", b"%PDF-1.7\n" * 5000)
    return dkim_from_pem(pem, SELECTOR, DOMAIN, "test").sign(raw)


def test_a_signed_message_verifies_against_the_published_key(dkim_pem):
    message = signed_message(dkim_pem)
    assert message.startswith(b"DKIM-Signature: v=1; a=rsa-sha256; c=relaxed/relaxed;")
    assert dkim.verify(message, dnsfunc=local_dns(dkim_pem))
    signature = dkim.DKIM(message)
    signature.verify(dnsfunc=local_dns(dkim_pem))
    assert signature.domain == DOMAIN.encode() and signature.selector == SELECTOR.encode()
    assert {b"from", b"to", b"subject", b"date", b"message-id", b"mime-version", b"content-type"} <= \
        set(signature.include_headers)


@pytest.mark.parametrize("tamper", [
    lambda m: m.replace(b"Aarav Iyer", b"Aarav Iyar"),  # the To header
    lambda m: m.replace(b"Date: ", b"Date: Mon, 01 Jan 2024 00:00:00 -0000\r\nX-Old-Date: ", 1),
    lambda m: m[:-200] + (b"A" if m[-200:-199] != b"A" else b"B") + m[-199:],  # a byte of the attachment
])
def test_a_tampered_message_fails_verification(dkim_pem, tamper):
    message = signed_message(dkim_pem)
    assert tamper(message) != message
    assert not dkim.verify(tamper(message), dnsfunc=local_dns(dkim_pem))


def test_a_message_signed_with_another_key_fails_verification(dkim_pem):
    other = rsa.generate_private_key(65537, 2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    assert not dkim.verify(signed_message(other), dnsfunc=local_dns(dkim_pem))


@pytest.mark.parametrize("body", [b"", b"\r\n", b"a\r\n\r\n\r\n", b"a  b \t\r\nc\t\r\n", b"x\ny\r\n", b"abc",
                                  b"QUJD\r\nREVG\r\n--=_b--\r\n"])
def test_the_relaxed_body_is_what_dkimpy_makes_of_it(body):
    assert relaxed_body(body) == Relaxed.canonicalize_body(b"\r\n".join(re.split(b"\r?\n", body)))


@pytest.mark.parametrize("mail_from, domain", [
    ("Notes <notes@broker.example.com>", "mail.broker.example.com"),  # d= a subdomain
    ("Notes <notes@news.broker.example.com>", "broker.example.com"),  # From a subdomain
    ("Notes <notes@Broker.Example.com>", "broker.example.com"),
])
def test_an_aligned_dkim_domain_is_taken(mail_from, domain):
    Settings(mail_from=mail_from, dkim_selector=SELECTOR, dkim_domain=domain)


@pytest.mark.parametrize("mail_from, domain", [
    ("Notes <notes@broker.example.com>", "esp.example.net"),
    ("Notes <notes@broker.example.com>", "notbroker.example.com"),  # a suffix, not a parent
    ("Notes <notes@a.example.com>", "b.example.com"),
])
def test_a_dkim_domain_that_does_not_align_with_the_from_domain_is_refused(mail_from, domain):
    with pytest.raises(ConfigError, match="does not align with the From domain"):
        Settings(mail_from=mail_from, dkim_selector=SELECTOR, dkim_domain=domain)


@pytest.mark.parametrize("given, said", [
    (dict(dkim_selector=SELECTOR), "go together"), (dict(dkim_domain=DOMAIN), "go together"),
    (dict(dkim_key="/k.pem"), "without CN_DKIM_SELECTOR"),
    (dict(dkim_selector="bad selector", dkim_domain=DOMAIN), "is not a selector"),
    (dict(dkim_selector=SELECTOR, dkim_domain="not a domain"), "is not a domain name"),
])
def test_half_a_dkim_setting_is_refused(given, said):
    with pytest.raises(ConfigError, match=said):
        Settings(**given)


def test_a_misaligned_dkim_domain_stops_a_command_in_one_line(tmp_path, dkim_key_file):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CN_DKIM_KEY": str(dkim_key_file),
           "CN_DKIM_SELECTOR": SELECTOR, "CN_DKIM_DOMAIN": "esp.example.net", "CN_STORE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pipeline", "config"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        "error: CN_DKIM_DOMAIN=esp.example.net does not align with the From domain 'broker.example.com' "
        "(CN_MAIL_FROM): DMARC would fail; sign as the From domain, a parent or a subdomain of it"]


def test_without_the_dkim_settings_the_mail_goes_unsigned(settings):
    resolved, signer = credentials.for_mailer(settings)
    assert signer is None and resolved.smtp_url == settings.smtp_url


@pytest.mark.parametrize("pem, said", [
    (b"not a key", "not a PEM private key"),
    (ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), "must be RSA"),
    (rsa.generate_private_key(65537, 1024).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw")), "encrypted"),
])
def test_a_dkim_key_that_cannot_sign_is_one_line_naming_where_it_is(pem, said, tmp_path, settings):
    path = tmp_path / "bad.pem"
    path.write_bytes(pem)
    with pytest.raises(DkimKeyError, match=said) as e:
        credentials.for_mailer(dkim_settings(settings, path))
    assert str(path) in str(e.value) and "\n" not in str(e.value) and "PRIVATE" not in str(e.value)


def test_the_dkim_key_comes_from_the_secret_as_the_other_keys_do(settings, dkim_key_file, dkim_pem, tmp_path):
    made = json.loads(credentials.secret_json(dkim_settings(settings, dkim_key_file)))
    assert made["dkim_key_pem"] == dkim_pem.decode()
    path = tmp_path / "secret.json"
    path.write_text(json.dumps(made))
    on_cluster = dataclasses.replace(settings, secret=f"file:{path}", dkim_selector=SELECTOR, dkim_domain=DOMAIN)
    resolved, signer = credentials.for_mailer(on_cluster)
    assert signer is not None and resolved.token_key == made["token_key"]
    message = build_message(LETTER, "A", "a@example.com", TRADE_DATE, "C2", "<m2@x>", b"%PDF")
    assert dkim.verify(signer.sign(message), dnsfunc=local_dns(dkim_pem))
    assert "PRIVATE" not in repr(signer) + repr(on_cluster)


def dkim_settings(settings: Settings, key: Path) -> Settings:
    return dataclasses.replace(settings, mail_from=LETTER.sender, dkim_key=str(key), dkim_selector=SELECTOR,
                               dkim_domain=DOMAIN)


def test_the_mail_stage_sends_mail_that_verifies_as_the_relay_received_it(settings, smtp_sink, dkim_key_file,
                                                                          dkim_pem):
    """Through the mailer's own path: credentials.for_mailer loads the key once, mail_context
    holds it, mail_stage signs; the sink keeps each message byte for byte as it arrived."""
    assert mailed_through(dkim_settings(settings, dkim_key_file), 5) == {"ok": 5}
    received = [p.read_bytes() for p in sorted(smtp_sink.outbox.glob("*.eml"))]
    assert len(received) == 5
    assert all(dkim.verify(m, dnsfunc=local_dns(dkim_pem)) for m in received)
    tampered = re.sub(rb"Client \d", b"Mallory", received[0], count=1)
    assert tampered != received[0] and not dkim.verify(tampered, dnsfunc=local_dns(dkim_pem))


def test_the_key_is_loaded_once_a_mailer_never_once_a_message(settings, smtp_sink, dkim_key_file, monkeypatch):
    loads = []
    monkeypatch.setattr(dkim_signer, "dkim_from_pem", lambda *a: loads.append(a[3]) or dkim_from_pem(*a))
    assert mailed_through(dkim_settings(settings, dkim_key_file), 6) == {"ok": 6}
    assert loads == [f"CN_DKIM_KEY {dkim_key_file}"]


def test_a_run_whose_dkim_key_cannot_be_read_is_refused_before_anything_starts(settings, day, tmp_path):
    from pipeline.cluster.driver import RunRequest, preflight

    with pytest.raises(ConfigError, match=f"CN_DKIM_KEY {tmp_path}/missing.pem: cannot read it"):
        preflight(dkim_settings(settings, tmp_path / "missing.pem"), RunRequest(TRADE_DATE, str(day)))


def test_a_day_mails_every_note_dkim_signed(ray_session, settings, day, smtp_sink, dkim_key_file, dkim_pem):
    """A real day: the driver's first notes and the MailerActors' shards, each message as the
    relay received it verified against the published key."""
    from pipeline.cluster.driver import RunRequest, run_day

    summary = run_day(dkim_settings(settings, dkim_key_file), RunRequest(TRADE_DATE, str(day)))
    received = [p.read_bytes() for p in sorted(smtp_sink.outbox.glob("*.eml"))]
    assert summary["delivered"] > 0 and len(received) == summary["delivered"]
    unverified = [m[:300] for m in received if not dkim.verify(m, dnsfunc=local_dns(dkim_pem))]
    assert not unverified


def test_a_postfix_relay_with_opendkim_signs_the_unsigned_mail_and_it_verifies(settings, tmp_path, dkim_pem):
    """CN_DKIM_* unset: the mailers send unsigned, and the relay signs (Postfix with Debian's
    OpenDKIM as its milter, relaxed/relaxed, d= the From domain); what reaches the mailbox,
    with the relay's own headers on top, verifies against the same published key."""
    from tests import servers

    key = tmp_path / "opendkim.key.pem"
    key.write_bytes(dkim_pem)
    key.chmod(0o600)
    milter = servers.start_opendkim(tmp_path / "opendkim", key, SELECTOR, DOMAIN)
    mta = servers.start_postfix({"@example.com": "clients"}, {"example.com"}, settings.bounce_domain, milter=milter.url)
    try:
        unsigned = dataclasses.replace(settings, smtp_url=mta.url, mail_from=LETTER.sender)
        assert mailed_through(unsigned, 3) == {"ok": 3}
        delivered = wait_for_files(mta.root / "vmail" / "clients" / "new", 3)
    finally:
        mta.stop()
        milter.stop()
    assert all(m.count(b"DKIM-Signature:") == 1 for m in delivered), "signed once, by the relay"
    assert all(dkim.verify(m, dnsfunc=local_dns(dkim_pem)) for m in delivered)


def mailed_through(settings: Settings, n: int) -> dict:
    """The mail stage's tally for `n` notes mailed with these settings, as a mailer would."""
    from pipeline.stages import Batch, mail_context, mail_stage

    resolved, signer = credentials.for_mailer(settings)
    run_id = f"dkim-{uuid.uuid4().hex[:6]}"
    store, state = open_store(resolved.store_url), RunState(resolved.redis_url, run_id)
    state.start({})
    items = [{"ucc": f"R{i:03d}", "name": f"Client {i}", "email": f"r{i}@example.com", "pan": "ABCPD1234E",
              "ecn": True, "pdf": b"%PDF-1.7\n" + bytes([i]) * 20_000} for i in range(n)]

    async def mail() -> dict:
        ctx = mail_context(resolved, state, store, dkim=signer)
        try:
            return await mail_stage(Batch(run_id, TRADE_DATE, 0, items, lease=state.take_lease(120).token), ctx)
        finally:
            await ctx.pool.close()

    return asyncio.new_event_loop().run_until_complete(mail())["tally"]


def wait_for_files(folder: Path, n: int, timeout_s: float = 30) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(folder.glob("*")) if folder.exists() else []
        if len(files) >= n:
            return [f.read_bytes() for f in files]
        time.sleep(0.2)
    raise AssertionError(f"{folder}: {len(files)} of {n} messages delivered within {timeout_s} s")
