"""The store's GET and create-only PUT without botocore's pipeline (pipeline/record/s3_direct.py),
against versitygw: what botocore did for them (retries, error codes, checksums) they still do."""

import socket
import threading
import types

import boto3
import pytest

from pipeline.record import delivery_log, s3_direct, s3_pool
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
    """Kept connections of s3_pool over TLS: reads and writes with the endpoint's CA bundle, and
    refuses an endpoint whose certificate that bundle does not vouch for, at once (not retried)."""
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
        monkeypatch.setattr(s3_direct, "time", types.SimpleNamespace(sleep=lambda s: pytest.fail("retried")))
        with pytest.raises(StorageError, match="certificate is refused.*CERTIFICATE_VERIFY_FAILED"):
            open_store("s3://tls-bucket").get("0/x")
    finally:
        s3.stop()


class Replies:
    """A bare HTTP/1.1 server giving each request the next of `replies` (raw bytes; None: no
    reply at all), then closing the connection when told to: what s3_pool must read as S3
    servers and proxies send it. `closed` is set each time it has closed a connection."""

    def __init__(self, replies: list[tuple[bytes | None, bool]]):
        self.replies, self.requests, self.connections = list(replies), [], 0
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while self.replies:
            conn, _ = self.sock.accept()
            self.connections += 1
            with conn, conn.makefile("rb") as f:
                while self.replies:
                    head = _head(f)
                    if not head:  # the client closed it
                        break
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    f.read(length)
                    self.requests.append(b" ".join(head.split(b" ", 2)[:2]))
                    reply, close = self.replies.pop(0)
                    if reply is not None:
                        conn.sendall(reply)
                    if close or reply is None:
                        break
            self.closed.set()

    def request(self, connections, target: str, method: str = "GET", body: bytes = b""):
        return s3_pool.request(connections, method, target, {}, body)


def _head(f) -> bytes:
    """A request's line and headers, b"" at the connection's end."""
    lines = []
    while (line := f.readline()) not in (b"\r\n", b""):
        lines.append(line)
    return b"".join(lines) if line else b""


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"


def test_a_kept_connection_the_server_closed_is_replaced_and_replies_are_read_as_framed():
    """The first reply closes its connection after it (as a server whose idle timeout passed):
    the next request goes on a new connection, not to the caller as an error. Chunked replies and
    one ended by the connection's close come back whole."""
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nsec\r\n4;x=y\r\nond!\r\n0\r\nA: b\r\n\r\n"
    empty = b"HTTP/1.1 204 No Content\r\n\r\n"
    to_close = b"HTTP/1.0 404 Not Found\r\nX-Amz-Request-Id: 1\r\n\r\n<Error>third</Error>"
    server = Replies([(OK, True), (chunked, False), (empty, False), (to_close, True)])
    connections = s3_pool.pool(server.url, None, 4)
    assert server.request(connections, "/a")[:2] == (200, b"first")
    assert server.closed.wait(10)
    assert server.request(connections, "/b")[:2] == (200, b"second!")
    assert server.request(connections, "/b2", "PUT")[:2] == (204, b"")
    status, body, headers = server.request(connections, "/c")
    assert (status, body, headers["x-amz-request-id"]) == (404, b"<Error>third</Error>", "1")
    assert server.requests == [b"GET /a", b"GET /b", b"PUT /b2", b"GET /c"] and server.connections == 2


def test_a_reply_cut_short_is_a_connection_error_not_a_short_object():
    server = Replies([(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly", True)])
    with pytest.raises(s3_pool.NoReply, match="IncompleteRead") as e:
        server.request(s3_pool.pool(server.url, None, 4), "/a")
    assert e.value.sent


def test_interim_replies_are_skipped_and_the_final_one_read_as_its_own_requests():
    """A 103 Early Hints and a 102 Processing before a request's reply are not its reply: taken as
    one, the real reply would stay in the connection and be read as the next request's."""
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
    second = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond"
    server = Replies([(early + OK, False), (second, False)])
    connections = s3_pool.pool(server.url, None, 4)
    assert server.request(connections, "/a")[:2] == (200, b"first")
    assert server.request(connections, "/b")[:2] == (200, b"second")
    assert server.connections == 1


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nthe rest, to the close",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\nfirst",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nfirst!",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
])
def test_a_reply_not_framed_as_http_says_is_refused_and_its_connection_not_reused(reply):
    """A negative or malformed Content-Length, two that differ, a 101 nobody asked for: no reply
    is read from them (not a body read to the close), and the next request takes a new connection."""
    server = Replies([(reply, False), (OK, False)])
    connections = s3_pool.pool(server.url, None, 4)
    with pytest.raises(s3_pool.NoReply, match="Content-Length|interim"):
        server.request(connections, "/a")
    assert server.request(connections, "/b")[:2] == (200, b"first")
    assert server.connections == 2


@pytest.fixture
def sender(monkeypatch):
    """s3_direct's sender for a Replies server, its backoff a millisecond."""
    monkeypatch.setattr(s3_direct, "random", types.SimpleNamespace(random=lambda: 0.001))
    for k, v in {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)

    def make(server):
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        return open_store("s3://bucket")._send
    return make


@pytest.mark.parametrize("method, headers, resent", [
    ("GET", {}, True),
    ("PUT", {"If-None-Match": "*"}, True),
    ("PUT", {}, False),
])
def test_a_request_that_got_no_reply_is_sent_again_only_where_that_is_safe(sender, method, headers, resent):
    """The server took the request and closed the connection without a reply: it may have acted.
    A GET is sent again, and a create-only PUT (a second one that finds its own object is refused,
    for write_once to read back); any other write would be done twice, and fails instead."""
    server = Replies([(None, True), (OK, False)])
    send = sender(server)
    if resent:
        assert send(method, "bucket", "0/x", b"data" if method == "PUT" else b"", headers)[:2] == (200, b"first")
    else:
        with pytest.raises(s3_direct.RequestError, match="does not answer"):
            send(method, "bucket", "0/x", b"data", headers)
    assert server.requests == [f"{method} /bucket/0/x".encode()] * (2 if resent else 1)


def test_a_request_whose_connection_could_not_be_made_is_sent_again(sender, monkeypatch):
    """No connection, no request sent: any request may try again (here until the attempts run out)."""
    server, slept = Replies([]), []
    server.sock.close()  # the port refuses
    send = sender(server)
    monkeypatch.setattr(s3_direct, "time", types.SimpleNamespace(sleep=slept.append))
    with pytest.raises(s3_direct.RequestError, match="does not answer"):
        send("PUT", "bucket", "0/x", b"data", {})
    assert len(slept) == s3_direct.MAX_ATTEMPTS - 1


def test_a_delivery_log_object_whose_reply_was_lost_is_written_once(s3_bucket, between):
    """The PUT landed and its reply was lost: sent again, it is refused as taken, by the object
    itself. The chain keeps one object, not the same entries again under the next number."""
    proxy = between(lose=1)
    store = open_store(f"s3://{s3_bucket}")
    link = delivery_log.append(store, "run-1", 3, [delivery_log.sending("A", "<A>")])
    assert proxy.puts == 2 and link.seq == 1
    assert delivery_log.chain_keys(store, "run-1", 3) == [link.key]
    assert [e["ucc"] for e in delivery_log.entries(store, "run-1", 3)] == ["A"]
