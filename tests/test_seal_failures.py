"""A seal no failure can half-write (issue 69): the timestamp authority, the store and the signer
fail at each point of `close`'s seal, through the real close and real servers (OpenSSL's TSA,
versitygw behind a proxy that refuses a PUT or loses its reply, SoftHSM behind p11-kit server).
Each time `verify` reads the record as a close begun (exit 3), never as tampered (exit 1), and
the next close, its dependency back, seals it whole (exit 0).

The record is the run test_proof.py mails, bounces and closes for its module, as it was before
that close; each test works on a copy of it, in a folder or in a bucket of its own."""

from __future__ import annotations

import dataclasses
import types
from datetime import timedelta
from pathlib import Path

import boto3
import pytest

from pipeline.cluster.driver import RunRequest, run_day
from pipeline.errors import CannotRun
from pipeline.followup import close as proof
from pipeline.followup.verify import exit_status, verify
from pipeline.record import keys, s3
from pipeline.record.storage import open_store
from pipeline.seal import timestamp
from pipeline.seal.signer import SignError
from pipeline.seal.token import P11_KIT_CLIENT, SOFTHSM
from tests import servers
from tests.conftest import HSM_SOCKET, TRADE_DATE
from tests.test_hsm import on_token
from tests import test_proof
from tests.test_proof import after_the_window, copy

closed_run = test_proof.closed_run  # its run, closed once a module that asks for it
SEAL = (".proof.json", ".proof.p7s", ".proof.tsr")  # the seal's objects, in the order close writes them


def seal_objects(store, run_id: str) -> list[str]:
    return [k for k in (*keys.proof_keys(run_id), keys.timestamp_key(run_id)) if store.exists(k)]


def began(store, run_id: str, **kw) -> dict:
    found = verify(store, run_id, **kw)
    assert found["ok"] and not found["sealed"] and exit_status(found) == 3, found
    assert "close began" in found["summary"] and "close again" in found["summary"], found["summary"]
    return found


def sealed(store, run_id: str, **kw) -> dict:
    found = verify(store, run_id, **kw)
    assert found["ok"] and found["sealed"] and exit_status(found) == 0, found
    return found


@pytest.fixture
def tsa(tmp_path):
    """The test TSA, told to fail through `faults["answer"]`."""
    faults: dict[str, str | bytes] = {}
    url, cert, stop = servers.start_tsa(tmp_path / "tsa", faults)
    yield types.SimpleNamespace(url=url, cert=cert.read_bytes(), faults=faults)
    stop()


@pytest.fixture
def on_s3(s3_endpoint, monkeypatch):
    """put(folder) -> the URL of a new bucket holding the folder store's objects, reached through
    a proxy (servers.S3Between) with the faults given; retries back off by milliseconds."""
    proxies = []
    monkeypatch.setattr(s3, "BACKOFF", {"init_backoff": timedelta(milliseconds=1), "max_backoff": timedelta(milliseconds=5)})

    def put(root: Path, **faults) -> tuple[str, servers.S3Between]:
        bucket = f"seal-{len(proxies)}-{abs(hash(root)) % 10**8}"
        client = boto3.client("s3", endpoint_url=s3_endpoint)
        client.create_bucket(Bucket=bucket)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, path.relative_to(root).as_posix())
        proxies.append(servers.S3Between(s3_endpoint, **faults))
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxies[-1].url)
        return f"s3://{bucket}", proxies[-1]
    yield put
    for proxy in proxies:
        proxy.stop()


@pytest.mark.parametrize("answer", ["garbage", "garbage in a sequence"])
def test_a_tsa_answering_garbage_is_said_in_one_line_as_no_rfc_3161_reply(tsa, answer):
    """Random bytes fail pyHanko's parse of the reply; behind a SEQUENCE's header they pass it
    (asn1crypto reads lazily) and fail ours. Before, the first was said as "gave no timestamp",
    the second as "answered with no RFC 3161 reply" with asn1crypto's "\n    while parsing ..."
    in it: close's one line was two (random garbage opens with a SEQUENCE's tag and a length
    that fits about 1 time in 1,000: one suite run failed so)."""
    tsa.faults["answer"] = answer
    for _ in range(5):
        with pytest.raises(SignError) as refused:
            timestamp.request(tsa.url, b"a proof")
        said = str(refused.value)
        assert said.startswith("answered with no RFC 3161 reply (") and "\n" not in said, said


