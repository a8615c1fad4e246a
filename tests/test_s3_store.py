"""The store on S3 (pipeline/record/storage.py's S3Store, every request through obstore,
pipeline/record/s3.py), against versitygw and against bare servers that misbehave: what
botocore did for the store (retries, error codes, checksums, a lost reply settled) it still does."""

import dataclasses
import logging
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest

from pipeline.record import delivery_log, s3
from pipeline.record.storage import NoObject, StorageError, open_store, tell, write_once
from pipeline.settings import ROOT, Settings
from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY, S3Between, make_tls_chain, start_versitygw

QUICK = {"init_backoff": timedelta(milliseconds=1), "max_backoff": timedelta(milliseconds=5), "base": 2}


@pytest.fixture
def between(s3_endpoint, monkeypatch):
    started = []
    monkeypatch.setattr(s3, "BACKOFF", QUICK)  # backoff of ms, not s

    def start(**faults):
        started.append(S3Between(s3_endpoint, **faults))
        monkeypatch.setenv("AWS_ENDPOINT_URL", started[-1].url)
        return started[-1]
    yield start
    for proxy in started:
        proxy.stop()


def test_a_get_reads_awkward_keys_under_a_prefix_and_names_a_missing_one(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run prefix")
    awkward = ("0/log/a b+c.jsonl", "1/é/ü~x", "2/plain", "3/a%20b", "4/x=y&z")
    for key in awkward:
        store.put(key, key.encode() * 3)
    assert [store.get(k) for k in awkward] == [k.encode() * 3 for k in awkward]
    assert sorted(store.keys("1/")) == ["1/é/ü~x"] and store.exists("3/a%20b") and store.size("4/x=y&z") == 21
    assert sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)["Contents"]) == \
        sorted(f"run prefix/{k}" for k in awkward)
    with pytest.raises(StorageError, match="cannot read '0/none': NoSuchKey"):
        store.get("0/none")
    assert not store.exists("0/none")


@pytest.mark.parametrize("where", ["s3", "folder"])
def test_a_missing_object_is_no_object_and_a_failing_read_is_not(s3_bucket, tmp_path, where, between, monkeypatch):
    """What a reader of the record tells apart (verify: "removed" or could not run): the store
    answering that no object has the key, and the store failing to answer (S3's 500, a disk's
    error; here a directory where the file is, as EIO would fail it)."""
    store = open_store(f"s3://{s3_bucket}/kinds" if where == "s3" else str(tmp_path))
    store.put("0/here", b"a note")
    for missing in (lambda: store.get("0/none"), lambda: store.size("0/none"), lambda: list(store.lines("0/none"))):
        with pytest.raises(NoObject):
            missing()
    if where == "s3":
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        between(faults={"0/here": "refuse gets"})
        store = open_store(f"s3://{s3_bucket}/kinds")
    else:
        (tmp_path / "0" / "here").unlink()
        (tmp_path / "0" / "here").mkdir()
    with pytest.raises(StorageError, match="cannot read '0/here'") as failed:
        store.get("0/here")
    assert not isinstance(failed.value, NoObject)


