"""Signing and encryption, checked by independent verifiers: poppler's pdfsig, qpdf, and
pyhanko's validator with the test root as the only trust anchor."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from io import BytesIO
from pathlib import Path

import pikepdf
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12
from pyhanko.keys import load_cert_from_pemder
from pyhanko.pdf_utils.reader import PdfFileReader
from pyhanko.sign.validation import validate_pdf_signature
from pyhanko_certvalidator import ValidationContext

from pipeline.record import keys
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.seal.sign import SignatureInfo, protect, protect_all, user_halves
from pipeline.seal.signer import SignError, SignerSetupError, load_signer
from pipeline.stages import Batch, sign_stage
from tests.helpers import assert_signed_and_encrypted, pyhanko_accepts

PAN = "ABCPD1234E"
OWNER = "broker-owner-secret"


@pytest.fixture(scope="module")
def note_pdf() -> bytes:
    from pipeline.note.render import render
    from tests.test_render import sample_note

    return render(sample_note(trades=12))


@pytest.fixture(scope="module")
def merged_pdf() -> bytes:
    """A huge note's shape: page ranges compiled apart and joined (three ranges of three pages)."""
    from pipeline.note.assemble import merge
    from pipeline.note.content import page_range
    from pipeline.note.render import compiled
    from tests.test_render import sample_note

    note = sample_note(trades=400)
    return merge((compiled(page_range(note, a, a + 3)) for a in range(0, 9, 3)), note)


@pytest.fixture(scope="module")
def signer(keys_dir):
    return load_signer(str(keys_dir / "signer.key.pem"), str(keys_dir / "signer.cert.pem"), None,
                       str(keys_dir / "root.cert.pem"))


def show_encryption(path: Path, password: str) -> str:
    return subprocess.run(["qpdf", "--show-encryption", f"--password={password}", str(path)],
                          capture_output=True, text=True).stdout


@pytest.mark.parametrize("algorithm,revision", [("aes256", "R = 6"), ("aes128", "R = 4")])
def test_signed_notes_verify_independently_with_the_intended_encryption(
        tmp_path, note_pdf, signer, keys_dir, algorithm, revision):
    path = tmp_path / "note.pdf"
    path.write_bytes(protect(note_pdf, PAN.lower(), OWNER, signer, SignatureInfo(), algorithm))

    assert_signed_and_encrypted(path, PAN)
    as_user, as_owner = show_encryption(path, PAN), show_encryption(path, OWNER)
    assert revision in as_user and "Supplied password is user password" in as_user
    assert "Supplied password is owner password" in as_owner
    assert "modify anything: not allowed" in as_user and "extract for any purpose: not allowed" in as_user
    assert "print high resolution: allowed" in as_user
    assert subprocess.run(["qpdf", "--check", f"--password={PAN}", str(path)],
                          capture_output=True).returncode == 0

    reader = PdfFileReader(BytesIO(path.read_bytes()))
    assert reader.decrypt(PAN).status.name == "USER"
    trust = ValidationContext(trust_roots=[load_cert_from_pemder(str(keys_dir / "root.cert.pem"))])
    status = validate_pdf_signature(reader.embedded_signatures[0], trust)
    assert status.bottom_line and status.intact and status.trusted
    assert status.coverage.name == "ENTIRE_FILE" and status.md_algorithm == "sha256"


def test_every_string_nested_or_not_reads_back_as_it_was_written(tmp_path, note_pdf, signer):
    """qpdf decrypts the note: the font's nested /CIDSystemInfo, the docinfo and the catalog's
    /Lang come back as Typst wrote them, so each string was encrypted once, none skipped."""
    import pikepdf

    def strings(pdf: pikepdf.Pdf) -> list[bytes]:
        found = []

        def walk(obj, seen):
            if isinstance(obj, pikepdf.String):
                found.append(bytes(obj))
            elif isinstance(obj, (pikepdf.Dictionary, pikepdf.Array)):
                if obj.is_indirect:
                    if obj.objgen in seen:
                        return
                    seen.add(obj.objgen)
                for v in (obj.values() if isinstance(obj, pikepdf.Dictionary) else obj):
                    walk(v, seen)

        walk(pdf.Root, set())
        walk(pdf.trailer.Info, set())
        return found

    path = tmp_path / "note.pdf"
    path.write_bytes(protect(note_pdf, PAN, OWNER, signer, SignatureInfo()))
    with pikepdf.open(BytesIO(note_pdf)) as plain, pikepdf.open(path, password=PAN) as sealed:
        before = strings(plain)
        after = strings(sealed)
    assert b"Identity" in before and b"Adobe" in before and b"en" in before
    assert set(before) <= set(after), set(before) - set(after)