def _refusal(*fields: bytes) -> bytes:
    """A DER TimeStampResp of status rejection (2) and these fields after it, no token."""
    info = b"\x02\x01\x02" + b"".join(fields)
    return b"\x30" + bytes([len(info) + 2]) + b"\x30" + bytes([len(info)]) + info


@pytest.mark.parametrize("answer, said", [
    (_refusal(b"\x03\x02\x06\x40"), "refused: rejection (1)"),  # failInfo bit 1: no name in asn1crypto
    (_refusal(b"\x30\x04\x0c\x02\xff\xfe"), "answered with no RFC 3161 reply (UnicodeDecodeError")],  # words not UTF-8
    ids=["unnamed failure bit", "words not utf-8"])
def test_a_refusal_worded_oddly_is_said_in_one_line_not_a_traceback(tsa, answer, said):
    """Found by the outside review: the refusal's words and failure bits were read outside the
    parse's guard, so such a reply ended close in a TypeError or UnicodeDecodeError's traceback."""
    tsa.faults["answer"] = answer
    with pytest.raises(SignError) as refused:
        timestamp.request(tsa.url, b"a proof")
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value), str(refused.value)


def test_a_tsa_url_that_cannot_be_encoded_is_no_timestamp_not_a_reply_it_gave():
    """Nothing answered: the URL's host is no name IDNA can encode (an empty label)."""
    with pytest.raises(SignError) as refused:
        timestamp.request("http://tsa..example.com/", b"a proof")
    assert str(refused.value).startswith("gave no timestamp (UnicodeError"), str(refused.value)


