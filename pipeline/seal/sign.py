"""Sign and encrypt a PDF: pure functions over bytes; the signer actor keeps the key warm (a key
file's, or a logged-in session with the HSM that holds it: token.py).

The note is written once more, encrypted, with the signature field and a fixed-size
placeholder: for AES-256 under the keys pdfcrypt.py makes, by encrypt.py where the note is of
the shape the render stage cuts (0.5 ms a note less than qpdf), else by one pass of qpdf (via
pikepdf), as for AES-128 and none. The signature is then patched into the placeholder:
SHA-256 over the file outside /Contents, one signature (RSA, or ECDSA P-256) over a CMS
signed-attributes block, both written into a CMS SignedData template that was DER-encoded
once, when the key was loaded. Every length is fixed, so the template stays valid DER. The
result is PAdES baseline B (ETSI.CAdES.detached, SHA-256, ESS signing-certificate-v2, the
signing time in /M) covering the whole file.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import pikepdf
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pikepdf import Array, Dictionary, Name, String

from pipeline.seal.encrypt import NotSealed, sealed
from pipeline.seal.pdfcrypt import PRINT_ONLY_P, R6Keys, UserKeys, declare, r6_keys, r6_keys_all, user_keys_all
from pipeline.seal.signer import TEST_LABEL, SignError, Signer, issue_certificate, labelled_name

FIELD_NAME = "BrokerSignature"
BYTE_RANGE_PLACEHOLDER = b"0 1111111111 2222222222 3333333333"
PRINT_ONLY = pikepdf.Permissions(
    accessibility=True, extract=False, modify_annotation=False, modify_assembly=False,
    modify_form=False, modify_other=False, print_lowres=True, print_highres=True,
)
SAVE_OPTIONS = dict(object_stream_mode=pikepdf.ObjectStreamMode.disable, fix_metadata_version=False)
ENCRYPTIONS = ("aes256", "aes128", "none")
IN_FLIGHT_NOTES = 8  # an HSM's notes keyed at a time: hash_2b.c's sixteen hashes under way, eight notes' owner pairs


@dataclass(frozen=True)
class SignatureInfo:
    reason: str = "Contract note issued under SEBI regulations"
    location: str = "Bengaluru, India"
    contact: str = "compliance@broker.example.com"


def protect(pdf: bytes, pan: str, owner_password: str, signer: Signer, info: SignatureInfo,
            algorithm: str = "aes256", made: UserKeys | None = None, keys: R6Keys | None = None) -> bytes:
    """The whole treatment of one note: encrypt with the client's PAN (upper case), then sign.
    `made`: AES-256's user half, made from that PAN where the note was rendered; `keys`: all of
    them, made with a batch's (protect_all)."""
    data, start, end, digest = _prepare(pdf, pan, owner_password, signer, info, algorithm, made, keys)
    return _place(data, start, end, signer.cms(digest))


def user_halves(pans: list[str], algorithm: str) -> list[UserKeys | None]:
    """AES-256's user half of each note's keys, from its PAN as `protect` uses it, for the stage
    that renders the notes to make, their hashes in one batch (None: the algorithm has none)."""
    return user_keys_all([pan.upper() for pan in pans]) if algorithm == "aes256" else [None] * len(pans)


def protect_all(notes: list[tuple[bytes, str, UserKeys | None]], owner_password: str, signer: Signer,
                info: SignatureInfo, algorithm: str = "aes256") -> list[bytes | SignError]:
    """protect() over (pdf, pan, made) triples, each result or the SignError it raised."""
    return list(protect_each(notes, owner_password, signer, info, algorithm))


