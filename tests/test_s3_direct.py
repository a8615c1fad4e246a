"""The store's GET and create-only PUT without botocore's pipeline (pipeline/record/s3_direct.py),
against versitygw: what botocore did for them (retries, error codes, checksums) they still do."""

import http.client
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from pipeline.record import s3_direct
from pipeline.record.storage import StorageError, open_store


class S3Between:
    """An HTTP proxy in front of the S3 server, passing each request on as it came (its Host
    header too: the signature covers it), that can answer the first `throttle` requests with 503
    SlowDown, or flip a byte of each object it passes, either way."""

    def __init__(self, upstream: str, throttle: int = 0, corrupt: bool = False):
        self.upstream, self.throttle, self.corrupt, self.requests = urlsplit(upstream), throttle, corrupt, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._pass_on(b"")

            def do_PUT(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                self._pass_on(bytes([body[0] ^ 1]) + body[1:] if proxy.corrupt else body)

            def _pass_on(self, sent: bytes):
                proxy.requests += 1
                if proxy.requests <= proxy.throttle:
                    body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    return self._answer(503, {"Content-Type": "application/xml"}, body)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                conn.request(self.command, self.path, body=sent or None, headers=dict(self.headers.items()))
                reply = conn.getresponse()
                body = reply.read()
                if proxy.corrupt and reply.status == 200 and self.command == "GET":
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
    monkeypatch.setattr(s3_direct, "random", types.SimpleNamespace(random=lambda: 0.01))  # backoff of ms, not s

    def start(**faults):
        started.append(S3Between(s3_endpoint, **faults))
        monkeypatch.setenv("AWS_ENDPOINT_URL", started[-1].url)
        return started[-1]
    yield start
    for proxy in started:
        proxy.stop()


def test_a_get_reads_awkward_keys_under_a_prefix_and_names_a_missing_one(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run prefix")
    assert store._send is not None, "the store fell back to botocore's GET"
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
    assert proxy.requests == 4


def test_throttling_past_the_attempts_fails_with_its_code(s3_bucket, between):
    open_store(f"s3://{s3_bucket}").put("0/x", b"x")
    proxy = between(throttle=100)
    with pytest.raises(StorageError, match="cannot read '0/x': SlowDown"):
        open_store(f"s3://{s3_bucket}").get("0/x")
    assert proxy.requests == s3_direct.MAX_ATTEMPTS


def test_a_refusal_is_not_retried(s3_bucket, between, monkeypatch):
    open_store(f"s3://{s3_bucket}").put("0/x", b"x")
    proxy = between()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match="cannot read '0/x': SignatureDoesNotMatch"):
        open_store(f"s3://{s3_bucket}").get("0/x")
    assert proxy.requests == 1


def test_an_object_changed_on_the_way_is_refused_by_its_checksum(s3_bucket, between):
    open_store(f"s3://{s3_bucket}").put("0/x", b"the record" * 100)
    between(corrupt=True)
    with pytest.raises(StorageError, match="CRC32"):
        open_store(f"s3://{s3_bucket}").get("0/x")


def test_a_create_only_put_writes_once_and_is_refused_the_second_time(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run prefix")
    assert store._send is not None, "the store fell back to botocore's PUT"
    assert store.put_new("0/log/a b+c.jsonl", b"first")
    assert not store.put_new("0/log/a b+c.jsonl", b"second")
    assert store.get("0/log/a b+c.jsonl") == b"first"


def test_a_throttled_put_is_retried_and_lands_once(s3_bucket, between):
    proxy = between(throttle=3)
    assert open_store(f"s3://{s3_bucket}").put_new("0/x", b"the record" * 100)
    assert proxy.requests == 4
    assert open_store(f"s3://{s3_bucket}").get("0/x") == b"the record" * 100


def test_a_put_changed_on_the_way_is_refused_and_not_stored(s3_bucket, between):
    between(corrupt=True)
    with pytest.raises(StorageError, match="cannot write '0/x': XAmzContentSHA256Mismatch"):  # the signed payload's SHA-256
        open_store(f"s3://{s3_bucket}").put_new("0/x", b"the record" * 100)
    with pytest.raises(StorageError, match="NoSuchKey"):
        open_store(f"s3://{s3_bucket}").get("0/x")
