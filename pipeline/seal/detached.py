"""A detached CMS signature over any bytes, with the notes' own signing key: what seals a run's
proof of delivery (pipeline/followup/close.py). The same SignedData shape as a note's
signature, so `openssl cms -verify -binary -inform DER -content FILE` checks it, as does
`check` here, from the bytes and the signature alone.
"""

from __future__ import annotations

import hashlib

from asn1crypto import cms
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding

from pipeline.seal.signer import SignError, Signer


def sign(data: bytes, signer: Signer) -> bytes:
    """DER ContentInfo (SignedData, no content: detached)."""
    return signer.cms(hashlib.sha256(data).digest())


def check(data: bytes, signature: bytes) -> str:
    """The signer's subject if `signature` is a valid signature of `data` by the certificate it
    carries; SignError otherwise. Whose certificate it is, is for the reader to judge (the
    subject and the SHA-256 of the certificate are what verify prints)."""
    try:
        signed = cms.ContentInfo.load(signature)["content"]
    except (ValueError, KeyError, TypeError) as e:
        raise SignError(f"not a CMS signature ({type(e).__name__})") from None
    return signed_by(signed, hashlib.sha256(data).digest())


def signed_by(signed: cms.SignedData, digest: bytes) -> str:
    """The signer of a SignedData whose signed content has this SHA-256 (`check`, and an
    RFC 3161 timestamp token over its TSTInfo); SignError if it is not a valid signature."""
    try:
        info = signed["signer_infos"][0]
        attrs = info["signed_attrs"]
        signed_digest = next(a["values"][0].native for a in attrs if a["type"].native == "message_digest")
        sid = info["sid"].chosen  # the certificates are a SET: in DER order, not the signer's first
        cert = x509.load_der_x509_certificate(next(
            c.chosen.dump() for c in signed["certificates"]
            if c.chosen.serial_number == sid["serial_number"].native and c.chosen.issuer == sid["issuer"]))
    except (ValueError, KeyError, IndexError, StopIteration, TypeError) as e:
        raise SignError(f"not a CMS signature ({type(e).__name__})") from None
    if digest != signed_digest:
        raise SignError("the signed digest is not the data's: the data was changed after signing")
    to_verify = b"\x31" + attrs.dump()[1:]  # signed as a SET, not as the [0] IMPLICIT it is stored as
    algorithm = hashes.SHA512() if info["digest_algorithm"]["algorithm"].native == "sha512" else hashes.SHA256()
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):  # a TSA may sign with ECDSA
            key.verify(info["signature"].native, to_verify, ec.ECDSA(algorithm))
        else:
            key.verify(info["signature"].native, to_verify, padding.PKCS1v15(), algorithm)
    except (InvalidSignature, TypeError):
        raise SignError("the signature does not verify with the certificate it carries") from None
    return cert.subject.rfc4514_string() + " " + cert_fingerprint(cert)


def fingerprint(cert_pem: bytes) -> str:
    """How check() names a certificate: "sha256:" and its SHA-256. SignError if it is not one."""
    try:
        return cert_fingerprint(x509.load_pem_x509_certificate(cert_pem))
    except ValueError:
        raise SignError("not a PEM certificate") from None


def cert_fingerprint(cert: x509.Certificate) -> str:
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()
