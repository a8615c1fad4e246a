"""What a stranger inside the cluster's network finds open on a node, and whether it speaks TLS.

    python port_scan.py IP [IP ...]     one JSON object: {ip: {port: "tls" | "plain" | "silent" | "closed"}}

Every TCP port is tried (a closed one answers at once on the cluster's network); each open one
is offered a TLS ClientHello. A server that answers with a ServerHello or a TLS alert speaks
TLS; one that answers with bytes that are not TLS (an HTTP error) is plain, and so is one that
hangs up on the hello but answers a plain HTTP request; one that does neither, even when asked
again, is silent or closed; a port closed since (a worker's) is left out. Stdlib only: it runs on
an instance with nothing of the project's installed.
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
from concurrent.futures import ThreadPoolExecutor


def is_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1):
            return True
    except OSError:
        return False


def kind(ip: str, port: int, timeout_s: float = 5) -> str:
    """tls, plain, silent (no answer in time: a busy node) or closed (it hung up without a word:
    a worker's port going away, or a server under load; asked again later)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((ip, port), timeout=timeout_s) as raw, context.wrap_socket(raw) as tls:
            tls.do_handshake()
            return "tls"
    except ssl.SSLError as e:  # an alert (a client certificate required) is TLS; bytes that are not TLS are plain
        said = str(e).lower()
        return "tls" if "alert" in said else "plain" if "wrong version" in said or "http" in said else \
            _http(ip, port, timeout_s)
    except (socket.timeout, TimeoutError):
        return "silent"
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return _http(ip, port, timeout_s)


def _http(ip: str, port: int, timeout_s: float) -> str:
    """A port that hung up on a TLS hello: plain if it answers a plain HTTP request."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return "plain" if raw.recv(5) == b"HTTP/" else "closed"
    except (socket.timeout, TimeoutError):
        return "silent"
    except OSError:
        return "closed"


def scan(ip: str) -> dict[str, str]:
    with ThreadPoolExecutor(256) as pool:
        found = [p for p, up in zip(range(1, 65536), pool.map(lambda p: is_open(ip, p), range(1, 65536))) if up]
    kinds = {p: kind(ip, p) for p in found}
    for _ in range(3):  # a busy node answers late: asked again, with more patience
        kinds.update({p: kind(ip, p, 15) for p, k in kinds.items() if k in ("silent", "closed")})
    return {str(p): k for p, k in kinds.items() if k != "gone"}


if __name__ == "__main__":  # the nodes at once: a worker lives only as long as the day
    with ThreadPoolExecutor(len(sys.argv) - 1) as hosts:
        print(json.dumps(dict(zip(sys.argv[1:], hosts.map(scan, sys.argv[1:])))))
