"""bench/s3_client.py's rows for S3 clients that sign and frame in native code (issue 73): obstore
(Rust: object_store on reqwest/hyper) and awscrt's S3 client (C: aws-c-s3). Each sends the same
requests as the store's own row, path-style to the same endpoint with the same credentials: a
whole object's GET, and a create-only PUT (If-None-Match: *) carrying its CRC32 (obstore's put
sends none: it has no CRC32, only SHA-256 or CRC64NVME; S3 checks the body by its SigV4 SHA-256
payload hash all the same). obstore is the store's own client; awscrt is not one of the project's
requirements: a row is left out, and said to be, where its package is not installed.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from urllib.parse import quote, urlsplit

from pipeline.record.s3 import MAX_ATTEMPTS  # the store's


def missing() -> list[str]:
    """The packages of these rows that are not installed here."""
    return [name for name in ("obstore", "awscrt") if importlib.util.find_spec(name) is None]


def rows(endpoint: str, region: str, bucket: str, access_key: str, secret_key: str) -> dict[str, tuple]:
    """Each installed row's (get(key), put_new(key, data)) on `bucket`."""
    made = {}
    if importlib.util.find_spec("obstore"):
        made["obstore"] = obstore_row(endpoint, region, bucket, access_key, secret_key)
    if importlib.util.find_spec("awscrt"):
        made["awscrt"] = awscrt_row(endpoint, region, bucket, access_key, secret_key)
    return made


def obstore_row(endpoint: str, region: str, bucket: str, access_key: str, secret_key: str) -> tuple:
    """obstore's S3Store, its sync calls (each waits on obstore's own tokio runtime, the GIL let go)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, region=region, access_key_id=access_key, secret_access_key=secret_key,
                    virtual_hosted_style_request=False,
                    client_options={"allow_http": endpoint.startswith("http:"), "pool_max_idle_per_host": "64"},
                    retry_config={"max_retries": MAX_ATTEMPTS - 1, "retry_timeout": timedelta(minutes=3)})

    def get(key: str) -> bytes:
        return obstore.get(store, key).bytes().to_bytes()

    def put_new(key: str, data: bytes) -> bool:
        try:
            obstore.put(store, key, data, mode="create")
            return True
        except obstore.exceptions.AlreadyExistsError:
            return False

    return get, put_new


def awscrt_row(endpoint: str, region: str, bucket: str, access_key: str, secret_key: str) -> tuple:
    """awscrt's S3Client (aws-c-s3: its own connection pool, SigV4 in C, retries), a request's
    body handed to Python by callback, its end waited on through a future."""
    import io

    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.s3 import (S3ChecksumAlgorithm, S3ChecksumConfig, S3ChecksumLocation, S3Client, S3RequestTlsMode,
                           S3RequestType, S3ResponseError)

    url = urlsplit(endpoint)
    client = S3Client(region=region, credential_provider=AwsCredentialsProvider.new_static(access_key, secret_key),
                      tls_mode=S3RequestTlsMode.ENABLED if url.scheme == "https" else S3RequestTlsMode.DISABLED)
    crc32 = S3ChecksumConfig(algorithm=S3ChecksumAlgorithm.CRC32, location=S3ChecksumLocation.HEADER)

    def path(key: str) -> str:
        return f"{url.path.rstrip('/')}/{bucket}/{quote(key, safe='/~')}"

    def get(key: str) -> bytes:
        chunks = []
        request = HttpRequest("GET", path(key), HttpHeaders([("Host", url.netloc)]))
        client.make_request(type=S3RequestType.GET_OBJECT, request=request,
                            on_body=lambda chunk, offset, **_: chunks.append(bytes(chunk))).finished_future.result()
        return b"".join(chunks)

    def put_new(key: str, data: bytes) -> bool:
        headers = HttpHeaders([("Host", url.netloc), ("Content-Length", str(len(data))), ("If-None-Match", "*")])
        request = HttpRequest("PUT", path(key), headers, body_stream=io.BytesIO(data))
        try:
            client.make_request(type=S3RequestType.PUT_OBJECT, request=request,
                                checksum_config=crc32).finished_future.result()
            return True
        except S3ResponseError as e:
            if e.status_code in (409, 412):
                return False
            raise

    return get, put_new
