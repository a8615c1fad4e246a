"""Signing with a key that never leaves its HSM: a PKCS#11 token, through python-pkcs11.

A broker's Class 3 DSC is generated on a hardware module and cannot be exported, so the notes'
signature is made there: only the signed attributes (about 200 bytes) cross into the module,
and only the raw signature comes back. Everything else of a note (the PDF, its encryption, the
CMS around the signature) stays ours (sign.py). The key's value is never asked for: nothing
here reads CKA_VALUE of a private key; a key the token marks extractable is used, and said.

An HSM lost mid-run (CKR_DEVICE_ERROR, CKR_DEVICE_REMOVED, CKR_GENERAL_ERROR, a session handle
gone: what a network HSM's client answers when its socket drops) is waited for, up to the later
of CN_HSM_PATIENCE_S and the run's deadline; any other refusal (a mechanism the key does not do,
a key not for signing) is the same on every try, so it fails the note at once, named. The
library is started again only when no signature is in flight (gate.py). A signature is made on a
thread of the key's own, its caller waiting for it: a call the library never returns (p11-kit's
client strands every call waiting on its socket when the server dies between a reply's header and
its body) holds that thread, not the caller. An HSM that goes silent (a network dropping every
packet, a server hung) says no error at all: a call given no answer for `stranded_s` has the HSM
taken as lost (`_watch`), as an error would. Past `stranded_s` the reconnection leaves that
instance of the library as it is (never finalized: calls are inside it) and signs through a fresh
one, if the module gives one (a network HSM's client does; an in-process module does not, and its
signatures then fail with "HSM unreachable" at the patience's end, not never). A signer that
signs several notes at once (`signing`) makes a signature's first try on the worker that runs it,
one hand-off from the note's thread, not two; one stranded there is made again on a fresh worker.

One login per process: the first session logs in, the others share its login, as PKCS#11
defines. A refused PIN is never offered again by this process (HSMs lock a user after a few
failures); credentials.py keeps the refusal for every other process. A network HSM
answers each signature after a round trip, so the key holds several sessions, sized from the
round trip it measures when it opens, and the signer signs that many notes at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import hashlib
import logging
import math
import os
import queue
import re
import resource
import secrets
import statistics
import subprocess
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pkcs11
from asn1crypto import algos
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11 import exceptions as p11

from pipeline.seal.gate import Stranded, current, started_afresh
from pipeline.seal.signer import TEST_LABEL, SignError, SignerSetupError, issue_certificate, labelled_name
from pipeline.settings import clock, gives_up_at

P256 = bytes.fromhex("06082a8648ce3d030107")  # CKA_EC_PARAMS of secp256r1 (its OID, DER)
PIN_REFUSALS = (p11.PinIncorrect, p11.PinInvalid, p11.PinLenRange, p11.PinExpired, p11.PinLocked)
# what a module says when it lost its HSM (p11-kit's client: CKR_DEVICE_ERROR once its socket drops,
# CKR_SESSION_HANDLE_INVALID from a server started again): waited out; any other error is the HSM's answer
LOST = (p11.DeviceError, p11.DeviceRemoved, p11.GeneralError, p11.TokenNotPresent, p11.SessionHandleInvalid,
        p11.SessionClosed)
NOTE_CPU_S = 0.0008  # the least CPU a note costs the signer besides its signature (~0.8 ms, 12-04): what one waiting signature must cover
MAX_SESSIONS = 32
RECONNECT_MAX_S = 5.0  # the longest gap between two tries to reach a lost HSM
MISREAD_S = 4.0  # a token's answer that may be misread while another process writes it: asked again, every 0.25 s
WORKER_IDLE_S = 60.0  # a thread of the key's (_Threads) idle this long ends; the next signature starts one
OUTAGES_KEPT_S = 86400.0  # a process's past HSM outages kept to be reported: a day's
STRANDED_S = 15.0  # a call in the library this long, unanswered, is taken as never coming out (the HSM lost)
_ABANDONED: list = []  # instances of a library left with calls stranded inside: never finalized nor freed
log = logging.getLogger(__name__)


class PinRefused(SignerSetupError):
    """The token refused the PIN: never offered again (credentials.py records the refusal)."""


class HsmRefused(SignError):
    """The HSM answered a signature with an error that is the same on every try (a mechanism the
    key does not do, a key not for signing): the note fails at once, the mechanism and the
    return value named, and no reconnection is tried."""


@dataclass(frozen=True)
class TokenConfig:
    module: str  # the PKCS#11 library (CN_PKCS11_MODULE)
    token: str  # its label (CN_PKCS11_TOKEN)
    key_label: str = ""  # CN_PKCS11_KEY
    key_id: str = ""  # CN_PKCS11_KEY_ID, hex
    pin: str = field(default="", repr=False)
    sessions: int = 0  # signatures in flight; 0: sized from the measured round trip
    patience_s: float = 120.0  # the least a lost HSM's signatures wait for it before they fail
    deadline_at: float = field(default=0.0, compare=False)  # the run's deadline (epoch): waited for until then
    stranded_s: float = STRANDED_S  # a call unanswered this long: the HSM lost, the library started afresh

    def gives_up_at(self, since: float) -> float:
        """When an outage begun at `since` (epoch) stops being waited for (settings.gives_up_at)."""
        return gives_up_at(since, self.patience_s, self.deadline_at)

    def names(self) -> str:
        key = f"label {self.key_label!r}" if self.key_label else f"id {self.key_id}"
        return f"key {key} on token {self.token!r} ({self.module})"


class _Down(Exception):
    """The HSM is lost; the signature waits for it while the patience lasts."""


class _NotReached(Exception):
    """The module did not reach its HSM this time; the PIN was not judged."""


class _Misread(_NotReached):
    """An answer a token gives while another process writes it, in SoftHSM's file store (its
    token file truncated, then written, at each login): the token left out of the module's list
    of others, or its PIN taken as not set. Asked again for MISREAD_S, then said."""


class TokenKey:
    """The token's private key as a signing function for signer.Signer: `sign(data)` returns the
    signature (RSA PKCS#1 v1.5 with SHA-256 by the module, or ECDSA P-256 over our SHA-256, DER).
    Safe from `sessions` threads at once; an HSM lost mid-run holds each signature while it is
    reconnected with backoff, until `config.gives_up_at` its start; past it a signature fails with
    "HSM unreachable". `told` hears when an outage begins and ends (the run's page says so)."""

    def __init__(self, config: TokenConfig, on_refused: Callable[[str], None] = lambda said: None,
                 refusal: Callable[[], str] = lambda: ""):
        self.config = config
        self._lock = threading.Lock()  # the outage's state: held for moments only
        self._reconnecting = threading.Lock()  # one thread reconnects (or gives up on silent calls); the others wait
        self._afresh, self.gate = current(config.module)  # read together: calls, or a restart, never both
        self.lib = None
        self._generation = 0  # the library's starts: a session of an earlier one is gone with it
        self.told: Callable[[float], None] = lambda since: None  # an outage's start (epoch), or 0.0: its end
        self._free: queue.Queue = queue.Queue()
        self._calls = _Threads("pkcs11-call")  # the threads that call into the library for `sign`
        self._workers = _Threads("pkcs11-sign", 1)  # a signer's signatures at once (`signing`), `sessions` of them
        self._telling = _Threads("pkcs11-tell", 1)  # `told`, in order, waited for by no signature (it may call Redis)
        self._inside: dict[object, tuple] = {}  # the calls in the library: (entered, data, a `signing` future or None)
        self._inline = True  # the first signatures on the caller's thread: _measure reads that thread's switches
        self._stranded = ""  # calls the library did not return for `stranded_s`: said, until a fresh one is started
        self.refused = ""  # the PIN refused on a reconnection: each signature after fails so, the PIN never offered
        self.on_refused = on_refused  # a refusal this process met, kept for its later runs and every other process
        self.refusal = refusal  # one another process met: a reconnection (the probes' too) offers no PIN then
        self._sessions: list = []
        self.extractable = False
        self.kind = ""
        self._down_since, self._down_at, self._next_try = 0.0, 0.0, 0.0  # monotonic, epoch, monotonic
        self._outages: list[tuple[float, float]] = []
        self.sessions = 1  # until measured: what a reconnection during the measure opens
        threading.Thread(target=_watch, args=(weakref.ref(self), min(1.0, config.stranded_s / 4)),
                         name="pkcs11-watch", daemon=True).start()
        try:
            self._connect()
        except PinRefused as e:
            self._keep_refusal(str(e))
            raise
        try:
            self.round_trip_s, self.wait_s, blocks = self._measure()
        except HsmRefused as e:  # before the day: one line, exit 2, nothing split
            raise SignerSetupError(str(e)) from None
        except SignError:
            if self.refused:  # the HSM restarted with the PIN changed since the login: refused (and kept) as at a start
                raise PinRefused(self.refused) from None
            raise
        self._inline = False
        waiting = max(1, math.ceil(self.wait_s / NOTE_CPU_S)) if blocks else 0  # in-process: none
        self.sessions = self._workers.size = config.sessions or min(MAX_SESSIONS, 1 + waiting)
        self._open_more(self.sessions - 1)

    @property
    def algorithm(self) -> str:
        return "sha256_ecdsa" if self.kind == "ec" else "rsassa_pkcs1v15"

    def sign(self, data: bytes) -> bytes:
        """The signature; while the HSM is lost the call waits, reconnecting with backoff, until the
        later of `patience_s` from the outage's start and the run's deadline (an HSM's failover, a
        network blip, a long outage cost their length, not the notes); past it, each call fails
        at once until the HSM is back."""
        begun = time.time()  # a signature that fails again after each reconnection gives up too
        while True:
            try:
                self._reconnect_if_due()
                return self._sign_once(data)
            except _Down as e:
                since = self._down_at
                if not since:  # another thread reconnected it meanwhile, or the session was an old one
                    continue
                wait = self.config.gives_up_at(min(since, begun)) - time.time()
                if wait <= 0:
                    raise SignError(self._unreachable(since, e)) from None
                time.sleep(min(wait, max(0.05, self._next_try - time.monotonic())))

    def signing(self, data: bytes) -> Future:
        """The signature as a future, one of `sessions` made at once (signer.Signer.signing): its
        first try on its worker's own thread, one hand-off from the caller, not two (a worker,
        then a thread of `_calls`: docs/benchmarks.md). A call the library never returns holds that
        worker; once the reconnection gives up on such calls (`stranded_s`), their signatures are
        made again on fresh workers (_redrive). Past a first try that met a lost or reconnecting
        HSM, the signature is `sign`'s, on the same worker."""
        future: Future = Future()
        try:
            self._workers.submit(lambda: self._complete(future, data, True))
        except BaseException:
            future.cancel()  # queued with no worker: never made later for no one (_complete passes it over)
            raise
        return future

    def _complete(self, future: Future, data: bytes, first: bool) -> None:
        if future.done():  # made again after a stranding, but the stranded call came back first
            return
        try:
            try:
                value = self._sign_once(data, future) if first and not (self._down_since or self.refused) else None
            except _Down:
                value = None
            if value is None and not future.done():
                value = self.sign(data)
        except BaseException as e:
            with contextlib.suppress(InvalidStateError):  # set already: made meanwhile on a fresh worker
                future.set_exception(e)
            return
        with contextlib.suppress(InvalidStateError):
            future.set_result(value)

    def _redrive(self) -> None:
        """Gives up on the calls inside the library: their callers stop waiting, and every session
        of this start is dropped. Those made on a worker's own thread (`signing`) are made again on
        fresh workers, `sign`'s way, as a stranded worker holds its thread for good; whichever
        ends first sets the future."""
        with self._lock:  # as no call enters unsaid (_sign_once)
            self._generation += 1
            stranded = [(future, data) for _, data, future in self._inside.values() if future is not None]
            self._inside = {}
        self._workers.renew()
        if stranded:
            log.warning("%d signature(s) inside the HSM's library are made again on fresh workers", len(stranded))
        for future, data in stranded:
            try:
                self._workers.submit(lambda future=future, data=data: self._complete(future, data, False))
            except RuntimeError as e:  # no thread to be had: failed, not waited for for good
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(SignError(f"a signature stranded in the HSM's library: not made again ({e})"))

    def _check_silent(self, every: float) -> None:
        """A call given no answer for `stranded_s` has the HSM taken as lost and the calls inside
        given up on (_redrive). A silent HSM says no error, so nothing else would: each session
        held by a silent call, every signature waited for good. The reconnection then starts a
        fresh instance of the module, as after a stranding."""
        with self._lock:
            oldest = min((call[0] for call in self._inside.values()), default=None)
        if oldest is None or time.monotonic() - oldest <= self.config.stranded_s:
            return
        if self._reconnecting.acquire(timeout=every):  # one under way gives up on these calls itself (Stranded)
            try:
                self._give_up_silent()
            finally:
                self._reconnecting.release()

    def _give_up_silent(self) -> None:
        with self._lock:
            silent = [call for call in self._inside.values() if time.monotonic() - call[0] > self.config.stranded_s]
            if not silent:  # they came out, or a reconnection gave up on them, while the lock was awaited
                return
            self._stranded = f"{len(silent)} calls in the library with no answer for over {self.config.stranded_s:g} s"
        self._lost(f"no answer for over {self.config.stranded_s:g} s")
        self._redrive()

    def tell(self, told: Callable[[float], None]) -> None:
        """`told(since)` when an outage begins (epoch seconds), `told(0.0)` when it ends."""
        self.told = told

    def _unreachable(self, since: float, e: Exception) -> str:
        at = clock(since)
        if self.config.deadline_at and self.config.deadline_at > since + self.config.patience_s:
            end = clock(self.config.deadline_at)
            return f"HSM unreachable since {at}, past the run's deadline {end}: {e}; a rerun signs these notes"
        return (f"HSM unreachable since {at}, for over {self.config.patience_s:g} s (CN_HSM_PATIENCE_S): {e}; "
                "a rerun signs these notes")

    def _sign_once(self, data: bytes, direct: Future | None = None) -> bytes:
        """One try, its call into the library on a thread of `_calls`; on this one while the key is
        measured, or for `direct`, a signer's future (`signing`). Said in `_inside` while inside."""
        session, key, made = self._take()
        gate, keep = self.gate, True

        def inside() -> bytes:
            call = object()
            with gate.shared():
                with self._lock:  # as the reconnection gives up on the calls inside, none enters unsaid
                    if made != self._generation:  # taken before the library was started again: gone with it
                        raise _Down("a session of the HSM's last connection")
                    self._inside[call] = time.monotonic(), data, direct
                try:
                    return self._raw(key, data)
                finally:
                    with self._lock:
                        self._inside.pop(call, None)

        try:
            if self._inline or direct is not None:
                raw = inside()
                return algos.DSASignature.from_p1363(raw).dump() if self.kind == "ec" else raw
            call: Future = Future()
            try:
                self._calls.submit(lambda: _settle(call, inside))
            except BaseException:
                if call.cancel():  # queued with no thread: never made later, on a session given back
                    raise  # (else an idle thread took it meanwhile: waited for as any other)
            while True:
                try:
                    raw = call.result(0.25)
                    break
                except TimeoutError:
                    if call.done():  # ended just now, or its own TimeoutError: its value or its error
                        raw = call.result()
                        break
                    if made != self._generation:  # the library started afresh while this call was in it: stranded
                        raise _Down("a signature stranded in the HSM's last library") from None
        except _Down:
            keep = False
            raise
        finally:
            if keep:
                self._free.put((session, key, made))
        return algos.DSASignature.from_p1363(raw).dump() if self.kind == "ec" else raw

    def _take(self) -> tuple:
        wait = max(0.05, self.config.gives_up_at(time.time()) - time.time())
        try:
            return self._free.get(timeout=wait)
        except queue.Empty:
            raise SignError(f"HSM unreachable: no session free for {wait:.0f} s") from None

    def _raw(self, key, data: bytes) -> bytes:
        """The raw signature (RSA with SHA-256 by the module; ECDSA over our SHA-256: CKM_ECDSA_SHA256
        is not in every module). A lost HSM raises _Down; any other error is the HSM's answer."""
        mechanism = Mechanism.ECDSA if self.kind == "ec" else Mechanism.SHA256_RSA_PKCS
        signed = hashlib.sha256(data).digest() if self.kind == "ec" else data
        try:
            signature = _two_calls(key, mechanism, signed)
            return signature if signature is not None else key.sign(signed, mechanism=mechanism)
        except PIN_REFUSALS + (p11.UserNotLoggedIn,) as e:
            raise SignError(f"the HSM logged this signer out ({type(e).__name__})") from None
        except LOST as e:
            self._lost(returned(e))
            raise _Down(f"{returned(e)} from {self.config.module}") from None
        except p11.PKCS11Error as e:
            raise HsmRefused(f"the HSM refused CKM_{mechanism.name} with the {self.config.names()}: {returned(e)} "
                             "(the same on every try: not waited out)") from None

    def outages_since(self, since: float) -> list[tuple[float, float]]:
        """The outages (epoch seconds, from, to) that went on at any time since `since`, one still
        going up to now: what a batch begun then reports it waited on the HSM. Not taken once by
        whoever asks first: a signer's two batches at once both waited through an outage, and
        one of them may be lost and sent again after it (the driver counts a span reported twice
        once; a batch sent again after the outage ended reports none). A day's are kept
        (OUTAGES_KEPT_S), for a process that outlives its run (a notebook's driver)."""
        with self._lock:
            spans = [(start, end) for start, end in self._outages if end >= since]
            if self._down_since:
                spans.append((self._down_at, time.time()))
        return spans

    def alive(self) -> bool:
        """Whether the HSM still signs for this key (one probe signature)."""
        try:
            self.sign(b"contract-notes: is the HSM there?")
            return True
        except SignError:
            return False

    def check_certificate(self, cert: x509.Certificate) -> None:
        """Refuses a certificate that is not this key's: a probe signature must verify with it."""
        probe = b"contract-notes: is this certificate the token key's?"
        signature, public = self.sign(probe), cert.public_key()
        try:
            if self.kind == "ec" and isinstance(public, ec.EllipticCurvePublicKey):
                public.verify(signature, probe, ec.ECDSA(hashes.SHA256()))
            elif self.kind == "rsa" and isinstance(public, rsa.RSAPublicKey):
                public.verify(signature, probe, padding.PKCS1v15(), hashes.SHA256())
            else:
                raise ValueError
        except Exception:
            raise SignerSetupError(f"the certificate ({cert.subject.rfc4514_string()}) is not the token key's: "
                                   f"{self.config.names()}") from None

    def certificate(self) -> tuple[x509.Certificate, list[x509.Certificate]]:
        """The key's certificate from the token (same label or id), and the others it holds."""
        session, key, made = self._free.get()
        try:
            with self.gate.shared():
                found = [x509.load_der_x509_certificate(c[Attribute.VALUE])
                         for c in session.get_objects({Attribute.CLASS: ObjectClass.CERTIFICATE})]
                mine = [c for c in session.get_objects({Attribute.CLASS: ObjectClass.CERTIFICATE, **self._which()})]
        finally:
            self._free.put((session, key, made))
        if not mine:
            raise SignerSetupError(f"no certificate on the token for the {self.config.names()}: set CN_SIGNER_CERT, "
                                   "or put the CA's certificate on the token beside the key")
        cert = x509.load_der_x509_certificate(mine[0][Attribute.VALUE])
        return cert, [c for c in found if c != cert]

    def close(self) -> None:
        with self.gate.alone():
            self._close_sessions()

    def _which(self) -> dict:
        return {Attribute.LABEL: self.config.key_label} if self.config.key_label else \
            {Attribute.ID: bytes.fromhex(self.config.key_id)}

    def _connect(self) -> None:
        """Find the token, log in once, find the key; each failure one line naming what. A module
        that sees no token at all, or fails before the PIN is judged, is asked again with backoff
        for the HSM's patience: a network HSM's first contact fails now and then when signers
        start together (`p11-kit server` failed 1 of 9 simultaneous first contacts here). A
        token missing from a list of others, or its user PIN not set, is asked again for
        MISREAD_S only (_Misread: a signer starting as another logged in missed its token). A
        refused PIN is answered at once."""
        begun, delay, misread_since = time.time(), 0.25, 0.0
        while True:
            try:
                if self.lib is None:
                    self.lib = _load(self.config.module, self._afresh)
                return self._connect_once()
            except _NotReached as e:
                now, misread = time.time(), isinstance(e, _Misread)
                if misread and not misread_since:  # its own 4 s, from its own first try
                    misread_since, delay = now, 0.25
                elif not misread:
                    misread_since = 0.0
                if now + delay > (misread_since + MISREAD_S if misread else self.config.gives_up_at(begun)):
                    raise SignerSetupError(str(e) if misread else f"{e} for {now - begun:.0f} s") from None
                time.sleep(delay)
                delay = delay if misread else min(2 * delay, 5.0)  # each list a fresh draw: as many as fit
                if self.lib is not None:
                    try:
                        with self.gate.alone():
                            self.lib.reinitialize()
                    except p11.PKCS11Error:  # not started again: the next try says so, or the patience's end
                        pass

    def _connect_once(self) -> None:
        try:
            token = self._token_once_more()
        except p11.NoSuchToken:
            labels = self._labels()
            said = (f"CN_PKCS11_TOKEN: no token labelled {self.config.token!r} in {self.config.module} "
                    f"(it has: {', '.join(labels) or 'none'})")
            raise (_Misread(said) if labels else _NotReached(said + ": the HSM did not answer")) from None
        except p11.PKCS11Error as e:
            raise self._unlistable(e) from None
        try:
            session = token.open(user_pin=self.config.pin)
        except p11.UserAlreadyLoggedIn:  # another key of this process logged in to the token: its login is ours
            session = token.open()
        except PIN_REFUSALS as e:
            raise PinRefused(f"the HSM refused the PIN for token {self.config.token!r} ({type(e).__name__}): "
                             "it is not offered again") from None
        except p11.UserPinNotInitialized:
            raise _Misread(f"token {self.config.token!r} in {self.config.module}: its user PIN is not set") from None
        except (p11.GeneralError, p11.DeviceError, p11.DeviceRemoved, p11.TokenNotPresent) as e:
            raise _NotReached(f"token {self.config.token!r} in {self.config.module}: no session "
                              f"({type(e).__name__})") from None
        self._token = token
        key = self._find_key(session)
        self.kind = {KeyType.RSA: "rsa", KeyType.EC: "ec"}.get(key.key_type, "")
        if not self.kind or self.kind == "ec" and key[Attribute.EC_PARAMS] != P256:
            what = key.key_type.name if not self.kind else "EC on a curve other than P-256"
            session.close()
            raise SignerSetupError(f"the {self.config.names()} is {what}: notes are signed with RSA or ECDSA P-256")
        self.extractable = bool(key[Attribute.EXTRACTABLE])
        self._sessions.append(session)
        self._free.put((session, key, self._generation))

    def _labels(self) -> list[str]:
        try:
            return sorted(t.label for t in self.lib.get_tokens())
        except p11.PKCS11Error as e:
            raise self._unlistable(e) from None

    def _unlistable(self, e: p11.PKCS11Error) -> _NotReached:
        return _NotReached(f"CN_PKCS11_MODULE {self.config.module}: cannot list its tokens ({type(e).__name__})")

    def _token_once_more(self):
        """The token; the module started again once if it lost its HSM (a process that signed for
        an earlier run: Ray reuses its workers)."""
        try:
            return self.lib.get_token(token_label=self.config.token)
        except (p11.DeviceError, p11.DeviceRemoved, p11.GeneralError, p11.TokenNotPresent):
            with self.gate.alone():
                self.lib.reinitialize()
                return self.lib.get_token(token_label=self.config.token)

    def _find_key(self, session):
        try:
            return session.get_key(object_class=ObjectClass.PRIVATE_KEY, **(
                {"label": self.config.key_label} if self.config.key_label else {"id": bytes.fromhex(self.config.key_id)}))
        except (p11.NoSuchKey, p11.MultipleObjectsReturned) as e:
            session.close()
            why = "not found" if isinstance(e, p11.NoSuchKey) else "matches more than one key"
            raise SignerSetupError(f"CN_PKCS11_{'KEY' if self.config.key_label else 'KEY_ID'}: the private "
                                   f"{self.config.names()} {why}") from None

    def _open_more(self, count: int) -> None:
        """Sessions that share the first one's login: no PIN crosses again."""
        for _ in range(count):
            session = self._token.open()
            self._sessions.append(session)
            self._free.put((session, self._find_key(session), self._generation))

    def _measure(self, probes: int = 5) -> tuple[float, float, bool]:
        """The round trip of one signature; the part of it spent waiting, neither on a CPU nor
        queued for one; and whether the module blocks while it signs: a voluntary context switch
        a signature, on average, as a module whose signature another process makes (a network
        HSM's client, p11-kit's) does. In-process SoftHSM makes none; p11-kit's client makes
        about five a signature. A module that blocks gets two sessions at least, more as its
        wait grows; any other, one. Waiting time alone misjudged both ways on a loaded machine:
        an in-process SoftHSM read as waiting 2.2 ms (its extra sessions would sign from several
        threads at once, which a module python-pkcs11 starts without locking does not survive:
        GeneralError; a segfault), and a network HSM as waiting none (one session: the signer
        waited out every signature). Blocking does not tell either when the HSM's server shares
        a saturated CPU with us: its work is then time we spend queued, and its reply is in
        before we read; such a module gets one session, which is safe."""
        walls, waits, switches = [], [], []
        for _ in range(probes):
            switched, wall = _voluntary_switches(), time.perf_counter()
            busy = _thread_busy_s()
            self.sign(b"contract-notes: the HSM's round trip")
            busy = _thread_busy_s() - busy
            walls.append(time.perf_counter() - wall)
            waits.append(walls[-1] - busy)
            switches.append(_voluntary_switches() - switched)
        return statistics.median(walls), max(0.0, statistics.median(waits)), sum(switches) >= probes

    def _lost(self, said: str) -> None:
        """Marks the HSM lost (once an outage): its sessions are closed by the reconnection, when
        no signature is in flight."""
        with self._lock:
            if self._down_since:
                return
            self._down_since, self._down_at, self._next_try = time.monotonic(), time.time(), time.monotonic()
            self._tell(self._down_at)
        log.warning("the HSM is taken as lost: %s from %s; its signatures wait for it until %s", said,
                    self.config.module, clock(self.config.gives_up_at(self._down_at)))

    def _reconnect_if_due(self) -> None:
        """While the HSM is lost, one thread at a time tries to reconnect, with backoff (0.5, 1, 2,
        4, then every 5 s: an HSM back is found within seconds of its return); the others wait."""
        if self.refused:
            raise SignError(self.refused)
        if not self._down_since:
            return
        if not self._reconnecting.acquire(blocking=False):
            raise _Down(f"being reconnected ({self.config.module})")
        try:
            now = time.monotonic()
            if not self._down_since:
                return
            if now < self._next_try:
                raise _Down(f"unreachable since {now - self._down_since:.0f} s ({self.config.module})")
            refused = self.refused or self._known_refusal()
            if not refused:
                try:
                    self._reconnect()
                    self._back(now)
                    return
                except PinRefused as e:  # the PIN changed under a running day: offered once, as at a start
                    refused = str(e)
                    self._keep_refusal(refused)
                except Exception as e:
                    self._next_try = now + min(RECONNECT_MAX_S, max(0.5, 2 * (now - self._down_since)))
                    raise _Down(f"unreachable since {now - self._down_since:.0f} s: {type(e).__name__}") from None
            raise self._refused_from_now(refused)
        finally:
            self._reconnecting.release()

    def _refused_from_now(self, said: str) -> SignError:
        """Each later signature fails with the refusal, at once: the outage is over (the page
        stops waiting for the HSM; the run's waits on it stop growing)."""
        self.refused = said
        if self._down_since:
            self._end_outage()
        self._redrive()  # a call left in the library waits no more: its signature fails so too
        return SignError(said)

    def _keep_refusal(self, said: str) -> None:
        try:
            self.on_refused(said)
        except Exception as e:  # this process offers it no more; another offers it once more
            log.warning("the HSM's refusal of the PIN is not kept for other processes: %s", type(e).__name__)

    def _known_refusal(self) -> str:
        try:
            return self.refusal()
        except Exception as e:  # not known: the reconnection offers the PIN, once for this process
            log.warning("whether another process met the HSM's refusal of the PIN is not known: %s", type(e).__name__)
            return ""

    def _reconnect(self) -> None:
        """The library started again and the sessions opened anew, alone in it (gate.py): the
        sessions of its last start are dropped by whoever holds one. Calls still in the library
        after `stranded_s` never come out: that instance is left as it is, and a fresh one is
        started behind a gate of its own."""
        if not self._stranded or not self.gate.inside:  # (once stranded, a try waits no more, unless they came out)
            try:
                with self.gate.alone(within=self.config.stranded_s):
                    self._open_again(self.lib.reinitialize)
                self._stranded = ""
                return
            except Stranded as e:
                self._stranded = str(e)
                self._redrive()
        try:
            from pkcs11 import _pkcs11  # pkcs11.lib gives back the instance it keeps a path: this one

            fresh = _pkcs11.lib(self.config.module)  # C_GetFunctionList and C_Initialize anew
        except Exception as e:  # CKR_CRYPTOKI_ALREADY_INITIALIZED: one instance a process, the stranded calls' own
            raise _NotReached(f"{self._stranded}; no fresh instance of {self.config.module} "
                              f"({type(e).__name__})") from None
        _ABANDONED.append((self.lib, self.gate))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.lib))  # never freed, so never finalized, even at exit
        log.warning("the HSM's library is started afresh: %s (%s)", self._stranded, self.config.module)
        self.lib, self.gate, self._stranded = fresh, started_afresh(self.config.module, fresh), ""
        with self.gate.alone():
            self._open_again(lambda: None, close=False)

    def _open_again(self, start: Callable[[], None], close: bool = True) -> None:
        """The sessions of the library's last start dropped (closed, unless calls are stranded in
        it), `start`, and the sessions opened anew; alone in the library."""
        with self._lock:
            self._generation += 1
        self._close_sessions(close)
        try:
            start()
            self._connect_once()
            self._open_more(self.sessions - 1)
        except BaseException:
            self._close_sessions()
            raise

    def _back(self, now: float) -> None:
        log.warning("the HSM is back after %.1f s (%s)", now - self._down_since, self.config.module)
        self._end_outage()

    def _end_outage(self) -> None:
        with self._lock:
            now = time.time()
            self._outages = [span for span in self._outages if span[1] >= now - OUTAGES_KEPT_S]
            self._outages.append((self._down_at, now))
            self._down_since, self._down_at = 0.0, 0.0
            self._tell(0.0)

    def _tell(self, since: float) -> None:
        """`told(since)` on a thread of its own, after those asked before (asked under `_lock`, as
        the outage's state changes): a Redis gone silent with the HSM holds no signature nor
        reconnection."""
        def tell(told: Callable[[float], None] = self.told) -> None:  # the page of the run it happened in
            try:
                told(since)
            except Exception as e:  # the page's note is a courtesy: the signatures do not wait on it
                log.warning("the HSM's outage could not be noted: %s", e)
        try:
            self._telling.submit(tell)
        except RuntimeError as e:  # no thread to be had: queued, told when one is
            log.warning("the HSM's outage is not noted yet: %s", e)

    def _close_sessions(self, close: bool = True) -> None:
        while not self._free.empty():
            self._free.get_nowait()
        for session in self._sessions if close else ():
            try:
                session.close()
            except Exception:  # the HSM is gone: its sessions are too
                pass
        self._sessions = []


