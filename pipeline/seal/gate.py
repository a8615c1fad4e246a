"""Signatures share a PKCS#11 library; starting it again is done alone.

C_Finalize (python-pkcs11's `lib.reinitialize()`) tears down every session of the process: run
while another thread is inside C_Sign, that thread signs through freed state (p11-kit's client
answers with a wrong handle at best; a module started without locking crashes). So a reconnect
waits until no signature is in flight, and holds new ones back meanwhile (it goes first: a busy
signer would otherwise keep it out for good). One gate a module and process: every key of a
module shares its library.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_GATES: dict[str, "Gate"] = {}
_MADE = threading.Lock()


def gate_for(module: str) -> "Gate":
    """The gate of a PKCS#11 module's library in this process."""
    with _MADE:
        return _GATES.setdefault(module, Gate())


class Gate:
    """A readers-writer gate: many `shared()` (calls into the library) at once, or one thread
    `alone()` (C_Finalize, C_Initialize and what follows them), which may nest. `inside` and
    `overlaps` are what a test asks: the calls in flight, and how many times a thread was let
    in alone with one in flight (none, by construction)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.inside = 0
        self.overlaps = 0
        self._owner: int | None = None
        self._depth = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._owner is None)
            self.inside += 1
        try:
            yield
        finally:
            with self._cond:
                self.inside -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._cond.wait_for(lambda: self._owner is None)
                self._owner = me  # new calls wait from here
                self._cond.wait_for(lambda: self.inside == 0)
                self.overlaps += self.inside > 0
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._cond.notify_all()