def test_the_signature_names_the_pades_subfilter_and_config_reason(tmp_path, note_pdf, signer):
    path = tmp_path / "note.pdf"
    info = SignatureInfo(reason="Contract note for 20-11-2026", location="Mumbai", contact="desk@example.com")
    path.write_bytes(protect(note_pdf, PAN, OWNER, signer, info, "none"))
    out = subprocess.run(["pdfsig", str(path)], capture_output=True, text=True).stdout
    assert "ETSI.CAdES.detached" in out and "SHA-256" in out
    sig = PdfFileReader(BytesIO(path.read_bytes())).embedded_signatures[0].sig_object
    assert (sig["/Reason"], sig["/Location"], sig["/ContactInfo"]) == ("Contract note for 20-11-2026", "Mumbai",
                                                                       "desk@example.com")


def test_a_corrupt_pdf_fails_that_note_only(note_pdf, signer):
    with pytest.raises(SignError):
        protect(b"%PDF-1.7 this is not a pdf", PAN, OWNER, signer, SignatureInfo())
    assert protect(note_pdf, PAN, OWNER, signer, SignatureInfo())[:5] == b"%PDF-"


def test_owner_password_may_not_equal_the_user_password(note_pdf, signer):
    with pytest.raises(SignError, match="owner password"):
        protect(note_pdf, PAN, PAN, signer, SignatureInfo())


def test_bad_key_material_fails_at_load_with_the_cause(tmp_path, keys_dir):
    cert = str(keys_dir / "signer.cert.pem")
    with pytest.raises(SignerSetupError, match="not found"):
        load_signer(str(tmp_path / "missing.pem"), cert, None)
    key = serialization.load_pem_private_key((keys_dir / "signer.key.pem").read_bytes(), None)
    locked = tmp_path / "locked.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"right")))
    with pytest.raises(SignerSetupError, match="wrong password") as e:
        load_signer(str(locked), cert, "wrong")
    assert "right" not in str(e.value)
    assert load_signer(str(locked), cert, "right").size > 0
    with pytest.raises(SignerSetupError, match="does not belong"):
        load_signer(str(keys_dir / "signer.key.pem"), str(keys_dir / "root.cert.pem"), None)


