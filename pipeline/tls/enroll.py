"""A worker's certificate, asked of the head at setup (cluster.yaml's worker_setup_commands).

The worker makes its key, which never leaves it, and sends the head a certificate request.
Both ways are proved with an HMAC keyed by the cluster's Ray token (~/.ray/auth_token, which
`ray up` copies to every node): without it the head issues nothing, and a worker takes no CA
it was not sent by the head. The certificate is for the IP the request came from, whatever the
request asks, so a node cannot get one for the head's address (or another node's), and that IP
must be one of the cluster's nodes by the cloud's own list. The
exchange is plain HTTP inside the security group: a request and a certificate are public, and
a replayed request only gets a certificate for a key the replayer does not hold.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from pipeline.tls.ca import CA_FILE, TlsError, issue, load_ca, new_key, write_node

PORT = 6381  # on the head, beside Ray's GCS (6379) and Redis (6380)
MAX_REQUEST = 16_384
log = logging.getLogger(__name__)


def proof(token: bytes, what: bytes, body: bytes) -> str:
    return hmac.new(token, what + b"\n" + body, hashlib.sha256).hexdigest()


def serve(folder: Path, token: bytes, host: str = "0.0.0.0", port: int = PORT,
          members: Callable[[], set[str]] | None = None) -> ThreadingHTTPServer:
    """The head's side: returns the server (serve_forever it, or shut it down). With `members`
    (the cluster's node IPs, from the cloud), only a node the cloud says is the cluster's gets
    a certificate: the token alone, on a machine the cluster did not launch, is not enough."""
    ca_key, ca = load_ca(folder)
    ca_pem = (folder / CA_FILE).read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # the lines below say what matters
            pass

        def do_POST(self):
            peer = self.client_address[0]
            length = int(self.headers.get("Content-Length") or 0)
            if self.path != "/sign" or not 0 < length <= MAX_REQUEST:
                return self._reply(400, {"error": "POST /sign with a certificate request"})
            body = self.rfile.read(length)
            if not hmac.compare_digest(self.headers.get("X-CN-Proof", ""), proof(token, b"request", body)):
                log.warning("refused a certificate to %s: no proof of the cluster's token", peer)
                return self._reply(403, {"error": "not proved with the cluster's token"})
            try:
                csr = x509.load_pem_x509_csr(body)
                if not csr.is_signature_valid:
                    raise ValueError("its signature does not match its key")
            except ValueError as e:
                return self._reply(400, {"error": f"not a certificate request: {e}"})
            try:
                member = members is None or peer in members()
            except Exception:  # the cloud could not say: no certificate, and the worker's setup fails
                log.exception("refused a certificate to %s: the cluster's node list could not be read", peer)
                return self._reply(503, {"error": "the head could not read the cluster's nodes"})
            if not member:
                log.warning("refused a certificate to %s: not a node of this cluster", peer)
                return self._reply(403, {"error": f"{peer} is not a node of this cluster"})
            # and 127.0.0.1: the node's Ray workers reach its metrics agent over TLS on loopback (without it,
            # every worker node's ray_cn_* counters failed to export, "Failed to export metrics ... Result: 1")
            cert = issue(ca_key, ca, csr.public_key(), [peer, "127.0.0.1"])
            log.info("issued a node certificate for %s", peer)
            self._reply(200, {"cert": cert.decode(), "ca": ca_pem.decode()})

        def _reply(self, code: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-CN-Proof", proof(token, b"reply", data))
            self.end_headers()
            self.wfile.write(data)

    return ThreadingHTTPServer((host, port), Handler)


def enroll(folder: Path, head: str, token: bytes, port: int = PORT, wait_s: float = 120) -> None:
    """The worker's side: writes ca.crt, node.crt and node.key once the head has answered."""
    key = new_key()
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "contract-notes node")]))
           .sign(key, hashes.SHA256()))
    body = csr.public_bytes(serialization.Encoding.PEM)
    request = urllib.request.Request(f"http://{head}:{port}/sign", data=body, method="POST",
                                     headers={"X-CN-Proof": proof(token, b"request", body)})
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                data, said = resp.read(), resp.headers.get("X-CN-Proof", "")
            break
        except urllib.error.HTTPError as e:
            raise TlsError(f"the head {head}:{port} refused a certificate: {e.read().decode(errors='replace')}") from None
        except OSError as e:
            if time.monotonic() > deadline:
                raise TlsError(f"no answer from the head's certificate service {head}:{port}: {e}") from None
            time.sleep(2)
    if not hmac.compare_digest(said, proof(token, b"reply", data)):
        raise TlsError(f"the answer from {head}:{port} is not proved with the cluster's token: nothing written")
    doc = json.loads(data)
    cert = x509.load_pem_x509_certificate(doc["cert"].encode())
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        raise TlsError(f"{head}:{port} sent a certificate for another key: nothing written")
    write_node(folder, key, doc["cert"].encode(), doc["ca"].encode())


def read_token(path: Path) -> bytes:
    try:
        token = path.read_bytes().strip()
    except FileNotFoundError:
        token = b""
    if not token:
        raise TlsError(f"no Ray token in {path} (`ray get-auth-token --generate` on the laptop, then `ray up`)")
    return token