def _watch(key: "weakref.ref[TokenKey]", every: float) -> None:
    """A key's watch over its calls in the library (TokenKey._check_silent), every `every`
    seconds for as long as the key lives."""
    while (alive := key()) is not None:
        try:
            alive._check_silent(every)
        except Exception as e:  # the watch goes on: the next look may give up on them
            log.warning("the HSM's calls could not be given up on: %s", e)
        del alive
        time.sleep(every)


def _settle(future: Future, fn: Callable[[], bytes]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as e:
        future.set_exception(e)


class _Threads:
    """Daemon threads that run jobs, `size` at most (None: a thread for each job at once, none
    waiting), one idle for WORKER_IDLE_S ending. A call the library never returns holds its
    thread for good (not the caller, nor the process's exit): `renew` hands the jobs not begun,
    and every later one, to fresh threads. A signer's workers are as many as the key's sessions,
    as its pool had threads: twice as many cost the signer too much (docs/benchmarks.md)."""

    def __init__(self, name: str, size: int | None = None) -> None:
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started, self._idle = 0, 0  # idle: the threads waiting for a job less the jobs waiting for one
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:  # put while held: a thread ending for want of jobs sees this one first
            self._jobs.put(job)
            start = self._idle <= 0 and (self.size is None or self._started < self.size)
            self._started += start
            self._idle -= not start
            jobs = self._jobs
        if start:
            try:
                threading.Thread(target=self._work, args=(jobs,), name=self.name, daemon=True).start()
            except BaseException:  # no thread: the slot is not taken
                with self._lock:
                    if jobs is self._jobs:
                        self._started -= 1
                        self._idle -= 1  # the job waits for a thread like any other
                raise

    def renew(self) -> None:
        with self._lock:
            old, self._jobs, self._started, self._idle = self._jobs, queue.SimpleQueue(), 0, 0
        while True:
            try:
                job = old.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(RuntimeError):  # no thread to be had: queued, for the next one started
                self.submit(job)

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            try:
                job = jobs.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if jobs is not self._jobs:  # renewed: this thread no longer counts
                        return
                    if jobs.empty():
                        self._started -= 1
                        self._idle -= 1
                        return
                continue
            job()
            del job
            with self._lock:
                if jobs is not self._jobs:
                    return
                self._idle += 1


class _Mechanism(ctypes.Structure):
    _fields_ = [("mechanism", ctypes.c_ulong), ("parameter", ctypes.c_void_p), ("parameter_len", ctypes.c_ulong)]


class _FunctionList(ctypes.Structure):  # CK_FUNCTION_LIST to C_Sign: its version, then the functions in order
    _fields_ = [("version", ctypes.c_ubyte * 2), ("functions", ctypes.c_void_p * 44)]


_SIGN_INIT = ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_ulong, ctypes.POINTER(_Mechanism), ctypes.c_ulong)
_SIGN = ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p,
                         ctypes.POINTER(ctypes.c_ulong))
