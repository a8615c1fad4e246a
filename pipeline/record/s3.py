"""The store's one S3 client: obstore (object_store, in Rust, on reqwest and rustls), for every
request the store makes.

botocore spent ~1.3-1.5 ms of CPU a request (its event hooks, its reply parsed into dicts), and
`close` and `verify` were CPU-bound on it; urllib3 driven directly still ~0.5 ms. obstore signs
(SigV4), frames and keeps its connections in native code, the GIL let go while it waits: ~0.11
ms a GET and ~0.14 ms a create-only PUT, less than the hand-written HTTP/1.1 client this project
once kept (bench/s3_client.py, issue 73).

What botocore's client did and this keeps: boto3's credential chain (botocore's own, handed to
obstore and refreshed as botocore refreshes it), the endpoint (AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL), the region, path-style addressing, the CA bundle botocore would verify with
(AWS_CA_BUNDLE or the config file's ca_bundle), proxies from the environment (reqwest reads
HTTP_PROXY and HTTPS_PROXY), timeouts of 60 s to connect and between reads, and up to
MAX_ATTEMPTS attempts (or AWS_MAX_ATTEMPTS, or the config file's max_attempts) with backoff up
to 20 s for 5xx replies (503 SlowDown among them) and for a connection refused, or lost before
its reply came (a body cut short is read on from where it stopped, by a ranged GET); a run's
requests then wait for S3 (storage.S3Store). Not kept: an endpoint_url in the AWS config file (the environment's
only), S3's own x-amz-checksum headers of a GET (obstore does not show them). A create-only PUT
sent again after its reply was lost is refused by its own object (412): storage.write_once reads
it back. The SHA-256 of what is sent is signed (S3 refuses a body changed on the way) and sent as
its x-amz-checksum-sha256 (as botocore's CRC32 was: a PUT under Object Lock needs one), and each
object the store writes whole carries its CRC32 in its metadata, checked when it is read whole.
"""

from __future__ import annotations

import base64
import io
import os
import random
import re
import time
import zlib
from datetime import datetime, timedelta, timezone
from typing import Iterator
from urllib.parse import urlsplit

from pipeline.settings import ConfigError

MAX_ATTEMPTS = 10  # unless AWS_MAX_ATTEMPTS says: as botocore's client was given, a blip of ~80 s is ridden out
BACKOFF = {"init_backoff": timedelta(seconds=1), "max_backoff": timedelta(seconds=20), "base": 2}
CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
CRC32 = "crc32"  # the user metadata (x-amz-meta-crc32) holding an object's CRC32, base64 as S3 writes its own
OUT = {"SlowDown", "InternalError", "ServiceUnavailable", "ServiceUnavailableException"}  # S3's codes for its 5xx
OUT_STATUS = {"500", "502", "503", "504"}  # whatever the code (MinIO's own): 501 and 507, a full disk, are not
STATUS = re.compile(r"status code: ([0-9]{3})")
AGAIN = {"RequestTimeout", "Throttling", "ThrottlingException"}  # 400s that S3 means as "send it again"
REFRESH = timedelta(minutes=10)  # how long obstore keeps refreshable credentials before asking again


def store(bucket: str, prefix: str, region: str | None, quick: bool = False):
    """obstore's S3Store for the bucket (keys under `prefix`); `quick`, for a probe: two attempts,
    five seconds to connect."""
    import botocore.session
    from obstore.store import S3Store

    core = botocore.session.get_session()
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options = {"connect_timeout": timedelta(seconds=5 if quick else 60), "read_timeout": timedelta(seconds=60),
               "timeout": timedelta(hours=1), "pool_max_idle_per_host": "64",  # storage.IN_FLIGHT
               "allow_http": bool(endpoint) and urlsplit(endpoint).scheme == "http"}
    bundle = core.get_config_variable("ca_bundle")  # none: obstore's default roots
    if bundle:
        with open(bundle, "rb") as f:
            options["root_certificate"] = f.read()
    where = {"region": region or "us-east-1"} | ({"endpoint": endpoint} if endpoint else {})  # botocore's default
    return S3Store(bucket, prefix=prefix or None, virtual_hosted_style_request=False, **where, client_options=options,
                   checksum_algorithm="sha256",  # a PUT to a bucket under Object Lock retention must carry one
                   retry_config={"max_retries": 1 if quick else attempts(core) - 1, "backoff": BACKOFF,
                                 "retry_timeout": timedelta(minutes=5)},
                   credential_provider=credentials(core))


