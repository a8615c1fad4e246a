"""A whole object's GET from S3 without botocore's request pipeline.

`close` and `verify` read a run's record object by object: 45,000 GETs at 1.5M accounts. botocore
spends ~2-3 ms of CPU on each (its event hooks, the user agent it builds anew, the reply's
headers parsed into a dict of dates and strings), and both commands were CPU-bound on it. The
same request, signed by botocore's own SigV4 signer with the client's own credentials (boto3's
chain, refreshed as botocore refreshes them) and sent on urllib3's pool, costs under 1 ms.

What botocore's client did and this keeps: its endpoint, region and path-style addressing, the
CA bundle it would verify with, its timeouts, and its standard retry mode (up to MAX_ATTEMPTS,
backoff `random() * 2**n`, at most 20 s) for a dropped connection, a timeout, throttling and
5xx replies; a reply's CRC32, when S3 sends one for the whole object, is checked. Through a
proxy, or without credentials, `get` is None and the store keeps botocore's.
"""

from __future__ import annotations

import base64
import random
import re
import time
import zlib
from typing import Callable
from urllib.parse import quote, urlsplit

MAX_ATTEMPTS = 10  # as the store's botocore client: a blip of ~80 s is ridden out
RETRY_STATUS = {429, 500, 502, 503, 504}
RETRY_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError"}
CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")


class GetError(Exception):
    """The GET failed for good: S3's error code (NoSuchKey, AccessDenied, ...), or why not."""


def getter(client, core, pool_size: int) -> Callable[[str, str], bytes] | None:
    """get(bucket, key) -> the object's bytes, for the boto3 `client` made on botocore session
    `core`; None where the request would not go straight to the endpoint with credentials."""
    import urllib.request

    import urllib3
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.httpsession import get_cert_path

    endpoint, region = client.meta.endpoint_url.rstrip("/"), client.meta.region_name
    credentials = core.get_credentials()
    host = urlsplit(endpoint).hostname or ""
    if credentials is None or (urllib.request.getproxies() and not urllib.request.proxy_bypass(host)):
        return None
    pool = urllib3.PoolManager(maxsize=pool_size, retries=False, timeout=urllib3.Timeout(connect=60, read=60),
                               ca_certs=core.get_config_variable("ca_bundle") or get_cert_path(True))

    def get(bucket: str, key: str) -> bytes:
        url, attempt = f"{endpoint}/{bucket}/{quote(key, safe='/~')}", 1
        while True:
            request = AWSRequest(method="GET", url=url, headers={"x-amz-checksum-mode": "ENABLED"})
            S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
            try:
                reply = pool.request("GET", url, headers=dict(request.headers.items()))
            except (urllib3.exceptions.HTTPError, OSError) as e:
                if attempt == MAX_ATTEMPTS:
                    raise GetError(f"the S3 endpoint does not answer ({e})") from None
            else:
                if reply.status == 200:
                    return _checked(reply.data, reply.headers)
                found = CODE.search(reply.data)
                code = found[1].decode() if found else str(reply.status)
                if attempt == MAX_ATTEMPTS or (reply.status not in RETRY_STATUS and code not in RETRY_CODES):
                    raise GetError(code)
            time.sleep(min(random.random() * 2 ** attempt, 20))
            attempt += 1

    return get


def _checked(data: bytes, headers) -> bytes:
    """A multipart object's CRC32 is of its parts' ("...-3", COMPOSITE): not checked here."""
    crc = headers.get("x-amz-checksum-crc32", "")
    if crc and "-" not in crc and headers.get("x-amz-checksum-type", "FULL_OBJECT") == "FULL_OBJECT":
        if base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode() != crc:
            raise GetError("its CRC32 is not the one S3 sent")
    return data
