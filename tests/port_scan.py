"""What a stranger inside the cluster's network finds open on a node, and whether it speaks TLS.

    python port_scan.py IP [IP ...]     one JSON object: {ip: {port: "tls" | "plain" | "silent"}}

Every TCP port is tried (a closed one answers at once on the cluster's network); each open one
is offered a TLS ClientHello. A server that answers with a ServerHello or a TLS alert speaks
TLS; one that answers otherwise (an HTTP error, a close) is plain; one that does not answer
even when asked again is silent; a port closed since (a worker's) is left out. Stdlib only: it runs on
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
    """tls, plain, silent (no answer in time: a busy node), or gone (closed since: a worker's port)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((ip, port), timeout=timeout_s) as raw, context.wrap_socket(raw) as tls:
            tls.do_handshake()
            return "tls"
    except ssl.SSLError as e:  # an alert (a client certificate required) is TLS; a wrong version is not
        return "tls" if "alert" in str(e).lower() else "plain"
    except (socket.timeout, TimeoutError):
        return "silent"
    except ConnectionRefusedError:
        return "gone"
    except OSError:  # closed on a ClientHello without a word of TLS
        return "plain"


def scan(ip: str) -> dict[str, str]:
    with ThreadPoolExecutor(256) as pool:
        found = [p for p, up in zip(range(1, 65536), pool.map(lambda p: is_open(ip, p), range(1, 65536))) if up]
    kinds = {p: kind(ip, p) for p in found}
    for _ in range(3):  # a busy node answers late: asked again, with more patience
        kinds.update({p: kind(ip, p, 15) for p, k in kinds.items() if k == "silent"})
    return {str(p): k for p, k in kinds.items() if k != "gone"}


if __name__ == "__main__":
    print(json.dumps({ip: scan(ip) for ip in sys.argv[1:]}))
