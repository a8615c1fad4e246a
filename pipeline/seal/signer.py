"""The signing key and the CMS SignedData template it fills, and the labelled test certificates
(the demo's, a test token's): no PDF here, so what only signs or checks a proof (seal/detached.py,
token.py: `verify`, `close`) loads neither pikepdf nor qpdf (sign.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from asn1crypto import algos, cms, tsp
from asn1crypto import x509 as ax509
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID

from pipeline.errors import CannotRun

TEST_LABEL = "LOCAL TEST - NOT FOR PRODUCTION"
DIGEST_MARK = b"\xd1\x5e" * 16
RSA, ECDSA = "rsassa_pkcs1v15", "sha256_ecdsa"  # the CMS signature algorithms a note may carry
ECDSA_P256_MAX = 72  # the longest DER of an ECDSA P-256 signature
BATCHES_AT_ONCE = 2  # a signer actor's calls under way together when its signatures take a round trip


class SignerSetupError(CannotRun, RuntimeError):
    """The key or certificate cannot be used: raised when an actor starts, not per note."""


class SignError(ValueError):
    """This one PDF could not be signed (the account fails, the actor goes on)."""


class Signer:
    """A signing function and a CMS SignedData template with holes for the digest and the
    signature: per note, two slices are replaced and nothing is re-encoded. `sign` takes the
    signed attributes and returns the signature (a key file's, or a token's: token.py); an
    ECDSA signature's DER length varies by a byte or two, so there is a template a length.
    `workers`: notes signed at once (a network HSM's round trip hidden behind other notes), on
    threads of `submit`'s (a token key's own: token.TokenKey.signing), else of a pool here."""

    def __init__(self, sign: Callable[[bytes], bytes], algorithm: str, cert: x509.Certificate,
                 chain: list[x509.Certificate], workers: int = 1, about: dict | None = None,
                 outages: Callable[[float], list[tuple[float, float]]] = lambda since: [],
                 tell: Callable[[Callable[[float], None]], None] = lambda told: None,
                 submit: Callable[[bytes], Future] | None = None):
        self.sign, self.algorithm, self.cert, self.chain, self.workers = sign, algorithm, cert, chain, workers
        self.outages = outages  # outages(since): the key's that went on since then (a token's; a file has none)
        self.tell = tell  # tell(told): told(since) as an outage of the key's HSM begins, told(0.0) as it ends
        self.about = about or {"key": "file"}  # what the run records of its key (never the key)
        attrs = _signed_attributes(cert)
        self._attrs = attrs.dump()
        self._attr_digest_at = self._attrs.index(DIGEST_MARK)
        self._templates: dict[int, tuple[bytes, int, int]] = {}
        longest = cert.public_key().key_size // 8 if algorithm == RSA else ECDSA_P256_MAX
        self.size = len(self._template(longest)[0])
        self._submit = submit
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sign") if workers > 1 and not submit else None

    def signed_attributes(self, digest: bytes) -> bytes:
        """What is signed: the CMS signed attributes holding the document's digest."""
        a = self._attr_digest_at
        return self._attrs[:a] + digest + self._attrs[a + 32:]

    def cms(self, digest: bytes, signature: bytes | None = None) -> bytes:
        signature = self.sign(self.signed_attributes(digest)) if signature is None else signature
        t, d, s = self._template(len(signature))
        return t[:d] + digest + t[d + 32:s] + signature + t[s + len(signature):]

    def signing(self, digest: bytes) -> Future:
        """The signature of a digest, made by one of `workers` threads: only the wait for the HSM
        is spent there (its module releases the GIL), the notes' own work stays in the caller's."""
        attributes = self.signed_attributes(digest)
        return self._submit(attributes) if self._submit else self._pool.submit(self.sign, attributes)

    @property
    def batches_at_once(self) -> int:
        """Batches signed together: with a round trip a signature (an HSM across a network), a
        batch's last signatures come back while the next batch's notes are prepared, where one
        batch alone left the core idle that long (~5% of an HSM signer's time at +5 ms). A key in
        this process has no wait to fill."""
        return BATCHES_AT_ONCE if self.workers > 1 else 1

    def _template(self, length: int) -> tuple[bytes, int, int]:
        if length not in self._templates:
            mark = (b"\x5a\xa5" * length)[:length]
            der = _signed_data(self.cert, self.chain, _signed_attributes(self.cert), mark, self.algorithm).dump()
            if der.count(DIGEST_MARK) != 1 or der.count(mark) != 1 or self._attrs.count(DIGEST_MARK) != 1:
                raise SignerSetupError("could not build the CMS template (marker not unique)")
            self._templates[length] = der, der.index(DIGEST_MARK), der.index(mark)
        return self._templates[length]


