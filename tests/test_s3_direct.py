"""The store's GET and create-only PUT without botocore's pipeline (pipeline/record/s3_direct.py),
against versitygw: what botocore did for them (retries, error codes, checksums) they still do."""

import socket
import threading
import types

import boto3
import pytest

from pipeline.record import delivery_log, http1, s3_direct
from pipeline.record.storage import StorageError, open_store
from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY, S3Between, make_tls_certificate, start_versitygw


@pytest.fixture
def between(s3_endpoint, monkeypatch):
    started = []
    monkeypatch.setattr(s3_direct, "random", types.SimpleNamespace(random=lambda: 0.001))  # backoff of ms, not s

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


def test_over_https_the_endpoint_is_held_to_the_ca_bundle(tmp_path, monkeypatch):
    """A kept connection of http1.Pool over TLS: reads and writes with the endpoint's CA bundle,
    and refuses an endpoint whose certificate that bundle does not vouch for."""
    s3 = start_versitygw(tmp_path / "s3", keep_alive=True, tls=make_tls_certificate(tmp_path))
    try:
        for k, v in {"AWS_ENDPOINT_URL": s3.url, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_CA_BUNDLE": str(tmp_path / "smtp.crt")}.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3").create_bucket(Bucket="tls-bucket")
        store = open_store("s3://tls-bucket")
        assert store._send is not None and s3.url.startswith("https://")
        assert store.put_new("0/x", b"over TLS") and not store.put_new("0/x", b"again")
        assert [store.get("0/x") for _ in range(3)] == [b"over TLS"] * 3
        monkeypatch.setenv("AWS_CA_BUNDLE", str(make_tls_certificate(tmp_path / "other")[0]))
        with pytest.raises(StorageError, match="CERTIFICATE_VERIFY_FAILED"):
            open_store("s3://tls-bucket").get("0/x")
    finally:
        s3.stop()


class Replies:
    """A bare HTTP/1.1 server giving each request the next of `replies` (raw bytes), then closing
    the connection when told to: what http1.Pool must read as S3 servers and proxies send it."""

    def __init__(self, replies: list[tuple[bytes, bool]]):
        self.replies, self.requests, self.connections = list(replies), [], 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while self.replies:
            conn, _ = self.sock.accept()
            self.connections += 1
            with conn, conn.makefile("rb") as f:
                while self.replies:
                    head = b"".join(iter(lambda: f.readline(), b"\r\n"))
                    if not head:
                        break
                    self.requests.append(head.split(b" ", 2)[1])
                    reply, close = self.replies.pop(0)
                    conn.sendall(reply)
                    if close:
                        break


def test_a_kept_connection_the_server_closed_is_replaced_and_replies_are_read_as_framed():
    """The first reply closes its connection after it (as a server whose idle timeout passed):
    the next request goes on a new connection, not to the caller as an error. Chunked replies and
    one ended by the connection's close come back whole."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nsec\r\n4;x=y\r\nond!\r\n0\r\nA: b\r\n\r\n"
    empty = b"HTTP/1.1 204 No Content\r\n\r\n"
    to_close = b"HTTP/1.0 404 Not Found\r\nX-Amz-Request-Id: 1\r\n\r\n<Error>third</Error>"
    server = Replies([(ok, True), (chunked, False), (empty, False), (to_close, True)])
    pool = http1.Pool(server.url, None, 4)
    assert pool.request("GET", "/a", {})[:2] == (200, b"first")
    assert pool.request("GET", "/b", {})[:2] == (200, b"second!")
    assert pool.request("PUT", "/b2", {}, b"")[:2] == (204, b"")
    status, body, headers = pool.request("GET", "/c", {})
    assert (status, body, headers["x-amz-request-id"]) == (404, b"<Error>third</Error>", "1")
    assert server.requests == [b"/a", b"/b", b"/b2", b"/c"] and server.connections == 2


def test_a_reply_cut_short_is_a_connection_error_not_a_short_object():
    server = Replies([(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly", True)])
    with pytest.raises(ConnectionError, match="cut short"):
        http1.Pool(server.url, None, 4).request("GET", "/a", {})


def test_a_delivery_log_object_whose_reply_was_lost_is_written_once(s3_bucket, between):
    """The PUT landed and its reply was lost: sent again, it is refused as taken, by the object
    itself. The chain keeps one object, not the same entries again under the next number."""
    proxy = between(lose=1)
    store = open_store(f"s3://{s3_bucket}")
    link = delivery_log.append(store, "run-1", 3, [delivery_log.sending("A", "<A>")])
    assert proxy.puts == 2 and link.seq == 1
    assert delivery_log.chain_keys(store, "run-1", 3) == [link.key]
    assert [e["ucc"] for e in delivery_log.entries(store, "run-1", 3)] == ["A"]