def test_a_pkcs12_bundle_signs_too(tmp_path, keys_dir, note_pdf):
    from cryptography import x509

    key = serialization.load_pem_private_key((keys_dir / "signer.key.pem").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((keys_dir / "signer.cert.pem").read_bytes())
    root = x509.load_pem_x509_certificate((keys_dir / "root.cert.pem").read_bytes())
    bundle = tmp_path / "signer.p12"
    bundle.write_bytes(pkcs12.serialize_key_and_certificates(
        b"signer", key, cert, [root], serialization.BestAvailableEncryption(b"p12pw")))
    signer = load_signer(str(bundle), str(bundle), "p12pw")
    path = tmp_path / "note.pdf"
    path.write_bytes(protect(note_pdf, PAN, OWNER, signer, SignatureInfo()))
    assert_signed_and_encrypted(path, PAN)


def test_sign_stage_fails_the_corrupt_account_and_archives_the_rest(tmp_path, redis_url, signer, note_pdf):
    state = RunState(redis_url, f"sign-{uuid.uuid4().hex[:8]}", 600)
    store = open_store(str(tmp_path / "store"))
    items = [{"ucc": u, "pan": PAN, "pdf": pdf} for u, pdf in (("C1", note_pdf), ("C2", b"garbage"), ("C3", note_pdf))]
    lease = state.take_lease(30).token
    batch = sign_stage(Batch(state.run_id, "2026-11-20", 0, items, lease=lease), signer, OWNER, "aes256", store, state)
    assert [i["ucc"] for i in batch.items] == ["C1", "C3"]
    records = state.accounts(["C1", "C2", "C3"])
    assert records["C2"]["status"] == "failed" and records["C2"]["failed_at"] == "signed"
    assert records["C1"]["stage"] == "archived"
    assert store.exists(keys.signed_pdf_key("2026-11-20", "C3"))


def test_a_second_attempt_of_a_signed_batch_keeps_the_first_signature_and_carries_the_archived_bytes(
        tmp_path, redis_url, signer, note_pdf):
    """A resend signs the same rendered batch again (the fleet resending a lost actor's chain):
    the archive keeps the first attempt's note, create-only, and the second attempt's item goes
    on to the mailer with those bytes, not with its own new signature (issue 69)."""
    state = RunState(redis_url, f"twice-{uuid.uuid4().hex[:8]}", 600)
    store = open_store(str(tmp_path / "store"))
    lease = state.take_lease(30).token

    def attempt() -> Batch:  # each attempt gets the rendered batch afresh, as from Ray's object store
        made = user_halves([PAN], "aes256")[0]
        items = [{"ucc": u, "pan": PAN, "pdf": note_pdf, "made": made} for u in ("C1", "C2")]
        return sign_stage(Batch(state.run_id, "2026-11-20", 0, items, lease=lease), signer, OWNER, "aes256",
                          store, state)

    first = attempt()
    archived = {i["ucc"]: store.get(keys.signed_pdf_key("2026-11-20", i["ucc"])) for i in first.items}
    second = attempt()

    assert [i["ucc"] for i in second.items] == ["C1", "C2"]
    for item in second.items:
        assert store.get(keys.signed_pdf_key("2026-11-20", item["ucc"])) == archived[item["ucc"]], "replaced"
        assert item["pdf"] == archived[item["ucc"]], "the resend carries a signature the archive does not hold"
    assert state.accounts(["C1", "C2"])["C1"]["stage"] == "archived"


def test_a_batch_s_notes_go_to_s3_together_each_archived_as_signed_or_failed_alone(
        redis_url, signer, note_pdf, s3_bucket, s3_endpoint, monkeypatch):
    """A signer archives its batch before any of it is mailed. One PUT after another, a batch of
    100 notes waited out 100 of S3's round trips (~2 s in a region) for ~0.5 s of signing. S3 here
    answers 250 ms late and refuses one note's PUTs: the batch's PUTs are under way together, each
    other note is archived as it was signed, and the refused one fails alone, named."""
    from datetime import timedelta

    from pipeline.record import s3
    from tests.servers import S3Between

    monkeypatch.setattr(s3, "BACKOFF", {"init_backoff": timedelta(milliseconds=1),
                                        "max_backoff": timedelta(milliseconds=5), "base": 2})
    proxy = S3Between(s3_endpoint, delay_s=0.25, faults={"/C0007.pdf": "refuse"})
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        state = RunState(redis_url, f"s3-batch-{uuid.uuid4().hex[:8]}", 600)
        store = open_store(f"s3://{s3_bucket}")
        items = [{"ucc": f"C{i:04d}", "pan": PAN, "pdf": note_pdf} for i in range(24)]
        batch = sign_stage(Batch(state.run_id, "2026-11-20", 0, items, lease=state.take_lease(30).token), signer,
                           OWNER, "aes256", store, state)
        archived = {item["ucc"]: store.get(keys.signed_pdf_key("2026-11-20", item["ucc"])) for item in batch.items}
    finally:
        proxy.stop()

    assert proxy.most_puts >= 6, f"the batch's PUTs went {proxy.most_puts} at a time"
    assert [i["ucc"] for i in batch.items] == [f"C{i:04d}" for i in range(24) if i != 7]
    assert all(item["pdf"] == archived[item["ucc"]] and item["pdf"].startswith(b"%PDF") for item in batch.items)
    records = state.accounts(["C0006", "C0007"])
    assert records["C0006"]["stage"] == "archived"
    assert records["C0007"]["status"] == "failed" and "archive: " in records["C0007"]["reason"]


def test_a_note_signed_with_the_user_half_its_render_made_opens_with_the_pan_and_the_owner_password(
        tmp_path, redis_url, signer, note_pdf):
    """The render stage makes U, UE and the file key from the PAN; the signer uses them (the U in
    the file is the one made: its two hashes are not run again) and sends no file key on."""
    state = RunState(redis_url, f"half-{uuid.uuid4().hex[:8]}")
    store = open_store(str(tmp_path / "store"))
    made = user_halves([PAN.lower()], "aes256")[0]  # as render_stage makes it: from the account's PAN, as given
    items = [{"ucc": "C1", "pan": PAN.lower(), "pdf": note_pdf, "made": made}]
    batch = sign_stage(Batch(state.run_id, "2026-11-20", 0, items, lease=state.take_lease(30).token), signer, OWNER,
                       "aes256", store, state)

    assert len(batch.items) == 1 and "made" not in batch.items[0]
    path = tmp_path / "note.pdf"
    path.write_bytes(store.get(keys.signed_pdf_key("2026-11-20", "C1")))
    assert_signed_and_encrypted(path, PAN)
    assert "Supplied password is owner password" in show_encryption(path, OWNER)
    with pikepdf.open(path, password=PAN) as opened:
        assert bytes(opened.trailer.Encrypt.U) == made.u
    assert made.file_key.hex() not in repr(made) and repr(made.file_key) not in repr(made)


def test_the_signer_signs_the_batch_that_is_ready_not_the_one_submitted_first(
        ray_session, settings, note_pdf, tmp_path):
    """Render tasks end in any order. A signer taking its calls in the order they were made sat
    idle behind the first chain's render while later batches waited (1.5 s at the start of a
    2,000-account run, before every chain's render had ended)."""
    import ray

    from actors.signer import SignerActor

    run_id = f"order-{uuid.uuid4().hex[:8]}"
    actor = SignerActor.options(name=f"signer-{run_id}").remote(settings, run_id)
    ray.get(actor.pid.remote())
    lease = RunState(settings.redis_url, run_id).take_lease(60).token
    gate = tmp_path / "rendered"

    @ray.remote(num_cpus=0)
    def rendered_when_told(ucc: str) -> Batch:  # a render that has not ended yet
        while not gate.exists():
            time.sleep(0.05)
        return Batch(run_id, "2026-11-20", 0, [{"ucc": ucc, "pan": PAN, "pdf": note_pdf}], lease=lease)

    first = actor.sign.remote(rendered_when_told.remote("LATE"))
    second = actor.sign.remote(Batch(run_id, "2026-11-20", 1, [{"ucc": "READY", "pan": PAN, "pdf": note_pdf}],
                                     lease=lease))
    done, _ = ray.wait([second], timeout=30)
    gate.touch()

    assert done, "the ready batch waited behind one whose render had not ended"
    assert [i["ucc"] for i in ray.get(first, timeout=60).items] == ["LATE"]


def test_a_pool_signer_killed_mid_batch_is_not_run_again_by_ray_and_the_fleets_resend_keeps_the_archive(
        ray_session, settings, note_pdf, tmp_path):
    """One recovery path for a dead actor (issue 69): the fleet makes its actors with Ray's
    restarts and task retries off, so the batch a signer was signing when its process died fails
    to the fleet, which drops the actor and resends the batch to a new one. The notes the dead
    attempt archived keep its signature and go on with those bytes; the rest are archived once.
    Before, Ray re-ran the batch on the restarted actor while the driver resent it too."""
    import ray

    from pipeline.cluster import fleet
    from pipeline.cluster.driver import Chain

    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    uccs = [f"K{i:04d}" for i in range(40)]
    archive = Path(settings.store_url)
    hung = archive / keys.signed_pdf_key("2026-11-20", uccs[4])  # the store hangs at the fifth note's archive:
    hung.parent.mkdir(parents=True, exist_ok=True)  # its create-only write finds the key taken and reads it back,
    os.mkfifo(hung)  # from a pipe no one writes to; the kill lands there, whatever the machine's load
    lease = RunState(settings.redis_url, run_id).take_lease(60).token
    actors = fleet.start(settings, run_id, False, False, "")
    try:
        actors.started(lambda: None)
        signer, mailer = actors.take()
        assert signer._ray_max_task_retries == 0, "Ray would re-run a dead signer's batch"  # its creation options
        chain = Chain(0, None, rendered=ray.put(Batch(run_id, "2026-11-20", 0, [
            {"ucc": u, "pan": PAN, "pdf": note_pdf} for u in uccs], lease=lease)))
        ref = signer.sign.remote(chain.rendered)
        deadline = time.monotonic() + 60
        while len(list(archive.rglob("*.pdf"))) < 5 and time.monotonic() < deadline:  # four notes and the pipe
            time.sleep(0.01)
        ray.kill(signer, no_restart=False)  # as a crash: Ray would restart it, were restarts on
        with pytest.raises(ray.exceptions.RayActorError) as lost:
            ray.get(ref, timeout=120)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(signer.pid.remote(), timeout=60)  # not restarted: the fleet replaces it
        hung.unlink()  # the store answers again
        first = {p.relative_to(archive): p.read_bytes() for p in archive.rglob("*.pdf")}
        actors.give_back(signer, mailer)
        assert actors.take_back(lost.value, chain) and signer not in actors.signers.actors

        actors.size(settings, fleet.look())
        actors.started(lambda: None)
        again, _ = actors.take()
        signed = ray.get(again.sign.remote(chain.rendered), timeout=120)
    finally:
        actors.close()
        if hung.is_fifo():  # the test stopped before the store answered again
            hung.unlink()

    assert len(first) == 4, "the kill did not land mid-batch"
    assert [i["ucc"] for i in signed.items] == uccs
    carried = {keys.signed_pdf_key("2026-11-20", i["ucc"]): i["pdf"] for i in signed.items}
    for path, pdf in first.items():
        assert (archive / path).read_bytes() == pdf == carried[path.as_posix()], f"{path} signed again"
    state = RunState(settings.redis_url, run_id)
    assert state.counts()["signed"] == len(uccs) == state.counts()["archived"]
    pdfs = sorted(archive.rglob("*.pdf"))
    assert len(pdfs) == len(uccs)
    for pdf in pdfs[::50]:
        assert_signed_and_encrypted(pdf, PAN)


def test_a_batch_keys_each_note_with_its_own_pan(tmp_path, note_pdf, signer):
    """protect_all makes a batch's keys together (their password hashes in the C's lanes): each
    note opens with its own client's PAN and the owner's password, not with a neighbour's, notes
    with the render's user half and without it taking turns; one whose PAN is the owner's
    password, among them, fails alone."""
    pans, owner = [f"ABCPD{i:04d}E" for i in range(11)], OWNER.upper()
    halves = iter(user_halves(pans[::2], "aes256"))
    notes = [(note_pdf, pan, next(halves) if i % 2 == 0 else None) for i, pan in enumerate(pans)]
    notes.insert(5, (note_pdf, owner.lower(), None))  # refused, between the others: their keys must not shift
    signed = protect_all(notes, owner, signer, SignatureInfo(), "aes256")

    assert isinstance(signed[5], SignError) and "differ" in str(signed[5])
    for i, (pdf, pan) in enumerate(zip(signed[:5] + signed[6:], pans)):
        path = tmp_path / f"note{i}.pdf"
        path.write_bytes(pdf)
        assert "Supplied password is user password" in show_encryption(path, pan)
        assert "Supplied password is owner password" in show_encryption(path, owner)
        assert "Incorrect password supplied" in show_encryption(path, pans[i - 1])
    assert_signed_and_encrypted(tmp_path / "note7.pdf", pans[7])


@pytest.mark.parametrize("shape", ["note_pdf", "merged_pdf"])  # a note cut from a compile, a huge one's ranges joined
def test_a_cut_note_is_encrypted_and_signed_without_qpdf_and_reads_as_qpdf_wrote_it(tmp_path, request, shape, signer,
                                                                                     keys_dir):
    """A note of the cut's shape is written again here, encrypted, not by qpdf (its object
    stream stays one, where qpdf wrote every object apart). Nothing of the client's is readable
    without the password: not the streams (the pages' text among them), not the object stream
    with the Info, not the metadata. With it, the text, the metadata, the signature's strings
    and its permissions are what qpdf's writing gave."""
    note_pdf = request.getfixturevalue(shape)
    info = SignatureInfo(reason="Contract note for 20-11-2026", location="Mumbai", contact="desk@example.com")
    ours = protect(note_pdf, PAN, OWNER, signer, info)
    with pikepdf.open(BytesIO(note_pdf)) as plain:  # re-saved by qpdf: not the cut's shape
        out = BytesIO()
        plain.save(out, object_stream_mode=pikepdf.ObjectStreamMode.generate, fix_metadata_version=False)
    theirs = protect(out.getvalue(), PAN, OWNER, signer, info)
    assert ours.count(b"/Type/ObjStm") == 1 and b"/Type /ObjStm" not in theirs and b"/Type/ObjStm" not in theirs

    texts = []
    for name, pdf in (("ours", ours), ("theirs", theirs)):
        path = tmp_path / f"{name}.pdf"
        path.write_bytes(pdf)
        assert_signed_and_encrypted(path, PAN)
        pyhanko_accepts(pdf, PAN, keys_dir / "root.cert.pem")
        assert subprocess.run(["qpdf", "--check", f"--password={PAN}", str(path)], capture_output=True).returncode == 0
        as_user = show_encryption(path, PAN)
        texts.append((
            subprocess.run(["pdftotext", "-upw", PAN, str(path), "-"], capture_output=True).stdout,
            subprocess.run(["pdfinfo", "-upw", PAN, "-meta", str(path)], capture_output=True).stdout,
            [line for line in as_user.splitlines() if ":" in line or "=" in line]))
        sig = PdfFileReader(BytesIO(pdf))
        sig.decrypt(PAN)
        found = sig.embedded_signatures[0].sig_object
        assert (found["/Reason"], found["/Location"], found["/ContactInfo"]) == (info.reason, info.location,
                                                                                info.contact)
        assert str(found["/M"]).startswith("D:20")
    assert texts[0] == texts[1] and b"Contract" in texts[0][0] and b"xmpmeta" in texts[0][1]
    for secret in (b"C0000042", b"Contract Note CNT-", b"xmpmeta"):  # the plain note's Info and XMP, uncompressed
        assert secret in note_pdf and secret not in ours, secret
    for added in (b"BrokerSignature", b"Mumbai", b"D:20"):  # the field's name, the signature's strings
        assert added not in ours, added


@pytest.mark.parametrize("case,edit,why", [  # each edit keeps every offset: only what it says is odd
    ("a page with annotations of its own", (rb"/MediaBox\[[^]]*\]", b"/MediaBox[0 0 842 595]/Annots[]"), "/Annots"),
    ("a stream's dictionary with a string", (rb"/WMode 0", b"/N(x)"), "without strings"),
    ("a stream longer than its /Length", (rb"/Length 13/", b"/Length 12/"), "where its /Length says"),
])
def test_what_the_writer_does_not_take_is_written_by_qpdf_and_signed_all_the_same(tmp_path, note_pdf, signer,
                                                                                  case, edit, why):
    """A note the writer here would get wrong is left to qpdf, and comes out signed and locked."""
    import re

    from pipeline.seal.encrypt import NotSealed, sealed
    from pipeline.seal.pdfcrypt import r6_keys

    found = re.search(edit[0], note_pdf)
    assert found and len(edit[1]) <= len(found.group()), case
    odd = note_pdf[:found.start()] + edit[1].ljust(len(found.group())) + note_pdf[found.end():]
    keys = r6_keys(PAN, OWNER)
    sealed(note_pdf, keys, {"M": "D:20261120"}, 16, "S")  # the note itself is taken
    with pytest.raises(NotSealed, match=re.escape(why)):
        sealed(odd, keys, {"M": "D:20261120"}, 16, "S")
    path = tmp_path / "note.pdf"
    path.write_bytes(protect(odd, PAN, OWNER, signer, SignatureInfo()))
    assert_signed_and_encrypted(path, PAN)


def test_a_note_of_more_objects_than_one_object_stream_holds_is_written_by_qpdf(tmp_path, note_pdf, signer,
                                                                                monkeypatch):
    """A cross-reference row indexes an object stream's objects in two bytes: a note of more
    (some 30,000 pages) is left to qpdf, not packed past what the row can say."""
    from pipeline.seal import encrypt
    from pipeline.seal.pdfcrypt import r6_keys

    monkeypatch.setattr(encrypt, "MAX_PACKED", 4)  # the limit, not the code: 65,536 objects need ~30,000 pages
    with pytest.raises(encrypt.NotSealed, match="more than one object stream holds"):
        encrypt.sealed(note_pdf, r6_keys(PAN, OWNER), {"M": "D:20261120"}, 16, "S")
    path = tmp_path / "note.pdf"
    path.write_bytes(protect(note_pdf, PAN, OWNER, signer, SignatureInfo()))
    assert_signed_and_encrypted(path, PAN)


@pytest.mark.parametrize("case,odd", [
    ("a catalog ending in a hex string", lambda pdf: _repacked(pdf, rb"/Lang\(en\)(/ViewerPreferences<<[^>]*>>)",
                                                               rb"\1/Lang<656E>")),
    ("a kid that is a /Pages node", lambda pdf: _repacked(pdf, rb"/Type/Page/", b"/Type/Pages/")),
    ("an object stream head out of order", lambda pdf: _repacked(pdf, None, None, swap_heads=True)),
    ("a stream of its own crypt filter", lambda pdf: pdf.replace(b"/Filter/FlateDecode/WMode 0", b"/Filter[/Crypt/FlateDecode]", 1)),
])
def test_what_an_outside_review_found_the_writer_would_take_wrongly_it_leaves_to_qpdf(tmp_path, note_pdf, signer,
                                                                                      case, odd):
    """Written by hand, each as a reader would read it: a catalog's last value a hex string
    (the field goes in beside it, the string intact), a /Kids entry that is no page, an object
    stream's head whose offsets do not rise, a stream with a crypt filter of its own. Each is
    either written right or left to qpdf; what comes out is signed, locked, and reads, or, for
    the crypt filter qpdf cannot apply either, the note fails alone as a corrupt one does."""
    from pipeline.seal.encrypt import NotSealed, sealed
    from pipeline.seal.pdfcrypt import r6_keys

    pdf = odd(note_pdf)
    keys = r6_keys(PAN, OWNER)
    try:
        sealed(pdf, keys, {"M": "D:20261120"}, 16, "S")
        taken = case == "a catalog ending in a hex string"  # the one the writer now takes, its field first
        assert taken, f"{case}: taken"
    except NotSealed:
        assert case != "a catalog ending in a hex string"
    path = tmp_path / "note.pdf"
    if case == "a stream of its own crypt filter":
        with pytest.raises(SignError, match="cannot rewrite"):
            protect(pdf, PAN, OWNER, signer, SignatureInfo())
        return
    path.write_bytes(protect(pdf, PAN, OWNER, signer, SignatureInfo()))
    assert_signed_and_encrypted(path, PAN)
    if case == "a catalog ending in a hex string":
        with pikepdf.open(path, password=PAN) as opened:
            assert bytes(opened.Root.Lang) == b"en" and len(opened.Root.AcroForm.Fields) == 1


def test_a_page_tree_is_the_cut_s_shape_only_when_every_kid_is_a_reference_to_a_page():
    """packing.page_list, the reader both the cut and the signer's writer trust: the checks that
    encrypt.py made of its own before they were shared (4360a6f) dropped one, that each R in /Kids
    ends a reference; "[3 0 R 4 R]" with /Count 1 read as one page."""
    from pipeline.seal.packing import page_list

    page = lambda n: b"<</Type/Page/Parent 2 0 R>>"  # noqa: E731
    assert page_list(b"<</Type/Pages/Count 2/Kids[3 0 R 4 0 R]>>", page) == [3, 4]
    for odd in (b"<</Type/Pages/Count 1/Kids[3 0 R 4 R]>>", b"<</Type/Pages/Count 1/Kids[3 1 R]>>",
                b"<</Type/Pages/Count 2/Kids[3 0 R 4 0 R]/Resources 5 0 R>>"):
        assert page_list(odd, page) == [], odd
    assert page_list(b"<</Type/Pages/Count 1/Kids[3 0 R]>>", lambda n: b"<</Type/Pages/Kids[4 0 R]>>") == []


def _repacked(pdf: bytes, find: bytes | None, put: bytes | None, swap_heads: bool = False) -> bytes:
    """The cut note with an edit inside its object stream, the stream's head and the file's
    offsets written again to match (the shape the writer reads, but for the edit)."""
    import re
    import struct

    start = re.search(rb"(\d+) 0 obj\n<</Type/ObjStm/N (\d+)/First (\d+)/Length (\d+)>>\nstream\n", pdf)
    number, count, first, length = map(int, start.groups())
    data = pdf[start.end():start.end() + length]
    pairs = data[:first].split()
    offsets = [int(o) for o in pairs[1::2]] + [length - first]
    bodies = [data[first + a:first + b] for a, b in zip(offsets, offsets[1:])]
    numbers = [int(n) for n in pairs[::2]]
    if find:
        at = next(i for i, b in enumerate(bodies) if re.search(find, b))
        bodies[at] = re.sub(find, put, bodies[at], count=1)
    heads, at = [], 0
    for n, body in zip(numbers, bodies):
        heads.append(b"%d %d" % (n, at))
        at += len(body)
    if swap_heads:  # the first two objects' entries name each other's offsets
        heads[0], heads[1] = b"%s %s" % (heads[0].split()[0], heads[1].split()[1]), \
            b"%s %s" % (heads[1].split()[0], heads[0].split()[1])
    head = b" ".join(heads) + b"\n"
    packed = head + b"".join(bodies)
    obj = b"%d 0 obj\n<</Type/ObjStm/N %d/First %d/Length %d>>\nstream\n%s\nendstream\nendobj\n" % (
        number, count, len(head), len(packed), packed)
    end = pdf.index(b"endobj\n", start.end()) + 7
    shift = len(obj) - (end - start.start())
    out = pdf[:start.start()] + obj + pdf[end:]
    xref_at = int(out[out.rindex(b"startxref") + 9:].split()[0]) + shift
    dictionary = re.search(rb"/Length (\d+)>>\nstream\n", out[xref_at:])
    table_at = xref_at + dictionary.end()
    table = bytearray(out[table_at:table_at + int(dictionary.group(1))])
    for i in range(0, len(table), 7):
        kind, offset, gen = struct.unpack_from(">BIH", table, i)
        if kind == 1 and offset > start.start():
            struct.pack_into(">BIH", table, i, kind, offset + shift, gen)
    out = out[:table_at] + bytes(table) + out[table_at + len(table):]
    return out[:out.rindex(b"startxref")] + b"startxref\n%d\n%%%%EOF\n" % xref_at


def test_an_hsm_s_signatures_are_on_their_way_while_the_later_notes_are_keyed(note_pdf, signer, monkeypatch):
    """A network HSM's round trip is hidden behind the notes' own work, the password hashes
    most of it: a batch's keys are made a few notes at a time, so the first signatures are
    asked for before the last notes' hashes run (all keys made first, the HSM sat idle through
    them: 0.55x the key file's notes a second at +5 ms, against 0.79x so)."""
    from pipeline.seal import compiled
    from pipeline.seal.sign import IN_FLIGHT_NOTES
    from pipeline.seal.signer import Signer

    events: list[str] = []
    c_hash = compiled.hash_2b()

    def hashing(*args):  # the C hash, the dependency the keys are made with
        events.append("hash")
        return c_hash(*args)

    def across_a_network(data: bytes) -> bytes:
        events.append("sign")
        time.sleep(0.005)
        return signer.sign(data)

    monkeypatch.setattr(compiled, "hash_2b", lambda: hashing)
    hsm = Signer(across_a_network, signer.algorithm, signer.cert, signer.chain, workers=4)
    notes = [(note_pdf, f"ABCPD{i:04d}E", None) for i in range(3 * IN_FLIGHT_NOTES)]
    signed = protect_all(notes, OWNER, hsm, SignatureInfo())

    assert all(isinstance(pdf, bytes) for pdf in signed) and events.count("sign") == len(notes)
    assert events.index("sign") < len(events) - 1 - events[::-1].index("hash"), events
