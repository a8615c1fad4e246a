"""Kept-alive HTTP/1.1 connections to one S3 endpoint, for s3_direct's GETs and PUTs.

urllib3 spent ~0.8 ms of CPU on each of those small requests (a dropped-connection poll before
each reuse, its response object, http.client's headers read by the e-mail parser): two thirds of
a request's cost, 45,000-60,000 of them in a 1.5M-account day's `close` or `verify`. These are a
request line, a few headers, and a reply read by its Content-Length (or chunks, or to its close).

A connection that has sat idle may have been closed by the server: a request on one that fails
before any reply came is sent again at once on a new connection. Nothing else is retried here.
"""

from __future__ import annotations

import socket
import ssl
import threading
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


class Pool:
    def __init__(self, endpoint: str, ca_certs: str | None, size: int, timeout: float = 60.0):
        url = urlsplit(endpoint)
        self.address = (url.hostname or "", url.port or DEFAULT_PORTS[url.scheme])
        self.host = url.hostname if url.port in (None, DEFAULT_PORTS[url.scheme]) else url.netloc.rsplit("@", 1)[-1]
        self.tls = ssl.create_default_context(cafile=ca_certs) if url.scheme == "https" else None
        self.size, self.timeout, self.idle, self.lock = size, timeout, [], threading.Lock()

    def request(self, method: str, target: str, headers: dict, body: bytes = b"") -> tuple[int, bytes, dict]:
        """(status, body, headers with lower-case names). OSError when no whole reply came."""
        head = "".join([f"{method} {target} HTTP/1.1\r\nHost: {self.host}\r\n",
                        *(f"{k}: {v}\r\n" for k, v in headers.items()),
                        f"Content-Length: {len(body)}\r\n\r\n" if body or method == "PUT" else "\r\n"]).encode()
        with self.lock:
            conn = self.idle.pop() if self.idle else None
        if conn is not None:
            try:
                return self._exchange(conn, head, body)
            except _Stale:
                pass  # closed by the server while idle: the request never reached it
        try:
            return self._exchange(self._connect(), head, body)
        except _Stale as e:
            raise ConnectionError(f"the connection closed before a reply ({e})") from None

    def _connect(self) -> _Connection:
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls:
            sock = self.tls.wrap_socket(sock, server_hostname=self.address[0])
        return _Connection(sock)

    def _exchange(self, conn: _Connection, head: bytes, body: bytes) -> tuple[int, bytes, dict]:
        try:
            try:
                conn.sock.sendall(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    conn.sock.sendall(body)
                first = conn.file.readline(65537)
            except TimeoutError:
                raise
            except OSError as e:
                raise _Stale(str(e)) from None
            if not first:
                raise _Stale("no reply")
            try:
                status, data, headers, keep = _reply(conn.file, first)
            except ValueError as e:
                raise ConnectionError(f"not an HTTP/1.1 reply ({e})") from None
        except BaseException:
            conn.close()
            raise
        if keep:
            with self.lock:
                if len(self.idle) < self.size:
                    self.idle.append(conn)
                    return status, data, headers
        conn.close()
        return status, data, headers


class _Connection:
    def __init__(self, sock: socket.socket):
        self.sock, self.file = sock, sock.makefile("rb")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class _Stale(OSError):
    pass


def _reply(file, first: bytes) -> tuple[int, bytes, dict, bool]:
    version, _, rest = first.partition(b" ")
    if not version.startswith(b"HTTP/1.") or not rest[:3].isdigit():
        raise ValueError(f"its first line is {first[:40]!r}")
    headers = {}
    while (line := file.readline(65537)) not in (b"\r\n", b"\n"):
        if not line or len(headers) > 200:
            raise ValueError("its headers were cut short")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    status, keep = int(rest[:3]), version == b"HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if status in (204, 304) or status < 200:  # no body, whatever the headers say
        data = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        data = _chunks(file)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        data = file.read(length)
        if len(data) != length:
            raise ValueError(f"its body was cut short ({len(data)} of {length} bytes)")
    else:  # delimited by the connection's close
        data, keep = file.read(), False
    return status, data, headers, keep


def _chunks(file) -> bytes:
    parts = []
    while size := int(file.readline(1024).split(b";", 1)[0], 16):
        parts.append(file.read(size))
        if len(parts[-1]) != size or file.readline(3) not in (b"\r\n", b"\n"):
            raise ValueError("its chunks were cut short")
    while file.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
        pass
    return b"".join(parts)