def protect_each(notes: list[tuple[bytes, str, UserKeys | None]], owner_password: str, signer: Signer,
                 info: SignatureInfo, algorithm: str = "aes256") -> Iterator[bytes | SignError]:
    """protect_all's results one at a time, each as soon as it is made: the signer archives a note
    while it signs the next (stages.sign_stage). The notes' keys are made first, their password
    hashes in one batch (hash_2b.c runs eight at once). With a key of several sessions (an HSM
    across a network), each note is prepared here while the signatures of those before it are on
    their way: the round trip is hidden behind the notes' own work. Its notes are keyed
    IN_FLIGHT_NOTES at a time, not all first: the hashes are most of that work, and a signature
    waits on none but its own note's."""
    if signer.workers == 1:
        keyed = zip(notes, _keys_all(notes, owner_password, algorithm))
        yield from (_or_error(protect, pdf, pan, owner_password, signer, info, algorithm, made, keys)
                    for (pdf, pan, made), keys in keyed)
        return
    pending: deque = deque()
    for at in range(0, len(notes), IN_FLIGHT_NOTES):
        group = notes[at:at + IN_FLIGHT_NOTES]
        for (pdf, pan, made), keys in zip(group, _keys_all(group, owner_password, algorithm)):
            prepared = _or_error(_prepare, pdf, pan, owner_password, signer, info, algorithm, made, keys)
            pending.append(prepared if isinstance(prepared, SignError) else (prepared, signer.signing(prepared[3])))
        while pending and (isinstance(pending[0], SignError) or pending[0][1].done()):  # in order, as they come back
            yield _finished(signer, pending.popleft())
    yield from (_finished(signer, p) for p in pending)


def _finished(signer: Signer, pending: SignError | tuple[tuple, Future]) -> bytes | SignError:
    return pending if isinstance(pending, SignError) else _or_error(_finish, signer, *pending)


def _finish(signer: Signer, prepared: tuple, signature: Future) -> bytes:
    data, start, end, digest = prepared
    return _place(data, start, end, signer.cms(digest, signature.result()))


def _keys_all(notes: list[tuple[bytes, str, UserKeys | None]], owner_password: str,
              algorithm: str) -> list[R6Keys | None]:
    """Each note's AES-256 keys, None where there are none to make (another algorithm) or
    _prepare refuses the note (its PAN is the owner's password)."""
    which = [i for i, (_, pan, _) in enumerate(notes) if algorithm == "aes256" and pan.upper() != owner_password]
    made = iter(r6_keys_all([(notes[i][1].upper(), notes[i][2]) for i in which], owner_password, PRINT_ONLY_P))
    wanted = set(which)
    return [next(made) if i in wanted else None for i in range(len(notes))]


def _or_error(fn, *args):
    try:
        return fn(*args)
    except SignError as e:
        return e


def _prepare(pdf: bytes, pan: str, owner_password: str, signer: Signer, info: SignatureInfo,
             algorithm: str, made: UserKeys | None = None, keys: R6Keys | None = None) -> tuple[bytes, int, int, bytes]:
    """The note encrypted and written with its signature's place, and the digest to sign."""
    if algorithm not in ENCRYPTIONS:
        raise SignError(f"unknown encryption {algorithm!r} (one of {', '.join(ENCRYPTIONS)})")
    user = pan.upper()
    if algorithm != "none" and user == owner_password:
        raise SignError("owner password must differ from the user password")
    keys = (keys or r6_keys(user, owner_password, PRINT_ONLY_P, made)) if algorithm == "aes256" else None
    if keys:
        try:
            return _digest(sealed(pdf, keys, _signature_strings(info), signer.size, FIELD_NAME), signer)
        except NotSealed:
            pass  # not a note of the cut's shape: qpdf writes it
    try:
        if keys:
            doc = pikepdf.Pdf.open(BytesIO(declare(pdf, keys)), password=keys.file_key.hex(), hex_password=True)
        else:
            doc = pikepdf.Pdf.open(BytesIO(pdf))
    except (ValueError, pikepdf.PdfError) as e:
        raise SignError(f"not a readable PDF: {e}") from None
    try:
        with doc:
            data = _write(doc, user, owner_password, algorithm, info, signer.size)
    except pikepdf.PdfError as e:
        raise SignError(f"cannot rewrite the PDF: {e}") from None
    return _digest(data, signer)