_C_SIGN_INIT, _C_SIGN = 42, 43  # their places in CK_FUNCTION_LIST
_BUFFER_TOO_SMALL = 0x150
_SIGNATURE_MAX = 1024  # bytes: an RSA key's to 8,192 bits; ECDSA P-256's is 64
# the return values _raw tells apart, raised as python-pkcs11 would; any other is named by python-pkcs11's own try
_RAISED = {0x30: p11.DeviceError, 0x32: p11.DeviceRemoved, 0x05: p11.GeneralError, 0xE0: p11.TokenNotPresent,
           0xB3: p11.SessionHandleInvalid, 0xB0: p11.SessionClosed, 0x101: p11.UserNotLoggedIn,
           0xA0: p11.PinIncorrect, 0xA1: p11.PinInvalid, 0xA2: p11.PinLenRange, 0xA3: p11.PinExpired,
           0xA4: p11.PinLocked}
try:  # python-pkcs11 0.10 keeps a module's function list as the first field of its objects: read there
    from pkcs11._pkcs11 import HasFuncList  # only while its layout is that one; else its three calls
    _LIST_AT = object.__basicsize__ if HasFuncList.__base__ is object and \
        HasFuncList.__basicsize__ == object.__basicsize__ + 3 * ctypes.sizeof(ctypes.c_void_p) else 0
