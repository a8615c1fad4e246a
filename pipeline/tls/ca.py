"""The cluster's own certificate authority, made on the head by `ray up` (cluster.yaml).

Ray's gRPC (RAY_USE_TLS) and the head's Redis (tls-port, tls-auth-clients) accept a peer only
with a certificate from this CA, so a machine that can reach the nodes' ports but was not set
up as one of them can neither join nor read. The CA's key never leaves the head's disk: not the
bucket, not the run's record, not Ray's objects, not a log. A worker gets its certificate from
the head at setup (pipeline/tls/enroll.py), for its own IP only, and the CA goes when the
head is terminated. Certificates name IP addresses, as gRPC checks the address it dialled.

A node's folder (CN_TLS_DIR, ~/.cn-tls) holds ca.crt, node.crt and node.key; the head's also
ca.key.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pipeline.errors import CannotRun
from pipeline.settings import TLS_CA, TLS_CERT, TLS_KEY

CA_DAYS = 90  # a cluster lives hours (cluster.yaml's dead-man switch); a kept head, weeks
NODE_DAYS = 30  # a cluster kept longer needs a new one (docs/aws.md)
CA_FILE, CERT_FILE, KEY_FILE, CA_KEY_FILE = TLS_CA, TLS_CERT, TLS_KEY, "ca.key"


class TlsError(CannotRun, RuntimeError):
    pass


def new_key() -> ec.EllipticCurvePrivateKey:
    """P-256: the handshakes of thousands of gRPC and Redis connections stay cheap."""
    return ec.generate_private_key(ec.SECP256R1())


def init_head(folder: Path, ip: str) -> bool:
    """The CA (kept if the folder has one: the workers' certificates stay valid across `ray up`)
    and the head's own certificate, for its IP and loopback. Returns whether the CA is new."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = not (folder / CA_KEY_FILE).exists()
    if made:
        key = new_key()
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "contract-notes"),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"contract-notes cluster CA {ip}")])
        now = _now()
        ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
              .not_valid_after(now + dt.timedelta(days=CA_DAYS))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
              .sign(key, hashes.SHA256()))
        _write(folder / CA_KEY_FILE, _key_pem(key), private=True)
        _write(folder / CA_FILE, ca.public_bytes(serialization.Encoding.PEM))
    ca_key, ca = load_ca(folder)
    key = new_key()
    _write(folder / KEY_FILE, _key_pem(key), private=True)
    _write(folder / CERT_FILE, issue(ca_key, ca, key.public_key(), [ip, "127.0.0.1"]))
    return made


def load_ca(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    try:
        key = serialization.load_pem_private_key((folder / CA_KEY_FILE).read_bytes(), None)
        return key, x509.load_pem_x509_certificate((folder / CA_FILE).read_bytes())
    except FileNotFoundError as e:
        raise TlsError(f"no cluster CA in {folder} (`python -m pipeline tls init` on the head)") from e


def issue(ca_key, ca: x509.Certificate, public_key, ips: list[str]) -> bytes:
    """A node's certificate: server and client (Ray's gRPC and Redis both check the client's)."""
    now = _now()
    ips = list(dict.fromkeys(ips))
    names = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "contract-notes"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, ips[0])]))
            .issuer_name(ca.subject).public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=NODE_DAYS))
            .add_extension(x509.SubjectAlternativeName(names + [x509.DNSName(ip) for ip in ips]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def write_node(folder: Path, key: ec.EllipticCurvePrivateKey, cert_pem: bytes, ca_pem: bytes) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(folder / KEY_FILE, _key_pem(key), private=True)
    _write(folder / CERT_FILE, cert_pem)
    _write(folder / CA_FILE, ca_pem)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Atomic, and a key is 0600 from its first byte."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)
