"""Encrypt, then sign: pure functions over PDF bytes; the signer actor keeps the key warm.

Order matters. Encryption rewrites every object, so it must come first (qpdf, in C);
the signature is then an incremental update over the encrypted file and covers all of
it. The user password is the client's PAN (upper case), the owner password a broker
secret, and the permissions allow printing only.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import pikepdf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from pyhanko.pdf_utils.incremental_writer import IncrementalPdfFileWriter
from pyhanko.sign import fields, signers

TEST_LABEL = "LOCAL TEST - NOT FOR PRODUCTION"
PRINT_ONLY = pikepdf.Permissions(
    accessibility=True, extract=False, modify_annotation=False, modify_assembly=False,
    modify_form=False, modify_other=False, print_lowres=True, print_highres=True,
)


class SignerSetupError(RuntimeError):
    """The key or certificate cannot be used: raised when an actor starts, not per note."""


class SignError(ValueError):
    """This one PDF could not be signed (the account fails, the actor goes on)."""


@dataclass(frozen=True)
class SignatureInfo:
    reason: str = "Contract note issued under SEBI regulations"
    location: str = "Bengaluru, India"
    contact: str = "compliance@broker.example.com"


def load_signer(key_path: str, cert_path: str, password: str | None,
                chain_path: str = "") -> signers.SimpleSigner:
    """PEM key + certificate (+ chain), or a PKCS#12 bundle (.p12/.pfx) given as the key path."""
    for p in {key_path, cert_path} | ({chain_path} if chain_path else set()):
        if not Path(p).is_file():
            raise SignerSetupError(f"signing key/certificate file not found: {p}")
    pw = password.encode() if password else None
    if key_path.endswith((".p12", ".pfx")):
        signer = signers.SimpleSigner.load_pkcs12(key_path, passphrase=pw)
    else:
        signer = signers.SimpleSigner.load(key_path, cert_path, key_passphrase=pw,
                                           ca_chain_files=(chain_path,) if chain_path else None)
    if signer is None:  # pyhanko logs the cause and returns None on a bad file or password
        raise SignerSetupError(f"cannot load the signing key {key_path}: wrong password or not a key")
    return signer


def encrypt(pdf: bytes, user_password: str, owner_password: str, algorithm: str = "aes256") -> bytes:
    if user_password == owner_password:
        raise SignError("owner password must differ from the user password")
    revision = {"aes256": 6, "aes128": 4}[algorithm]
    try:
        with pikepdf.Pdf.open(BytesIO(pdf)) as doc:
            out = BytesIO()
            doc.save(out, encryption=pikepdf.Encryption(
                owner=owner_password, user=user_password, R=revision, aes=True, allow=PRINT_ONLY))
            return out.getvalue()
    except pikepdf.PdfError as e:
        raise SignError(f"not a readable PDF: {e}") from None


def sign(pdf: bytes, signer: signers.Signer, info: SignatureInfo, owner_password: str | None = None) -> bytes:
    try:
        writer = IncrementalPdfFileWriter(BytesIO(pdf), strict=False)
        if owner_password is not None:
            writer.encrypt(owner_password)
        meta = signers.PdfSignatureMetadata(
            field_name="BrokerSignature", md_algorithm="sha256",
            subfilter=fields.SigSeedSubFilter.PADES,
            reason=info.reason, location=info.location, contact_info=info.contact,
        )
        return signers.sign_pdf(writer, meta, signer=signer).getvalue()
    except Exception as e:  # pyhanko raises many types for a malformed file
        raise SignError(f"cannot sign: {type(e).__name__}: {e}") from None


def protect(pdf: bytes, pan: str, owner_password: str, signer: signers.Signer,
            info: SignatureInfo, algorithm: str = "aes256") -> bytes:
    """The whole treatment of one note: encrypt with the client's PAN, then sign."""
    encrypted = encrypt(pdf, pan.upper(), owner_password, algorithm)
    return sign(encrypted, signer, info, owner_password)


def make_test_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """A self-made root and signer for the embedded default, labelled as such in every name."""
    directory.mkdir(parents=True, exist_ok=True)
    key_path, cert_path, root_path = (directory / n for n in ("signer.key.pem", "signer.cert.pem", "root.cert.pem"))
    now = dt.datetime.now(dt.timezone.utc)
    root_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    root_name = _name(f"Test Root CA ({TEST_LABEL})")
    root = _certificate(root_name, root_name, root_key.public_key(), root_key, now, ca=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = _certificate(_name(f"Signatory ({TEST_LABEL})"), root_name, key.public_key(),
                        root_key, now, ca=False, issuer_key_id=root)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    root_path.write_bytes(root.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path, root_path


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.COUNTRY_NAME, "IN"),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Example Securities (test)"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _certificate(subject, issuer, public_key, signing_key, now, ca: bool, issuer_key_id=None):
    usage = dict(digital_signature=not ca, content_commitment=not ca, key_encipherment=False,
                 data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                 encipher_only=False, decipher_only=False)
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(**usage), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    if issuer_key_id is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key_id.public_key()), critical=False)
    return builder.sign(signing_key, hashes.SHA256())
