"""urllib3's connection pool to one S3 endpoint, for s3_direct's GETs and create-only PUTs.

urllib3 is botocore's own HTTP library, used here without botocore's request pipeline: it keeps
connections alive (polling a kept one for the server's close before reusing it), verifies TLS
with the endpoint's CA bundle, and reads a reply by its Content-Length (refusing one cut short),
by its chunks, or to the connection's close. Two things http.client, under urllib3, does not do
as the record needs, and a reply class of its own does here:
- an interim reply (102 Processing, 103 Early Hints) is taken as final, and the real reply left
  in the connection for the next request to read as its own: here it is skipped, as RFC 9110
  (15.2) asks of every client, and a 101 nobody asked for is refused;
- a negative or malformed Content-Length is read as none, the body to the connection's close:
  here the reply is refused and its connection closed, never reused.

Nothing is retried here. `request` says whether a request that got no reply may have reached the
server (`NoReply.sent`): s3_direct decides what may be sent again.
"""

from __future__ import annotations

import http.client
import re
import ssl
from urllib.parse import urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import ConnectTimeoutError, HTTPError, SSLError

LENGTH = re.compile(r"[0-9]{1,19}\Z")
INTERIM = 16  # interim replies skipped before a final one, at most: a server may not stall a request with them
NO_RETRIES = urllib3.Retry(total=False, redirect=False)  # each failure raised as it came


class NoReply(ConnectionError):
    """No whole reply came. `sent`: the request may have reached the server, which may have
    acted on it; False only when the connection itself could not be made."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class CertificateRefused(ConnectionError):
    """The endpoint's certificate is not one its CA bundle vouches for: not a blip, never retried."""


class _Reply(http.client.HTTPResponse):
    """http.client's reply, skipping interim replies and refusing a Content-Length that is not one."""

    def _read_status(self):
        for _ in range(INTERIM):
            version, status, reason = super()._read_status()
            if status == 101 or not 100 <= status < 200:  # a 101 nobody asked for is refused in begin()
                return version, status, reason
            http.client.parse_headers(self.fp)  # the interim reply's headers: nothing to keep
        raise http.client.HTTPException(f"more than {INTERIM} interim replies")

    def begin(self):
        super().begin()
        if self.status < 200:
            raise http.client.HTTPException(f"an interim reply ({self.status}) where the reply should be")
        lengths = self.headers.get_all("content-length") or []
        if any(not LENGTH.match(value.strip()) for value in lengths) or len({v.strip() for v in lengths}) > 1:
            raise http.client.HTTPException(f"its Content-Length is not a length ({', '.join(lengths)[:60]!r})")


class _Connection(HTTPConnection):
    response_class = _Reply


class _TLSConnection(HTTPSConnection):
    response_class = _Reply


def pool(endpoint: str, ca_certs: str | None, size: int, timeout: float = 60.0) -> urllib3.HTTPConnectionPool:
    """Up to `size` kept connections to the endpoint (more are opened when more requests are in
    flight, and closed after); `timeout` to connect and between bytes of a reply, botocore's."""
    url = urlsplit(endpoint)
    if url.scheme == "https":
        made = urllib3.HTTPSConnectionPool(url.hostname, url.port, maxsize=size, timeout=timeout, retries=NO_RETRIES,
                                           cert_reqs="CERT_REQUIRED", ca_certs=ca_certs)
        made.ConnectionCls = _TLSConnection
    else:
        made = urllib3.HTTPConnectionPool(url.hostname, url.port, maxsize=size, timeout=timeout, retries=NO_RETRIES)
        made.ConnectionCls = _Connection
    return made


def request(connections: urllib3.HTTPConnectionPool, method: str, target: str, headers: dict,
            body: bytes = b"") -> tuple[int, bytes, urllib3.HTTPHeaderDict]:
    """(status, body, headers) of a whole reply to the request; `target` quoted already."""
    try:
        reply = connections.urlopen(method, target, body=body or None, headers=headers, retries=NO_RETRIES,
                                    redirect=False, assert_same_host=False, decode_content=False)
    except SSLError as e:
        if isinstance(e.__context__, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
            raise CertificateRefused(str(e)) from None
        raise NoReply(str(e), sent=True) from None
    except ConnectTimeoutError as e:  # NewConnectionError too: nothing was sent
        raise NoReply(str(e), sent=False) from None
    except (HTTPError, OSError) as e:
        raise NoReply(str(e), sent=True) from None
    return reply.status, reply.data, reply.headers