except ImportError:
    HasFuncList, _LIST_AT = None, 0
# a list's address: its C_SignInit and C_Sign, or None (not a list read here). Never stale: no instance of a
# module is unloaded in a process (one left with calls stranded in it is kept: _ABANDONED)
_SIGNS: dict[int, tuple | None] = {}


def _functions(session) -> tuple | None:
    """C_SignInit and C_Sign of the session's own instance of the module (a network client's
    C_GetFunctionList gives a fresh instance, not started, at each call); None when python-pkcs11's
    layout is not the one read here."""
    if not _LIST_AT or not isinstance(session, HasFuncList):
        return None
    table = ctypes.c_void_p.from_address(id(session) + _LIST_AT).value
    if table not in _SIGNS:
        listed = _FunctionList.from_address(table) if table else None
        _SIGNS[table] = (_SIGN_INIT(listed.functions[_C_SIGN_INIT]), _SIGN(listed.functions[_C_SIGN])) \
            if listed is not None and listed.version[0] in (2, 3) else None
    return _SIGNS[table]


def _two_calls(key, mechanism: Mechanism, data: bytes) -> bytes | None:
    """The raw signature in two calls into the module, C_SignInit and one C_Sign with a buffer it
    fits, where python-pkcs11's `sign` makes three (it asks C_Sign for the length first): through
    a network HSM's client, each call is a round trip. A lost HSM or a refused login raises what
    python-pkcs11 would; None for any other refusal (a refused C_SignInit started nothing, a
    refused C_Sign ended the operation: python-pkcs11 then signs once more, and names what the
    module says), or when python-pkcs11's layout is not the one read here."""
    session = key.wrapper.session
    functions = _functions(session)
    if functions is None:
        return None
    rv = functions[0](session.handle, ctypes.byref(_Mechanism(mechanism, None, 0)), key.wrapper.handle)
    length = ctypes.c_ulong(_SIGNATURE_MAX)
    for _ in range(3 if rv == 0 else 0):  # a module that wants more room says how much; the operation goes on
        out = ctypes.create_string_buffer(length.value)
        rv = functions[1](session.handle, data, len(data), out, ctypes.byref(length))
        if rv != _BUFFER_TOO_SMALL:
            break
    if rv in _RAISED:
        raise _RAISED[rv]()
    return out.raw[:length.value] if rv == 0 else None