def load_signer(key_path: str, cert_path: str, password: str | None, chain_path: str = "") -> Signer:
    """PEM key + certificate (+ chain), or a PKCS#12 bundle (.p12/.pfx) given as the key path."""
    for p in {key_path, cert_path} | ({chain_path} if chain_path else set()):
        if not Path(p).is_file():
            raise SignerSetupError(f"signing key/certificate file not found: {p}")
    if key_path.endswith((".p12", ".pfx")):
        return signer_from_pkcs12(Path(key_path).read_bytes(), password, key_path)
    return signer_from_pem(Path(key_path).read_bytes(), Path(cert_path).read_bytes(), password,
                           Path(chain_path).read_bytes() if chain_path else b"", key_path)


def signer_from_pem(key: bytes, cert: bytes, password: str | None, chain: bytes = b"",
                    name: str = "the signing key") -> Signer:
    """The key as bytes: read from a secret store by the process that signs, never a file."""
    try:
        return _signer(serialization.load_pem_private_key(key, password.encode() if password else None),
                       x509.load_pem_x509_certificate(cert),
                       x509.load_pem_x509_certificates(chain) if chain.strip() else [], name)
    except (ValueError, TypeError) as e:
        raise SignerSetupError(f"cannot load {name}: wrong password or not a key/certificate "
                               f"({type(e).__name__})") from None


def signer_from_pkcs12(bundle: bytes, password: str | None, name: str) -> Signer:
    try:
        key, cert, extra = pkcs12.load_key_and_certificates(bundle, password.encode() if password else None)
    except (ValueError, TypeError) as e:
        raise SignerSetupError(f"cannot load {name}: wrong password or not a key/certificate "
                               f"({type(e).__name__})") from None
    return _signer(key, cert, list(extra or []), name)


def _signer(key, cert: x509.Certificate, chain: list[x509.Certificate], name: str) -> Signer:
    if not isinstance(key, (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey)) or \
            isinstance(key, ec.EllipticCurvePrivateKey) and not isinstance(key.curve, ec.SECP256R1):
        raise SignerSetupError(f"{name}: notes are signed with RSA or ECDSA P-256 keys, not {type(key).__name__}")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise SignerSetupError(f"the certificate does not belong to {name}")
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return Signer(lambda data: key.sign(data, ec.ECDSA(hashes.SHA256())), ECDSA, cert, chain)
    return Signer(lambda data: key.sign(data, padding.PKCS1v15(), hashes.SHA256()), RSA, cert, chain)


def _signed_attributes(cert: x509.Certificate) -> cms.CMSAttributes:
    acert = ax509.Certificate.load(cert.public_bytes(serialization.Encoding.DER))
    ess = tsp.SigningCertificateV2({"certs": [tsp.ESSCertIDv2({
        "hash_algorithm": algos.DigestAlgorithm({"algorithm": "sha256"}),
        "cert_hash": hashlib.sha256(acert.dump()).digest(),
        "issuer_serial": {"issuer": [ax509.GeneralName({"directory_name": acert.issuer})],
                          "serial_number": acert.serial_number},
    })]})
    return cms.CMSAttributes([
        cms.CMSAttribute({"type": "content_type", "values": ["data"]}),
        cms.CMSAttribute({"type": "message_digest", "values": [DIGEST_MARK]}),
        cms.CMSAttribute({"type": "signing_certificate_v2", "values": [ess]}),
    ])


def _signed_data(cert, chain, attrs: cms.CMSAttributes, sig_mark: bytes, algorithm: str) -> cms.ContentInfo:
    certs = [ax509.Certificate.load(c.public_bytes(serialization.Encoding.DER)) for c in [cert, *chain]]
    sha256 = algos.DigestAlgorithm({"algorithm": "sha256"})
    signer_info = cms.SignerInfo({
        "version": "v1",
        "sid": cms.SignerIdentifier({"issuer_and_serial_number": cms.IssuerAndSerialNumber({
            "issuer": certs[0].issuer, "serial_number": certs[0].serial_number})}),
        "digest_algorithm": sha256,
        "signed_attrs": attrs,
        "signature_algorithm": algos.SignedDigestAlgorithm({"algorithm": algorithm}),
        "signature": sig_mark,
    })
    return cms.ContentInfo({"content_type": "signed_data", "content": cms.SignedData({
        "version": "v1", "digest_algorithms": [sha256], "encap_content_info": {"content_type": "data"},
        "certificates": certs, "signer_infos": [signer_info],
    })})


def labelled_name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.COUNTRY_NAME, "IN"),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Example Securities (test)"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def issue_certificate(subject, issuer, public_key, signing_key, now, ca: bool, issuer_key_id=None):
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