@pytest.mark.parametrize("answer", ["refuse", "garbage"])
def test_a_tsa_that_cannot_serve_fails_close_in_one_line_before_the_seal_and_the_next_close_seals(
        closed_run, tmp_path, tsa, answer):
    """Before, the proof and its signature were written, then the TSA asked: a refusal was a
    traceback, `verify` said "proof.tsr: removed" (exit 1) and every later close refused the run
    as "sealed, and its record no longer matches the seal"."""
    settings, run_id, opened, _, _ = closed_run
    root = copy(opened, tmp_path / "store")
    stamped = dataclasses.replace(settings, tsa_url=tsa.url)
    tsa.faults["answer"] = answer
    with pytest.raises(CannotRun) as refused:
        proof.close(stamped, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    said = str(refused.value)
    assert f"close {run_id}: the timestamp authority at {tsa.url}" in said and "\n" not in said, said
    assert ("refused: the time-stamping service is unavailable" if answer == "refuse"
            else "answered with no RFC 3161 reply") in said
    store = open_store(str(root))
    assert seal_objects(store, run_id) == [], "nothing of the seal is written without its timestamp"
    began(store, run_id)

    tsa.faults.clear()
    done = proof.close(stamped, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    assert not done["already_sealed"] and done["timestamp"], done
    assert sealed(store, run_id, tsa_cert_pem=tsa.cert)["timestamp"]["time"]


def test_a_close_run_again_from_a_shell_without_cn_tsa_url_stamps_with_the_authority_its_close_began_with(
        closed_run, tmp_path, tsa, caplog):
    """The TSA refused the first close; the operator runs close again from another shell, where
    CN_TSA_URL is not set. Before, that close sealed the run with no timestamp, and nothing of the
    record said one had been asked for. The warrant now names the authority the close asked."""
    settings, run_id, opened, _, _ = closed_run
    root = copy(opened, tmp_path / "store")
    tsa.faults["answer"] = "refuse"
    with pytest.raises(CannotRun):
        proof.close(dataclasses.replace(settings, tsa_url=tsa.url), run_id, now=after_the_window(settings, run_id),
                    store_url=str(root))
    tsa.faults.clear()
    assert not settings.tsa_url
    done = proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    assert done["timestamp"], "sealed without the timestamp its first close asked for"
    assert sealed(open_store(str(root)), run_id, tsa_cert_pem=tsa.cert)["timestamp"]["time"]
    assert f"the timestamp is asked of {tsa.url}, which its warrant names (CN_TSA_URL is not set)" in caplog.text


def test_a_tsa_s_password_in_cn_tsa_url_is_sent_and_kept_out_of_the_record_messages_and_log(
        closed_run, tmp_path, tsa, caplog):
    """A TSA that takes an account (CN_TSA_URL=https://user:password@host/...). Before, the warrant
    and the proof kept the URL whole, password and all, and the close's refusal and its log lines
    printed it. The record names the authority with its password masked; a close run again
    without CN_TSA_URL is told to give it, rather than asking with the masked one."""
    import base64

    from pipeline.settings import ConfigError

    settings, run_id, opened, _, _ = closed_run
    root = copy(opened, tmp_path / "store")
    account = dataclasses.replace(settings, tsa_url=tsa.url.replace("http://", "http://cn-seal:s3cret-pass@"))
    tsa.faults["answer"] = "unauthorised"
    with pytest.raises(CannotRun) as refused:
        proof.close(account, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    assert "cn-seal:***@" in str(refused.value) and "401" in str(refused.value), str(refused.value)
    tsa.faults.clear()
    with pytest.raises(ConfigError, match=r"cn-seal:\*\*\*@.* set CN_TSA_URL to it, with the password"):
        proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=str(root))
    done = proof.close(account, run_id, now=after_the_window(settings, run_id), store_url=str(root))

    assert done["timestamp"] and tsa.faults["authorization"] == "Basic " + base64.b64encode(b"cn-seal:s3cret-pass").decode()
    assert sealed(open_store(str(root)), run_id, tsa_cert_pem=tsa.cert)["timestamp"]["time"]
    kept = [p.relative_to(root) for p in root.rglob("*") if p.is_file() and b"s3cret-pass" in p.read_bytes()]
    assert kept == [] and "s3cret-pass" not in caplog.text + str(refused.value) + repr(done)
    assert b"cn-seal:***@" in (root / keys.proof_keys(run_id)[0]).read_bytes()


def test_a_warrant_from_before_that_kept_the_tsa_s_password_whole_is_used_and_never_logged(caplog):
    """Warrants and proofs written before the masking keep the URL whole (objects are written
    once): a close of such a run asks that authority, and says so without its password."""
    import logging

    from pipeline.settings import Settings

    whole = "https://cn-seal:s3cret-pass@tsa.example.com/tsr"
    with caplog.at_level(logging.INFO):
        assert proof._tsa(Settings(tsa_url=whole), "r1", whole, "warrant") == whole  # the same: nothing to say
        assert proof._tsa(Settings(), "r1", whole, "warrant") == whole
    assert "cn-seal:***@tsa.example.com/tsr, which its warrant names" in caplog.text
    assert "s3cret-pass" not in caplog.text and "(CN_TSA_URL), not" not in caplog.text


@pytest.mark.parametrize("refused", SEAL)
def test_a_store_refusing_each_write_of_the_seal_leaves_a_close_begun_that_the_next_close_seals(
        closed_run, tmp_path, tsa, on_s3, refused):
    """The S3 server fails every PUT of one of the seal's objects (500, past the store's retries):
    the proof alone, or the proof and its signature, read as a close begun, and the next close
    signs or timestamps the proof already stored. Before, those two read as tampered (exit 1:
    "signature ... not a CMS signature", "proof.tsr: removed") and no close could finish them."""
    settings, run_id, opened, _, _ = closed_run
    url, proxy = on_s3(copy(opened, tmp_path / "store"), faults={refused: "refuse"})
    stamped = dataclasses.replace(settings, tsa_url=tsa.url)
    with pytest.raises(CannotRun) as failed:
        proof.close(stamped, run_id, now=after_the_window(settings, run_id), store_url=url)
    assert "\n" not in str(failed.value) and refused in str(failed.value), failed.value
    store = open_store(url)
    assert [k[len(f"reports/{run_id}"):] for k in seal_objects(store, run_id)] == list(SEAL[:SEAL.index(refused)])
    began(store, run_id)

    proxy.faults.clear()
    done = proof.close(stamped, run_id, now=after_the_window(settings, run_id), store_url=url)
    assert not done["already_sealed"] and done["timestamp"], done
    sealed(store, run_id, tsa_cert_pem=tsa.cert)


@pytest.mark.parametrize("lost", SEAL[:2])
def test_a_seal_write_whose_reply_was_lost_is_settled_by_reading_it_back(closed_run, tmp_path, on_s3, lost):
    """The PUT landed and its reply was lost: sent again, it is refused as taken, by itself.
    Before, that read as "sealed by another close meanwhile" and close failed half-way."""
    settings, run_id, opened, _, _ = closed_run
    url, proxy = on_s3(copy(opened, tmp_path / "store"), faults={lost: "lose"})
    done = proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=url)
    assert not done["already_sealed"], done
    assert [k for k in proxy.put_keys if k.endswith(lost)] == [f"reports/{run_id}{lost}"] * 2, proxy.put_keys
    sealed(open_store(url), run_id)


def test_a_proof_another_close_wrote_first_is_adopted_and_sealed_when_the_record_matches_it(
        closed_run, tmp_path, on_s3, s3_endpoint):
    """Another close's proof (its own `sealed_at`) takes the key just before this close's PUT:
    refused as taken, by other bytes. Theirs is the seal: checked against the record and signed.
    Before, close failed "sealed by another close meanwhile", leaving a proof with no signature."""
    settings, run_id, opened, _, _ = closed_run
    proof_key, theirs = keys.proof_keys(run_id)[0], []

    def another_close_first(key: str, body: bytes) -> None:
        if key == proof_key and not theirs:
            theirs.append(body.replace(b'"sealed_at": ', b'"sealed_at": 1', 1))
            boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=url[5:], Key=key, Body=theirs[0])
    url, _ = on_s3(copy(opened, tmp_path / "store"), arriving=another_close_first)
    done = proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=url)
    store = open_store(url)
    assert not done["already_sealed"] and store.get(proof_key) == theirs[0], done
    sealed(store, run_id)