def attempts(core) -> int:
    """Each request's attempts: botocore's max_attempts (AWS_MAX_ATTEMPTS), as its client took it."""
    given = core.get_config_variable("max_attempts")
    try:
        return MAX_ATTEMPTS if given is None else max(1, int(given))
    except ValueError:
        raise ConfigError(f"AWS_MAX_ATTEMPTS (or the AWS config file's max_attempts): {given!r} is not a whole "
                          "number") from None


def sent(write):
    """write(), sent again while S3 answers it with a 400 that means "send it again" (an upload
    that stalled, throttling), which obstore, retrying 5xx alone, raises: as botocore did, up to
    MAX_ATTEMPTS with BACKOFF. S3 stored nothing of such a request."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return write()
        except Exception as e:
            if attempt == MAX_ATTEMPTS or reason(e) not in AGAIN:
                raise
            wait = BACKOFF["init_backoff"].total_seconds() * BACKOFF["base"] ** attempt * random.random()
            time.sleep(min(wait, BACKOFF["max_backoff"].total_seconds()))


def credentials(core):
    """obstore's credential callback on botocore's chain (environment, profiles, SSO, the
    instance's role...): refreshable ones are asked for again every REFRESH, botocore renewing
    them before they expire."""
    from botocore.credentials import RefreshableCredentials

    def provide() -> dict:
        found = core.get_credentials()
        if found is None:
            raise PermissionError("no AWS credentials found (environment, profile, SSO or instance role)")
        frozen = found.get_frozen_credentials()
        expires = None
        if isinstance(found, RefreshableCredentials):  # never past their own expiry (a refresh that failed keeps old ones)
            expires = datetime.now(timezone.utc) + REFRESH
            if found._expiry_time is not None:
                expires = min(expires, found._expiry_time.astimezone(timezone.utc) - timedelta(minutes=1))
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}
    return provide


def crc32(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def intact(data: bytes, attributes: dict) -> bool:
    """Whether the object read whole has the CRC32 its writer recorded (objects written by
    others, or in parts, carry none)."""
    crc = attributes.get(CRC32)
    return not crc or crc32(data) == crc


def reason(error: Exception) -> str:
    """What S3 said (its error code: NoSuchKey, SlowDown, AccessDenied...), or why no answer came,
    in one line: obstore's message holds the reply's body and a debug dump."""
    import obstore.exceptions as refused

    text = str(error)
    found = CODE.search(text)
    if found:
        return found[1]
    if isinstance(error, (refused.NotFoundError, FileNotFoundError)):
        return "NoSuchKey"
    status = STATUS.search(text)
    if status:
        return status[1]
    certificate = re.search(r"InvalidCertificate\(\s*([A-Za-z]+)", text)
    if certificate:
        return f"the S3 endpoint's certificate is refused ({certificate[1]})"
    line = text.splitlines()[0][:200] if text else type(error).__name__
    if "error sending request" in text or any(cut in text.lower() for cut in ("connection closed", "connection reset")) \
            or "timed out" in text:
        return f"the S3 endpoint does not answer ({line})"
    return f"the S3 request failed ({line})"


def out(error: Exception) -> bool:
    """Whether S3 is out (no answer; busy or failing: 500, 502, 503, 504), as against refusing
    the request (a 4xx, 501 NotImplemented), which no wait would change."""
    said, status = reason(error), STATUS.search(str(error))
    return said.startswith("the S3 endpoint does not answer") or said in OUT or bool(status and status[1] in OUT_STATUS)


def answered(error: Exception) -> bool:
    """Whether S3 answered the request that failed (a status came back)."""
    return bool(CODE.search(str(error)) or STATUS.search(str(error)))


class Body(io.RawIOBase):
    """A GET's body as a file, read as obstore streams it: a day's dump is never held whole."""

    def __init__(self, chunks: Iterator):
        self.chunks, self.left = chunks, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, into) -> int:
        while not self.left:
            chunk = next(self.chunks, None)
            if chunk is None:
                return 0
            self.left = memoryview(chunk)
        n = min(len(into), len(self.left))
        into[:n] = self.left[:n]
        self.left = self.left[n:]
        return n
