"""The store's GET without botocore's pipeline (pipeline/record/s3_get.py), against versitygw:
what botocore did for it (retries, error codes, the reply's checksum) it still does."""

import http.client
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from pipeline.record import s3_get
from pipeline.record.storage import StorageError, open_store


class S3Between:
    """An HTTP proxy in front of the S3 server, passing each request on as it came (its Host
    header too: the signature covers it), that can answer the first `throttle` GETs with 503
    SlowDown, or flip a byte of each object it passes."""

    def __init__(self, upstream: str, throttle: int = 0, corrupt: bool = False):
        self.upstream, self.throttle, self.corrupt, self.gets = urlsplit(upstream), throttle, corrupt, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                proxy.gets += 1
                if proxy.gets <= proxy.throttle:
                    body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    return self._answer(503, {"Content-Type": "application/xml"}, body)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                conn.request("GET", self.path, headers=dict(self.headers.items()))
                reply = conn.getresponse()
                body = reply.read()
                if proxy.corrupt and reply.status == 200:
                    body = bytes([body[0] ^ 1]) + body[1:]
                self._answer(reply.status, {k: v for k, v in reply.getheaders() if k.lower() != "connection"}, body)

            def _answer(self, status, headers, body):
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def between(s3_endpoint, monkeypatch):
    started = []
    monkeypatch.setattr(s3_get, "random", types.SimpleNamespace(random=lambda: 0.01))  # backoff of ms, not s

    def start(**faults):
        started.append(S3Between(s3_endpoint, **faults))
        monkeypatch.setenv("AWS_ENDPOINT_URL", started[-1].url)
        return started[-1]
    yield start
    for proxy in started:
        proxy.stop()


def test_a_get_reads_awkward_keys_under_a_prefix_and_names_a_missing_one(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run prefix")
    assert store._get is not None, "the store fell back to botocore's GET"
    for key in ("0/log/a b+c.jsonl", "1/é/ü~x", "2/plain"):
        store.put(key, key.encode() * 3)
    assert [store.get(k) for k in ("0/log/a b+c.jsonl", "1/é/ü~x", "2/plain")] == \
        [k.encode() * 3 for k in ("0/log/a b+c.jsonl", "1/é/ü~x", "2/plain")]
    with pytest.raises(StorageError, match="cannot read '0/none': NoSuchKey"):
        store.get("0/none")


def test_throttling_is_retried_and_the_object_comes_back_whole(s3_bucket, between):
    open_store(f"s3://{s3_bucket}").put("0/x", b"the record" * 100)
    proxy = between(throttle=3)
    assert open_store(f"s3://{s3_bucket}").get("0/x") == b"the record" * 100
    assert proxy.gets == 4


def test_throttling_past_the_attempts_fails_with_its_code(s3_bucket, between):
    open_store(f"s3://{s3_bucket}").put("0/x", b"x")
    proxy = between(throttle=100)
    with pytest.raises(StorageError, match="cannot read '0/x': SlowDown"):
        open_store(f"s3://{s3_bucket}").get("0/x")
    assert proxy.gets == s3_get.MAX_ATTEMPTS


def test_a_refusal_is_not_retried(s3_bucket, between, monkeypatch):
    open_store(f"s3://{s3_bucket}").put("0/x", b"x")
    proxy = between()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match="cannot read '0/x': SignatureDoesNotMatch"):
        open_store(f"s3://{s3_bucket}").get("0/x")
    assert proxy.gets == 1


def test_an_object_changed_on_the_way_is_refused_by_its_checksum(s3_bucket, between):
    open_store(f"s3://{s3_bucket}").put("0/x", b"the record" * 100)
    between(corrupt=True)
    with pytest.raises(StorageError, match="CRC32"):
        open_store(f"s3://{s3_bucket}").get("0/x")