def _write(doc: pikepdf.Pdf, user: str, owner: str, algorithm: str, info: SignatureInfo, size: int) -> bytes:
    """AES-256: the encryption `declare`d when the note was opened, kept (qpdf encrypts)."""
    _add_signature_field(doc, info, size)
    out = BytesIO()
    if algorithm == "aes256":
        doc.save(out, encryption=True, compress_streams=False, **SAVE_OPTIONS)
    else:
        encryption = pikepdf.Encryption(owner=owner, user=user, R=4, aes=True, allow=PRINT_ONLY)
        doc.save(out, encryption=encryption if algorithm == "aes128" else False, **SAVE_OPTIONS)
    return out.getvalue()


def _signature_strings(info: SignatureInfo) -> dict[str, str]:
    """The signature dictionary's strings: the signing time, then what the broker says of it."""
    return {"M": dt.datetime.now(dt.timezone.utc).strftime("D:%Y%m%d%H%M%SZ"), "Reason": info.reason,
            "Location": info.location, "ContactInfo": info.contact}


def _add_signature_field(doc: pikepdf.Pdf, info: SignatureInfo, size: int) -> None:
    sig = doc.make_indirect(Dictionary(
        Type=Name.Sig, Filter=Name("/Adobe.PPKLite"), SubFilter=Name("/ETSI.CAdES.detached"),
        ByteRange=Array([0, 1111111111, 2222222222, 3333333333]), Contents=String(b"\0" * size),
        **{k: String(v) for k, v in _signature_strings(info).items()}))
    page = doc.pages[-1]
    widget = doc.make_indirect(Dictionary(
        Type=Name.Annot, Subtype=Name.Widget, FT=Name.Sig, T=String(FIELD_NAME), V=sig,
        Rect=Array([0, 0, 0, 0]), F=132, P=page.obj))
    if Name.Annots not in page.obj:
        page.obj.Annots = Array()
    page.obj.Annots.append(widget)
    if Name.AcroForm in doc.Root:
        doc.Root.AcroForm.Fields.append(widget)
        doc.Root.AcroForm.SigFlags = 3
    else:
        doc.Root.AcroForm = Dictionary(Fields=Array([widget]), SigFlags=3)


def _digest(data: bytes, signer: Signer) -> tuple[bytes, int, int, bytes]:
    """ByteRange first (it is signed), then the digest of everything but /Contents."""
    br = data.find(BYTE_RANGE_PLACEHOLDER)
    start = data.find(b"/Contents <", br) + len(b"/Contents ")
    end = data.find(b">", start) + 1
    if br < 0 or start < br or end <= start or end - start - 2 < signer.size * 2:
        raise SignError("signature placeholder not found in the written file")
    ranges = f"0 {start} {end} {len(data) - end}".encode().ljust(len(BYTE_RANGE_PLACEHOLDER))
    data = data[:br] + ranges + data[br + len(ranges):]
    digest = hashlib.sha256()
    digest.update(memoryview(data)[:start])
    digest.update(memoryview(data)[end:])
    return data, start, end, digest.digest()


def _place(data: bytes, start: int, end: int, signed: bytes) -> bytes:
    """The CMS signature into /Contents, hex, padded to its fixed size."""
    contents = signed.hex().encode().ljust(end - start - 2, b"0")
    return data[:start + 1] + contents + data[end - 1:]


def make_test_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """A self-made root and signer for the embedded default, labelled as such in every name."""
    directory.mkdir(parents=True, exist_ok=True)
    key_path, cert_path, root_path = (directory / n for n in ("signer.key.pem", "signer.cert.pem", "root.cert.pem"))
    now = dt.datetime.now(dt.timezone.utc)
    root_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    root_name = labelled_name(f"Test Root CA ({TEST_LABEL})")
    root = issue_certificate(root_name, root_name, root_key.public_key(), root_key, now, ca=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = issue_certificate(labelled_name(f"Signatory ({TEST_LABEL})"), root_name, key.public_key(),
                        root_key, now, ca=False, issuer_key_id=root)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    root_path.write_bytes(root.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path, root_path