def returned(e: p11.PKCS11Error) -> str:
    """The return value an error stands for, as PKCS#11 names it: python-pkcs11 keeps the class
    (MechanismInvalid), not the code (CKR_MECHANISM_INVALID); an unmapped one keeps its message
    ("Unmapped error code 0x68": CKR_KEY_FUNCTION_NOT_PERMITTED)."""
    if type(e) is p11.PKCS11Error:
        return f"PKCS11Error ({e})" if str(e) else "PKCS11Error"
    return "CKR_" + re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).upper()


def _voluntary_switches() -> int:
    """This thread's voluntary context switches (Linux); elsewhere none are counted, and every
    module is taken as in-process: one session, which any module survives."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nvcsw if who is not None else 0


def _thread_busy_s() -> float:
    """This thread's time on a CPU and queued for one. The queue's is Linux's schedstat (its
    on-CPU figure lags by up to a tick; thread_time's does not); elsewhere, on a CPU alone."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            queued = int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        queued = 0.0
    return time.thread_time() + queued


def _load(module: str, afresh):
    """The module, started: `afresh`, its instance started afresh in this process, or None. A library that cannot be opened is said at once; one that opens but
    does not start (C_Initialize: a network module that did not reach its HSM) may be tried again."""
    try:
        ctypes.CDLL(module)
    except OSError as e:
        raise SignerSetupError(f"CN_PKCS11_MODULE {module}: cannot load it ({str(e).split(':')[-1].strip()})") \
            from None
    try:
        if afresh is None:
            return pkcs11.lib(module)
        if not afresh.initialized:
            afresh.initialize()
        return afresh
    except Exception as e:
        raise _NotReached(f"CN_PKCS11_MODULE {module}: it did not start ({type(e).__name__})") from None


