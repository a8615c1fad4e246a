"""The simulated cloud's network HSM, as CloudHSM's client reaches its HSMs: over TLS, the HSM's
certificate checked against the HSM cluster's CA (CloudHSM's customerCA.crt).

  hsm_link.py serve   --port 2223 --socket P --cert C --key K   on the HSM's instance: `p11-kit
                                                                  server`'s socket P behind TLS
  hsm_link.py connect --socket P --hsm IP:2223 --ca CA            on a node: a local socket P for
                                                                  p11-kit-client.so (P11_KIT_SERVER_ADDRESS)

`connect` makes its socket only once a TLS handshake with the HSM has succeeded, so a setup
command that waits for the socket fails when the HSM cannot be reached. Standard library only:
it runs with any node's python.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def _join(reader, writer, open_other) -> None:
    try:
        other_reader, other_writer = await open_other()
    except (OSError, ssl.SSLError) as e:
        print(f"hsm_link: {e}", file=sys.stderr, flush=True)
        writer.close()
        return
    await asyncio.gather(_pipe(reader, other_writer), _pipe(other_reader, writer))


async def serve(port: int, socket_path: str, cert: str, key: str) -> None:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = await asyncio.start_server(
        lambda r, w: _join(r, w, lambda: asyncio.open_unix_connection(socket_path)), "0.0.0.0", port, ssl=tls)
    async with server:
        await server.serve_forever()


async def connect(socket_path: str, hsm: str, ca: str) -> None:
    host, port = hsm.rsplit(":", 1)
    tls = ssl.create_default_context(cafile=ca)

    def to_hsm():
        return asyncio.open_connection(host, int(port), ssl=tls, server_hostname=host)

    for _ in range(60):  # the HSM's instance may still be starting its server
        try:
            _, writer = await to_hsm()
            writer.close()
            break
        except ssl.SSLError:
            raise
        except OSError:
            await asyncio.sleep(0.5)
    else:
        raise SystemExit(f"hsm_link: the HSM at {hsm} cannot be reached")
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    old = os.umask(0o077)  # the node's user only
    server = await asyncio.start_unix_server(lambda r, w: _join(r, w, to_hsm), socket_path)
    os.umask(old)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, default=2223)
    s.add_argument("--socket", required=True)
    s.add_argument("--cert", required=True)
    s.add_argument("--key", required=True)
    c = sub.add_parser("connect")
    c.add_argument("--socket", required=True)
    c.add_argument("--hsm", required=True)
    c.add_argument("--ca", required=True)
    a = parser.parse_args()
    if a.mode == "serve":
        asyncio.run(serve(a.port, a.socket, a.cert, a.key))
    else:
        asyncio.run(connect(a.socket, a.hsm, a.ca))


if __name__ == "__main__":
    main()