def test_a_folder_it_cannot_read_fails_a_listing_never_shortens_it():
    """A delivery-log folder the service's user cannot read (a store kept by another user, NFS
    with root squashed) is a failed listing: before, Path.rglob passed over it in silence, and
    verify read that shard's chain as removed, or its entries as never written. Listed as
    nobody (uid 65534): root reads every folder."""
    with tempfile.TemporaryDirectory(prefix="cn-listing-") as top:  # under /tmp: pytest's folders are root's alone
        root = Path(top, "store")
        for shard in (0, 1):
            (root / "3-delivery-log" / f"shard-{shard}").mkdir(parents=True)
            (root / "3-delivery-log" / f"shard-{shard}" / "000001.jsonl").write_text("{}\n")
        for folder in (Path(top), root, root / "3-delivery-log", root / "3-delivery-log" / "shard-0"):
            folder.chmod(0o755)
        (root / "3-delivery-log" / "shard-1").chmod(0)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c"]
        can = subprocess.run([*nobody, f"import sys; sys.path.insert(0, {str(ROOT)!r}); import pipeline.record.storage"],
                             capture_output=True, text=True, timeout=60)
        assert can.returncode == 0, f"uid 65534 cannot run {sys.executable} on {ROOT} (put the clone and its " \
                                    f"interpreter where others may read them): {can.stderr[-300:]}"
        listing = "from pipeline.record.storage import open_store; print(list(open_store(sys.argv[1]).keys('3-delivery-log/')))"
        done = subprocess.run([*nobody, f"import sys; sys.path.insert(0, {str(ROOT)!r}); {listing}", str(root)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "StorageError" in done.stderr and "Permission denied" in done.stderr, \
        (done.stdout, done.stderr)


@pytest.mark.parametrize("where", ["s3", "folder"])
def test_a_listing_after_a_key_names_the_keys_after_it_alone(s3_bucket, tmp_path, where):
    """What a note-number reservation lists: the marks above what Redis has issued."""
    store = open_store(f"s3://{s3_bucket}/after prefix" if where == "s3" else str(tmp_path))
    for n in (3, 12, 7, 100):
        store.put_new(f"marks/{n:04d}.json", b"{}")
    store.put("marksx/0500.json", b"{}")  # beside the prefix, not under it
    assert list(store.keys("marks/", after="marks/0007.json")) == ["marks/0012.json", "marks/0100.json"]
    assert list(store.keys("marks/", after="marks/0100.json")) == []
    assert list(store.keys("marks/")) == [f"marks/{n:04d}.json" for n in (3, 7, 12, 100)]
    for key in ("runs/RUN/1", "runs/RUN-2/1", "runs/RUN.b"):  # a folder's name beside a longer one's
        store.put(key, b"{}")
    assert list(store.keys("runs/")) == ["runs/RUN-2/1", "runs/RUN.b", "runs/RUN/1"], "S3's order, on both stores"
    assert list(store.keys("runs/", after="runs/RUN-2/1")) == ["runs/RUN.b", "runs/RUN/1"]


def test_ranges_and_streams_read_what_they_ask_and_nothing_past_the_end(s3_bucket):
    store = open_store(f"s3://{s3_bucket}")
    store.put("0/dump.csv", b"\xef\xbb\xbfa,b\r\n1,2\r\n" + b"x" * 100_000)
    assert store.read_range("0/dump.csv", 3, 6) == b"a,b"
    assert store.read_range("0/dump.csv", 100_000, 200_000) == b"x" * 13
    assert store.read_range("0/dump.csv", 100_013, 100_020) == b"" == store.read_range("0/dump.csv", 5, 5)
    assert b"".join(store.stream_range("0/dump.csv", 0, 100_013, 4096)) == store.get("0/dump.csv")
    assert list(store.lines("0/dump.csv"))[:2] == ["a,b\r\n", "1,2\r\n"]


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
    assert proxy.requests == s3.MAX_ATTEMPTS


def test_a_refusal_is_not_retried(s3_bucket, between, monkeypatch):
    open_store(f"s3://{s3_bucket}").put("0/x", b"x")
    proxy = between()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match="cannot read '0/x': SignatureDoesNotMatch") as e:
        open_store(f"s3://{s3_bucket}").get("0/x")
    assert proxy.requests == 1 and "not-the-secret" not in str(e.value)


def test_an_object_changed_on_the_way_is_refused_by_its_checksum(s3_bucket, between):
    open_store(f"s3://{s3_bucket}").put("0/x", b"the record" * 100)
    between(corrupt=True)
    with pytest.raises(StorageError, match="CRC32"):
        open_store(f"s3://{s3_bucket}").get("0/x")


def test_a_create_only_put_writes_once_and_is_refused_the_second_time(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run prefix")
    assert store.put_new("0/log/a b+c.jsonl", b"first")
    assert not store.put_new("0/log/a b+c.jsonl", b"second")
    assert store.get("0/log/a b+c.jsonl") == b"first"


def test_every_write_carries_a_checksum_s3_keeps(s3_bucket, tmp_path):
    """A PUT to a bucket under Object Lock's default retention (docs/aws.md) must carry
    Content-MD5 or an x-amz-checksum: each write does, multipart uploads' parts too."""
    store, big = open_store(f"s3://{s3_bucket}"), tmp_path / "big"
    big.write_bytes(bytes(range(256)) * (6 << 12))
    store.put("0/a", b"a"), store.put_new("0/b", b"b"), store.put_file("0/c", str(big))
    checked = [boto3.client("s3").head_object(Bucket=s3_bucket, Key=k, ChecksumMode="ENABLED").get("ChecksumSHA256")
               for k in ("0/a", "0/b", "0/c")]
    assert all(checked) and checked[2].endswith("-2"), checked


def test_a_throttled_put_is_retried_and_lands_once(s3_bucket, between):
    proxy = between(throttle=3)
    assert open_store(f"s3://{s3_bucket}").put_new("0/x", b"the record" * 100)
    assert proxy.requests == 4
    assert open_store(f"s3://{s3_bucket}").get("0/x") == b"the record" * 100


@pytest.mark.parametrize("write", ["put", "put_new", "put_file"])
def test_an_upload_s3_timed_out_is_sent_again(s3_bucket, between, tmp_path, write):
    """S3 answers an upload that stalled with 400 RequestTimeout (nothing stored): botocore sent
    it again, and obstore, which retries only 5xx, does not."""
    (tmp_path / "f").write_bytes(b"the record" * 100)
    proxy = between(timed_out=2)
    store = open_store(f"s3://{s3_bucket}")
    getattr(store, write)("0/x", str(tmp_path / "f") if write == "put_file" else b"the record" * 100)
    assert proxy.timed_out == 0 and store.get("0/x") == b"the record" * 100


def test_a_put_changed_on_the_way_is_refused_and_not_stored(s3_bucket, between):
    between(corrupt=True)
    with pytest.raises(StorageError, match="cannot write '0/x': XAmzContentSHA256Mismatch"):  # the signed payload's SHA-256
        open_store(f"s3://{s3_bucket}").put_new("0/x", b"the record" * 100)
    with pytest.raises(StorageError, match="NoSuchKey"):
        open_store(f"s3://{s3_bucket}").get("0/x")


def test_over_https_the_endpoint_is_held_to_the_ca_bundle(tmp_path, monkeypatch):
    """Reads, writes and a multipart upload over TLS with the endpoint's CA bundle (AWS_CA_BUNDLE,
    botocore's setting); an endpoint whose certificate that bundle does not vouch for is refused,
    named as such. obstore counts it as a failed connection: it is refused after the attempts
    (~1-2 minutes at the store's backoff), not at once as s3_pool refused it."""
    ca, cert, key = make_tls_chain(tmp_path)
    server = start_versitygw(tmp_path / "s3", keep_alive=True, tls=(cert, key))
    monkeypatch.setattr(s3, "BACKOFF", QUICK)
    try:
        for k, v in {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_CA_BUNDLE": str(ca)}.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3").create_bucket(Bucket="tls-bucket")
        store = open_store("s3://tls-bucket", probe=True)
        assert server.url.startswith("https://")
        assert store.put_new("0/x", b"over TLS") and not store.put_new("0/x", b"again")
        assert [store.get("0/x") for _ in range(3)] == [b"over TLS"] * 3
        big = tmp_path / "big"
        big.write_bytes(bytes(range(256)) * (6 << 12))  # 6 MB: two parts
        store.put_file("0/big", str(big))
        assert store.size("0/big") == 6 << 20 and store.read_range("0/big", (6 << 20) - 3, 6 << 20) == b"\xfd\xfe\xff"
        monkeypatch.setenv("AWS_CA_BUNDLE", str(make_tls_chain(tmp_path / "other")[0]))
        with pytest.raises(StorageError, match="certificate is refused"):
            open_store("s3://tls-bucket").get("0/x")
        with pytest.raises(StorageError, match="certificate is refused"):
            open_store("s3://tls-bucket", probe=True)
    finally:
        server.stop()


class Replies:
    """A bare HTTP/1.1 server giving each request the next of `replies` (raw bytes; None: no
    reply at all), then closing the connection when told to: what the store must read as S3
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


def _head(f) -> bytes:
    """A request's line and headers, b"" at the connection's end."""
    lines = []
    while (line := f.readline()) not in (b"\r\n", b""):
        lines.append(line)
    return b"".join(lines) if line else b""


def reply(status: bytes, body: bytes, *headers: bytes) -> bytes:
    """A reply as S3 frames one (obstore reads an object's ETag and date from its headers)."""
    return b"\r\n".join([b"HTTP/1.1 " + status, b'ETag: "0123"', b"Last-Modified: Sun, 29 Nov 2026 10:00:00 GMT",
                          *headers, b"", body])


OK = reply(b"200 OK", b"first", b"Content-Length: 5")


@pytest.fixture
def on(monkeypatch):
    """on(server) -> the store of bucket "bucket" on a Replies server, its backoff a millisecond."""
    monkeypatch.setattr(s3, "BACKOFF", QUICK)
    for k, v in {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)

    def make(server):
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        return open_store("s3://bucket")
    return make


def test_a_kept_connection_the_server_closed_is_replaced(on):
    """The first reply closes its connection after it (as a server whose idle timeout passed):
    the next request goes on a new connection, not to the caller as an error."""
    server = Replies([(OK, True), (reply(b"200 OK", b"second", b"Content-Length: 6"), False)])
    store = on(server)
    assert store.get("a") == b"first"
    assert server.closed.wait(10)
    assert store.get("b") == b"second"
    assert server.requests == [b"GET /bucket/a", b"GET /bucket/b"] and server.connections == 2


@pytest.mark.parametrize("unsized", [
    reply(b"200 OK", b"3\r\nsec\r\n4;x=y\r\nond!\r\n0\r\n\r\n", b"Transfer-Encoding: chunked"),
    b"HTTP/1.0 200 OK\r\nETag: \"1\"\r\nLast-Modified: Sun, 29 Nov 2026 10:00:00 GMT\r\n\r\nto the close",
])
def test_an_object_sent_without_its_length_is_refused(on, unsized):
    """S3 says every object's length; obstore holds a reply to it (chunked, or read to the close,
    as a proxy might send it): refused by name, never read as an object of another length."""
    with pytest.raises(StorageError, match="cannot read 'a': the S3 request failed .*Content-Length"):
        on(Replies([(unsized, True)])).get("a")


def test_a_reply_cut_short_is_read_on_from_where_it_stopped_never_as_a_short_object(on):
    """The connection closed after 4 of the object's 10 bytes: obstore asks for the rest (a ranged
    GET, as S3 answers it), and the object comes back whole."""
    rest = reply(b"206 Partial Content", b"-the-r", b"Content-Length: 6", b"Content-Range: bytes 4-9/10")
    server = Replies([(reply(b"200 OK", b"only", b"Content-Length: 10"), True), (rest, False)])
    assert on(server).get("a") == b"only-the-r"
    assert server.requests == [b"GET /bucket/a"] * 2


def test_interim_replies_are_skipped_and_the_final_one_read_as_its_own_requests(on):
    """A 103 Early Hints and a 102 Processing before a request's reply are not its reply: taken as
    one, the real reply would stay in the connection and be read as the next request's. Whether the
    next request reuses the connection is obstore's pool's choice: in one suite of 12-01 it took a
    second one, so the test counts requests and replies, not connections."""
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
    second = reply(b"200 OK", b"second", b"Content-Length: 6")
    server = Replies([(early + OK, False), (second, False)])
    store = on(server)
    assert store.get("a") == b"first"
    assert store.get("b") == b"second"
    assert server.requests == [b"GET /bucket/a", b"GET /bucket/b"]


@pytest.mark.parametrize("framed", [
    reply(b"200 OK", b"the rest, to the close", b"Content-Length: -1"),
    reply(b"200 OK", b"first", b"Content-Length: 5x"),
    reply(b"200 OK", b"first!", b"Content-Length: 5", b"Content-Length: 6"),
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
])
def test_a_reply_not_framed_as_http_says_is_refused_and_its_connection_not_reused(on, framed):
    """A negative or malformed Content-Length, two that differ, a 101 nobody asked for: no reply
    is read from them (not a body read to the close), and the next request takes a new connection."""
    server = Replies([(framed, False), (OK, False)])
    store = on(server)
    with pytest.raises(StorageError, match="cannot read 'a'"):
        store.get("a")
    assert store.get("b") == b"first"
    assert server.connections == 2


@pytest.mark.parametrize("call", ["get", "put_new", "put"])
def test_a_request_that_got_no_reply_is_sent_again(on, call):
    """The server took the request and closed the connection without a reply: it may have acted.
    A GET is sent again; a create-only PUT too (a second one that finds its own object is
    refused, for write_once to read back: the test below); a plain PUT writes the same bytes
    again (as botocore's retries did)."""
    server = Replies([(None, True), (OK, False)])
    store = on(server)
    assert (store.get("0/x") == b"first") if call == "get" else getattr(store, call)("0/x", b"data") in (None, True)
    method = b"GET" if call == "get" else b"PUT"
    assert server.requests == [method + b" /bucket/0/x"] * 2


def test_a_request_whose_connection_could_not_be_made_fails_once_the_attempts_are_spent(on):
    server = Replies([])
    server.sock.close()  # the port refuses
    with pytest.raises(StorageError, match="cannot write '0/x': the S3 endpoint does not answer"):
        on(server).put_new("0/x", b"data")


def test_a_delivery_log_object_whose_reply_was_lost_is_written_once(s3_bucket, between):
    """The PUT landed and its reply was lost: sent again, it is refused as taken, by the object
    itself. The chain keeps one object, not the same entries again under the next number."""
    proxy = between(lose=1)
    store = open_store(f"s3://{s3_bucket}")
    link = delivery_log.append(store, "run-1", 3, [delivery_log.sending("A", "<A>")])
    assert proxy.puts == 2 and link.seq == 1
    assert delivery_log.chain_keys(store, "run-1", 3) == [link.key]
    assert [e["ucc"] for e in delivery_log.entries(store, "run-1", 3)] == ["A"]


def test_a_create_only_write_whose_every_reply_was_lost_is_settled_by_reading_it_back(s3_bucket, between):
    """The client gave up on replies that never came, but the first PUT landed: write_once reads
    the key back rather than calling the write failed (which would stop a mailing that did log)."""
    proxy = between(lose=100)
    assert write_once(open_store(f"s3://{s3_bucket}"), "0/x", b"the record") == b"the record"
    assert proxy.puts == s3.MAX_ATTEMPTS


def test_a_run_s_requests_wait_out_s3_stopped_past_the_client_s_attempts_and_land_once(tmp_path, monkeypatch, caplog):
    """S3 stopped (each connection refused) past the client's own attempts (~80 s in a day; their
    backoff made ms here): a run's create-only PUT waits until S3 is back and lands once, a
    listing goes on; a store of no run fails once the attempts are spent, as before."""
    server, url = _own_s3(tmp_path, monkeypatch)
    run = dataclasses.replace(Settings(), store_patience_s=60.0, deadline_at=0.0)
    store, other, told = open_store(url, run=run), open_store(url), []
    tell(url, told.append)  # the run's page
    store.put("0/a", b"a")
    server.stop()
    with pytest.raises(StorageError, match="cannot read '0/a': the S3 endpoint does not answer"):
        other.get("0/a")
    back = []
    timer = threading.Timer(3.0, lambda: back.append(start_versitygw(tmp_path / "s3", port=urlsplit(server.url).port)))
    timer.start()
    try:
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="pipeline.record.storage"):
            assert store.put_new("0/b", b"b") is True
        assert time.monotonic() - began >= 2.5
        assert list(store.keys("0/")) == ["0/a", "0/b"] and other.get("0/b") == b"b"
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and said[0].startswith(f"waiting for the store ({url}) since ")
        assert said[1].startswith(f"the store ({url}) is back after ")
        assert len(told) == 2 and told[0] > 0 and told[1] == 0.0
    finally:
        timer.join()
        for service in [server, *back]:
            service.stop()


@pytest.mark.parametrize("held_by", ["patience", "deadline"])
def test_a_run_s_request_fails_once_s3_is_out_past_its_patience_and_its_deadline(tmp_path, monkeypatch, caplog,
                                                                                  held_by):
    """...and once S3 is back, a request that goes through at once ends the outage: the next
    one is said and waited for anew."""
    server, url = _own_s3(tmp_path, monkeypatch)
    port, servers = urlsplit(server.url).port, [server]
    try:
        server.stop()  # first: on a busy machine it may take a while, and the deadline runs from after it
        began = time.monotonic()
        run = dataclasses.replace(Settings(), store_patience_s=1.5 if held_by == "patience" else 0.0,
                                  deadline_at=time.time() + 1.5 if held_by == "deadline" else 0.0)
        store = open_store(url, run=run)
        past = "CN_STORE_PATIENCE_S \\(1.5 s\\)" if held_by == "patience" else "the run's deadline"
        with pytest.raises(StorageError, match=f"cannot write '0/a': the S3 endpoint does not answer .*, S3 out "
                                               f"since [0-9:]+ UTC, past {past}"):
            store.put_new("0/a", b"a")
        assert 1.4 <= time.monotonic() - began < 10
        servers.append(start_versitygw(tmp_path / "s3", port=port))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pipeline.record.storage"):
            assert store.put_new("0/a", b"a") is True
            servers[-1].stop()
            with pytest.raises(StorageError, match="S3 out since"):
                store.get("0/a")
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and said[0].startswith(f"the store ({url}) is back after "), said
        assert said[1].startswith(f"waiting for the store ({url}) since "), said
    finally:
        for service in servers:
            service.stop()


@pytest.mark.parametrize("said, out", [
    ("<Error><Code>SlowDown</Code></Error> status code: 503", True),
    ("<Error><Code>XMinioServerNotInitialized</Code></Error> status code: 503", True),
    ("Generic S3 error: ... status code: 502 Bad Gateway", True),
    ("Generic S3 error: error sending request: Connection reset by peer (os error 104)", True),
    ("<Error><Code>NotImplemented</Code></Error> status code: 501", False),
    ("Generic S3 error: ... status code: 507 Insufficient Storage", False),
    ("<Error><Code>AccessDenied</Code></Error> status code: 403", False),
    ("InvalidCertificate(UnknownIssuer)", False),
])
def test_only_s3_out_is_waited_for_never_a_refusal(said, out):
    assert s3.out(RuntimeError(said)) is out


def _own_s3(tmp_path, monkeypatch) -> tuple:
    """An S3 server of the test's own, to stop and start again, and the URL of a bucket of the
    test's own on it (a process notes an outage by the store's URL)."""
    server = start_versitygw(tmp_path / "s3")
    monkeypatch.setattr(s3, "BACKOFF", QUICK)
    for k, v in {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY}.items():
        monkeypatch.setenv(k, v)
    bucket = f"outage-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return server, f"s3://{bucket}"


def test_credentials_about_to_expire_are_not_kept_past_their_expiry():
    """botocore hands back the old credentials when a refresh fails; obstore keeps what it is
    given until `expires_at`, which must not be later than they are good for."""
    from datetime import datetime, timezone

    from botocore.credentials import RefreshableCredentials

    ends = datetime.now(timezone.utc) + timedelta(minutes=3)
    same = {"access_key": "AK", "secret_key": "SK", "token": "TOKEN", "expiry_time": ends.isoformat()}
    found = RefreshableCredentials("AK", "SK", "TOKEN", ends, refresh_using=lambda: same, method="test")

    class Session:
        def get_credentials(self):
            return found

    assert s3.credentials(Session())()["expires_at"] <= ends - timedelta(minutes=1)