SOFTHSM = "/usr/lib/softhsm/libsofthsm2.so"  # Debian's softhsm2 (scripts/install.sh)
P11_KIT_CLIENT = "/usr/lib/x86_64-linux-gnu/pkcs11/p11-kit-client.so"  # a network HSM's module: p11-kit server's


@dataclass(frozen=True)
class LocalToken:
    conf: Path  # SOFTHSM2_CONF: the module finds the token through it
    label: str
    key_label: str
    pin_file: Path
    cert: Path  # also on the token, beside the key
    chain: Path


def make_test_token(directory: Path, label: str = "cn-test", key_label: str = "signer",
                    key_type: str = "rsa", extractable: bool = False) -> LocalToken:
    """A SoftHSM2 token for the embedded default and the tests, made once a label in `directory`'s
    store: the key generated on the token, sensitive and not extractable, and a LOCAL TEST
    certificate for it from a test root, stored on the token too. SOFTHSM2_CONF must name `conf` in every process
    that loads the module (the caller sets it before Ray starts, so the workers inherit it)."""
    directory = directory.resolve()
    made = LocalToken(directory / "softhsm2.conf", label, key_label, directory / f"{label}.pin",
                      directory / f"{label}.cert.pem", directory / f"{label}.root.pem")
    os.environ["SOFTHSM2_CONF"] = str(made.conf)  # this process's module too
    if made.cert.exists():
        return made
    (directory / "tokens").mkdir(parents=True, exist_ok=True)
    if not made.conf.exists():  # one store, as many tokens as labels
        made.conf.write_text(f"directories.tokendir = {directory / 'tokens'}\nobjectstore.backend = file\n"
                             "log.level = ERROR\n")
    made.pin_file.write_text(secrets.token_hex(8))
    made.pin_file.chmod(0o600)
    env = dict(os.environ)
    subprocess.run(["softhsm2-util", "--init-token", "--free", "--label", label, "--pin", made.pin_file.read_text(),
                    "--so-pin", secrets.token_hex(8)], env=env, check=True, capture_output=True)
    lib = pkcs11.lib(SOFTHSM)
    with current(SOFTHSM)[1].alone():
        lib.reinitialize()  # the library read its configuration when first loaded: this token is new
    private = {Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: extractable, Attribute.ID: b"\x01"}
    with lib.get_token(token_label=label).open(user_pin=made.pin_file.read_text(), rw=True) as session:
        if key_type == "ec":
            params = session.create_domain_parameters(KeyType.EC, {Attribute.EC_PARAMS: P256}, local=True)
            public, _ = params.generate_keypair(store=True, label=key_label, private_template=private,
                                                public_template={Attribute.ID: b"\x01"})
            point = public[Attribute.EC_POINT]  # DER OCTET STRING around the uncompressed point
            public_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point[2:])
        else:
            public, _ = session.generate_keypair(KeyType.RSA, 2048, store=True, label=key_label,
                                                 private_template=private, public_template={Attribute.ID: b"\x01"})
            public_key = rsa.RSAPublicNumbers(int.from_bytes(public[Attribute.PUBLIC_EXPONENT], "big"),
                                              int.from_bytes(public[Attribute.MODULUS], "big")).public_key()
        now = dt.datetime.now(dt.timezone.utc)
        root_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        root_name = labelled_name(f"Test Root CA ({TEST_LABEL})")
        root = issue_certificate(root_name, root_name, root_key.public_key(), root_key, now, ca=True)
        cert = issue_certificate(labelled_name(f"Signatory on an HSM ({TEST_LABEL})"), root_name, public_key, root_key, now,
                            ca=False, issuer_key_id=root)
        der = cert.public_bytes(serialization.Encoding.DER)
        session.create_object({Attribute.CLASS: ObjectClass.CERTIFICATE, Attribute.CERTIFICATE_TYPE: 0,
                               Attribute.TOKEN: True, Attribute.LABEL: key_label, Attribute.ID: b"\x01",
                               Attribute.VALUE: der, Attribute.SUBJECT: cert.subject.public_bytes()})
    made.chain.write_bytes(root.public_bytes(serialization.Encoding.PEM))
    made.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return made