@pytest.mark.parametrize("lost_after", [1, 0])  # the warrant's signature stored, or the warrant alone
def test_the_hsm_lost_after_the_warrant_fails_close_in_one_line_before_the_seal_and_the_next_close_seals(
        ray_session, settings, day, hsm, session_dir, tmp_path, on_s3, lost_after):
    """The run signed on a network HSM (p11-kit server); the HSM killed once close's warrant is
    signed and stored, so the proof's signature is the first it cannot make. Before, the proof was
    written and then the signature failed: a SignError traceback, and `verify` said the proof's
    signature is no CMS signature (exit 1), for good. Killed once the warrant is stored and before
    it is signed, the warrant's own signature is the one it cannot make: a close begun all the same."""
    socket = session_dir / "hsm" / HSM_SOCKET
    hsm_server = servers.start_p11kit_server(socket, SOFTHSM, hsm.label)
    try:
        on_hsm = on_token(settings, hsm, module=P11_KIT_CLIENT, hsm_patience_s=2.0)
        run_id = run_day(on_hsm, RunRequest(TRADE_DATE, str(day)))["run_id"]

        def kill_the_hsm(key: str) -> None:
            if key == keys.closing_keys(run_id)[lost_after]:
                hsm_server.kill()
        url, _ = on_s3(Path(on_hsm.store_url), passed=kill_the_hsm)
        with pytest.raises(CannotRun) as failed:
            proof.close(on_hsm, run_id, now=after_the_window(on_hsm, run_id), store_url=url)
        said = str(failed.value)
        assert f"close {run_id}" in said and "HSM" in said and hsm.label in said and "\n" not in said, said
        store = open_store(url)
        assert seal_objects(store, run_id) == [] and store.exists(keys.closing_keys(run_id)[0])
        assert store.exists(keys.closing_keys(run_id)[1]) == (lost_after == 1)
        summary = began(store, run_id)["summary"]
        assert ("before its warrant was signed" in summary) == (lost_after == 0), summary
    finally:
        hsm_server.stop()

    back = servers.start_p11kit_server(socket, SOFTHSM, hsm.label)
    try:
        done = proof.close(on_hsm, run_id, now=after_the_window(on_hsm, run_id), store_url=url)
    finally:
        back.stop()
    assert not done["already_sealed"], done
    assert "Signatory on an HSM" in sealed(store, run_id)["signed_by"]


def test_an_unsigned_proof_is_signed_only_where_close_s_signed_warrant_vouches_for_it(closed_run, tmp_path):
    """A sealed run whose proof signature and warrant signature were removed (a proof rewritten
    with the chains to agree would look the same): the next close refuses to sign the proof. Before,
    a missing .p7s read as a close begun and any proof matching the record was signed again."""
    settings, run_id, _, sealed_store, _ = closed_run
    store_dir = copy(sealed_store, tmp_path / "store")
    store = open_store(str(store_dir))
    for key in (keys.proof_keys(run_id)[1], keys.closing_keys(run_id)[1]):
        (store_dir / key).unlink()
    with pytest.raises(proof.SealBroken, match="warrant does not vouch"):
        proof.close(settings, run_id, now=after_the_window(settings, run_id), store_url=str(store_dir))
    assert not store.exists(keys.proof_keys(run_id)[1]), "nothing signed"
