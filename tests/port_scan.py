"""What a stranger inside the cluster's network finds open on a node, and whether it speaks TLS.

    python port_scan.py IP [IP ...]     one JSON object: {ip: {port: "tls" | "plain"}}

Every TCP port is tried (a closed one answers at once on the cluster's network); each open one
is offered a TLS ClientHello. A server that answers with a ServerHello or a TLS alert speaks
TLS; anything else (an HTTP error, a close, silence) is counted plain. Stdlib only: it runs on
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


def speaks_tls(ip: str, port: int) -> bool:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((ip, port), timeout=3) as raw, context.wrap_socket(raw) as tls:
            tls.do_handshake()
            return True
    except ssl.SSLError as e:  # an alert (a client certificate required) is TLS; a wrong version is not
        return "alert" in str(e).lower()
    except OSError:
        return False


def scan(ip: str) -> dict[str, str]:
    with ThreadPoolExecutor(256) as pool:
        found = [p for p, up in zip(range(1, 65536), pool.map(lambda p: is_open(ip, p), range(1, 65536))) if up]
    return {str(p): "tls" if speaks_tls(ip, p) else "plain" for p in found}


if __name__ == "__main__":
    print(json.dumps({ip: scan(ip) for ip in sys.argv[1:]}))
