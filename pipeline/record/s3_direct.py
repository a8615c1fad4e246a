"""A whole object's GET, and a create-only PUT, sent to S3 without botocore's request pipeline.

`close` and `verify` read a run's record object by object, 45,000 GETs at 1.5M accounts, and
`close` ends each of its 15,000 chains with a create-only PUT; a run's mailers add to those
chains the same way. botocore spends ~2-3 ms of CPU on each request (its event hooks, the user
agent it builds anew, the reply's headers parsed into a dict of dates and strings), and both
commands were CPU-bound on it. The same request, signed by botocore's own SigV4 signer with the
client's own credentials (boto3's chain, refreshed as botocore refreshes them) and sent on a
kept-alive connection of urllib3's pool (record/s3_pool.py), costs about a third of botocore's
CPU (bench/s3_client.py: ~0.5 against ~1.4 ms here).

What botocore's client did and this keeps: its endpoint, region and path-style addressing, the
CA bundle it would verify with, its timeouts, and its standard retry mode (up to MAX_ATTEMPTS,
backoff `random() * 2**n`, at most 20 s) for throttling and 5xx replies, and for a connection
that failed before a whole reply came, where sending the request again is safe (`resendable`);
the CRC32 of what is sent, for S3 to check, and of a whole object read, when S3 sends one. Through a proxy, or without credentials, `sender` is None and the store keeps
botocore's.
"""

from __future__ import annotations

import base64
import random
import re
import time
import zlib
from typing import Callable
from urllib.parse import quote, urlsplit

from pipeline.record import s3_pool

MAX_ATTEMPTS = 10  # as the store's botocore client: a blip of ~80 s is ridden out
RETRY_STATUS = {429, 500, 502, 503, 504}
RETRY_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError"}
CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")
TAKEN = {412, 409}  # a create-only PUT's key exists (409: another such PUT of it is under way)

Send = Callable[..., tuple[int, bytes, dict]]


class RequestError(Exception):
    """The request failed for good: S3's error code (NoSuchKey, AccessDenied, ...), or why not."""


def sender(client, core, pool_size: int) -> Send | None:
    """send(method, bucket, key, body, headers, answers) -> (status, body, lower-case headers), for the boto3
    `client` made on botocore session `core`; None where the request would not go straight to
    the endpoint with credentials. A status outside `answers` is retried or raised."""
    import urllib.request

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.httpsession import get_cert_path

    endpoint, region = client.meta.endpoint_url.rstrip("/"), client.meta.region_name
    credentials = core.get_credentials()
    host = urlsplit(endpoint).hostname or ""
    if credentials is None or (urllib.request.getproxies() and not urllib.request.proxy_bypass(host)):
        return None
    connections = s3_pool.pool(endpoint, core.get_config_variable("ca_bundle") or get_cert_path(True), pool_size)
    base = urlsplit(endpoint).path

    def send(method: str, bucket: str, key: str, body: bytes = b"", headers: dict | None = None,
             answers: set[int] = frozenset({200})) -> tuple[int, bytes, dict]:
        target, attempt, again = f"{base}/{bucket}/{quote(key, safe='/~')}", 1, resendable(method, headers or {})
        while True:
            request = AWSRequest(method=method, url=endpoint + target, data=body, headers=headers or {})
            S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
            try:
                status, data, got = s3_pool.request(connections, method, target, dict(request.headers.items()), body)
            except s3_pool.CertificateRefused as e:  # not a blip: the endpoint is not the one the CA bundle vouches for
                raise RequestError(f"the S3 endpoint's certificate is refused ({e})") from None
            except s3_pool.NoReply as e:
                if attempt == MAX_ATTEMPTS or (e.sent and not again):
                    raise RequestError(f"the S3 endpoint does not answer ({e})") from None
            else:
                if status in answers:
                    return status, data, got
                found = CODE.search(data)
                code = found[1].decode() if found else str(status)
                if attempt == MAX_ATTEMPTS or (status not in RETRY_STATUS and code not in RETRY_CODES):
                    raise RequestError(code)
            time.sleep(min(random.random() * 2 ** attempt, 20))
            attempt += 1

    return send


def resendable(method: str, headers: dict) -> bool:
    """Whether the request may be sent again after a connection that failed once it was sent,
    when the server may have acted on it: a GET changes nothing; a create-only PUT (If-None-Match:
    *) that did land is refused the second time (412) by its own object, which storage.write_once
    then reads back to settle it. Any other write could be done twice: its failure is raised."""
    return method == "GET" or (method == "PUT" and headers.get("If-None-Match") == "*")


def get(send: Send, bucket: str, key: str) -> bytes:
    _, data, headers = send("GET", bucket, key, headers={"x-amz-checksum-mode": "ENABLED"})
    return _checked(data, headers)


def put_new(send: Send, bucket: str, key: str, data: bytes) -> bool:
    """Create-only (If-None-Match: *): False when the key exists. S3 checks the CRC32 sent with it."""
    status, _, _ = send("PUT", bucket, key, data, {"If-None-Match": "*", "x-amz-checksum-crc32": _crc32(data)},
                        answers={200, *TAKEN})
    return status not in TAKEN


def _crc32(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _checked(data: bytes, headers) -> bytes:
    """A multipart object's CRC32 is of its parts' ("...-3", COMPOSITE): not checked here."""
    crc = headers.get("x-amz-checksum-crc32", "")
    if crc and "-" not in crc and headers.get("x-amz-checksum-type", "FULL_OBJECT") == "FULL_OBJECT":
        if _crc32(data) != crc:
            raise RequestError("its CRC32 is not the one S3 sent")
    return data
