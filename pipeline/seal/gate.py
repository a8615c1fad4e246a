"""Signatures share a PKCS#11 library; starting it again is done alone.

C_Finalize (python-pkcs11's `lib.reinitialize()`) tears down every session of the process: run
while another thread is inside C_Sign, that thread signs through freed state (p11-kit's client
answers with a wrong handle at best; a module started without locking crashes). So a reconnect
waits until no signature is in flight, and holds new ones back meanwhile (it goes first: a busy
signer would otherwise keep it out for good). One gate a module and process: every key of a
module shares its library. A call that never comes out of the library (p11-kit 0.24-0.26's client
strands every thread waiting on its socket when a reply is cut short between its header and its
body) would keep a reconnect out for good: `alone(within=...)` gives up on them (Stranded), and the
caller starts a fresh instance of the module behind a gate of its own (token.py), which every
key of the module made after uses too: the abandoned one's gate still counts its stranded calls.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_CURRENT: dict[str, tuple] = {}  # a module's instance started afresh (None: python-pkcs11's own) and its gate
_MADE = threading.Lock()


def current(module: str) -> tuple:
    """A PKCS#11 module's instance in this process, None until one was started afresh (the one
    python-pkcs11 keeps for the path), and the gate of its calls."""
    with _MADE:
        return _CURRENT.setdefault(module, (None, Gate()))


def started_afresh(module: str, lib) -> "Gate":
    """`lib`, a fresh instance of the module, is its instance from now on, behind a new gate."""
    gate = Gate()
    with _MADE:
        _CURRENT[module] = lib, gate
    return gate


class Stranded(Exception):
    """Calls into the library did not come out within the wait given to `alone()`."""


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
    def alone(self, within: float | None = None) -> Iterator[None]:
        """Alone in the library; the calls in it waited for up to `within` seconds (None: for
        good), past which Stranded is raised and new calls are let in again."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._cond.wait_for(lambda: self._owner is None)
                self._owner = me  # new calls wait from here
                if not self._cond.wait_for(lambda: self.inside == 0, timeout=within):
                    self._owner = None
                    self._cond.notify_all()
                    raise Stranded(f"{self.inside} calls in the library for over {within:g} s")
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
