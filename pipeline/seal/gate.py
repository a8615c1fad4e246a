"""Signatures share a PKCS#11 library; starting it again is done alone.

C_Finalize (python-pkcs11's `lib.reinitialize()`) tears down every session of the process: run
while another thread is inside C_Sign, that thread signs through freed state (p11-kit's client
answers with a wrong handle at best; a module started without locking crashes). So a reconnect
waits until no signature is in flight, and holds new ones back meanwhile (it goes first: a busy
signer would otherwise keep it out for good).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class Gate:
    """A readers-writer gate: many `shared()` (signatures) at once, or one `alone()` (a
    reconnect). `inside` and `overlaps` are what a test asks: the signatures in flight, and how
    many times a reconnect began with one in flight (none, by construction)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.inside = 0
        self.alone_now = False
        self.overlaps = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self.alone_now)
            self.inside += 1
        try:
            yield
        finally:
            with self._cond:
                self.inside -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self.alone_now)
            self.alone_now = True  # new signatures wait from here
            self._cond.wait_for(lambda: self.inside == 0)
            self.overlaps += self.inside > 0
        try:
            yield
        finally:
            with self._cond:
                self.alone_now = False
                self._cond.notify_all()
