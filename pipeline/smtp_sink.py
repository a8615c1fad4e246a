"""A local SMTP server that keeps what it receives: one .eml file per message in a folder.

The embedded default's relay, and the tests' real SMTP peer. Files are named by
Message-ID, written atomically; a duplicate Message-ID is kept as a second file, so a
double delivery is visible rather than hidden.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
from email.parser import BytesHeaderParser
from pathlib import Path

from aiosmtpd.controller import Controller


class OutboxHandler:
    def __init__(self, outbox: Path):
        self.outbox = outbox
        outbox.mkdir(parents=True, exist_ok=True)

    async def handle_DATA(self, server, session, envelope) -> str:
        data = envelope.original_content or envelope.content
        mid = BytesHeaderParser().parsebytes(data).get("Message-ID", "") or repr(envelope.rcpt_tos)
        name = hashlib.sha256(mid.encode()).hexdigest()[:32]
        path = self.outbox / f"{name}.eml"
        n = 1
        while path.exists():
            n += 1
            path = self.outbox / f"{name}.{n}.eml"
        tmp = self.outbox / f".{path.name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return "250 OK queued as " + path.stem


def serve(host: str, port: int, outbox: Path) -> None:
    controller = Controller(OutboxHandler(outbox), hostname=host, port=port,
                            server_kwargs={"data_size_limit": 64 * 1024 * 1024}, decode_data=False)
    controller.start()
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"smtp sink listening on {host}:{port}, outbox {outbox}", flush=True)
    loop.run_until_complete(stop.wait())
    controller.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--outbox", type=Path, required=True)
    args = parser.parse_args()
    serve(args.host, args.port, args.outbox)
