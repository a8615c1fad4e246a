"""Signing with a key that never leaves its HSM: a PKCS#11 token, through python-pkcs11.

A broker's Class 3 DSC is generated on a hardware module and cannot be exported, so the notes'
signature is made there: only the signed attributes (about 200 bytes) cross into the module,
and only the raw signature comes back. Everything else of a note (the PDF, its encryption, the
CMS around the signature) stays ours (sign.py). The key's value is never asked for: nothing
here reads CKA_VALUE of a private key; a key the token marks extractable is used, and said.

One login per process: the first session logs in, the others share its login, as PKCS#11
defines. A refused PIN is never offered again by this process (HSMs lock a user after a few
failures); credentials.py keeps the refusal for every other process. A network HSM
answers each signature after a round trip, so the key holds several sessions, sized from the
round trip it measures when it opens, and the signer signs that many notes at once.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import hashlib
import logging
import math
import os
import queue
import resource
import secrets
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pkcs11
from asn1crypto import algos
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11 import exceptions as p11

from pipeline.seal.signer import TEST_LABEL, SignError, SignerSetupError, issue_certificate, labelled_name

P256 = bytes.fromhex("06082a8648ce3d030107")  # CKA_EC_PARAMS of secp256r1 (its OID, DER)
PIN_REFUSALS = (p11.PinIncorrect, p11.PinInvalid, p11.PinLenRange, p11.PinExpired, p11.PinLocked)
NOTE_CPU_S = 0.002  # the least CPU a note costs besides its signature: what one waiting signature must cover
MAX_SESSIONS = 32
RECONNECT_MAX_S = 5.0  # the longest gap between two tries to reach a lost HSM
log = logging.getLogger(__name__)


class PinRefused(SignerSetupError):
    """The token refused the PIN: never offered again (credentials.py records the refusal)."""


@dataclass(frozen=True)
class TokenConfig:
    module: str  # the PKCS#11 library (CN_PKCS11_MODULE)
    token: str  # its label (CN_PKCS11_TOKEN)
    key_label: str = ""  # CN_PKCS11_KEY
    key_id: str = ""  # CN_PKCS11_KEY_ID, hex
    pin: str = field(default="", repr=False)
    sessions: int = 0  # signatures in flight; 0: sized from the measured round trip
    patience_s: float = 120.0  # how long a lost HSM's signatures wait for it before they fail

    def names(self) -> str:
        key = f"label {self.key_label!r}" if self.key_label else f"id {self.key_id}"
        return f"key {key} on token {self.token!r} ({self.module})"


class _Down(Exception):
    """The HSM is lost; the signature waits for it while the patience lasts."""


class _NotReached(Exception):
    """The module did not reach its HSM this time; the PIN was not judged."""


class TokenKey:
    """The token's private key as a signing function for signer.Signer: `sign(data)` returns the
    signature (RSA PKCS#1 v1.5 with SHA-256 by the module, or ECDSA P-256 over our SHA-256, DER).
    Safe from `sessions` threads at once; an HSM lost mid-run holds each signature while it is
    reconnected with backoff, for `patience_s`; past it a signature fails with "HSM unreachable"."""

    def __init__(self, config: TokenConfig):
        self.config = config
        self.lib = None
        self._lock = threading.Lock()
        self._free: queue.Queue = queue.Queue()
        self._sessions: list = []
        self.extractable = False
        self.kind = ""
        self._down_since, self._down_at, self._next_try = 0.0, 0.0, 0.0  # monotonic, epoch, monotonic
        self._outages: list[tuple[float, float]] = []
        self._connect()
        self.round_trip_s, self.wait_s, blocks = self._measure()
        waiting = max(1, math.ceil(self.wait_s / NOTE_CPU_S)) if blocks else 0  # in-process: none
        self.sessions = config.sessions or min(MAX_SESSIONS, 1 + waiting)
        self._open_more(self.sessions - 1)

    @property
    def algorithm(self) -> str:
        return "sha256_ecdsa" if self.kind == "ec" else "rsassa_pkcs1v15"

    def sign(self, data: bytes) -> bytes:
        """The signature; while the HSM is lost the call waits, reconnecting with backoff, for up
        to `patience_s` from the outage's start (an HSM's failover, a network blip cost their
        length, not the notes); past it, each call fails at once until the HSM is back."""
        begun = time.monotonic()  # a signature that fails again after each reconnection gives up too
        while True:
            try:
                self._reconnect_if_due()
                return self._sign_once(data)
            except _Down as e:
                since = self._down_since
                if not since:  # another thread reconnected it meanwhile
                    continue
                wait = min(since, begun) + self.config.patience_s - time.monotonic()
                if wait <= 0:
                    raise SignError(f"HSM unreachable for over {self.config.patience_s:g} s (CN_HSM_PATIENCE_S): "
                                    f"{e}; a rerun signs these notes") from None
                time.sleep(min(wait, max(0.05, self._next_try - time.monotonic())))

    def _sign_once(self, data: bytes) -> bytes:
        try:
            session, key = self._free.get(timeout=self.config.patience_s)
        except queue.Empty:
            raise SignError(f"HSM unreachable: no session free for {self.config.patience_s:g} s") from None
        try:
            raw = key.sign(hashlib.sha256(data).digest(), mechanism=Mechanism.ECDSA) if self.kind == "ec" else \
                key.sign(data, mechanism=Mechanism.SHA256_RSA_PKCS)  # CKM_ECDSA_SHA256 is not in every module
        except PIN_REFUSALS + (p11.UserNotLoggedIn,) as e:
            self._free.put((session, key))
            raise SignError(f"the HSM logged this signer out ({type(e).__name__})") from None
        except p11.PKCS11Error as e:
            log.warning("the HSM is taken as lost: %s from %s", type(e).__name__, self.config.module)
            self._lost()
            raise _Down(f"{type(e).__name__} from {self.config.module}") from None
        self._free.put((session, key))
        return algos.DSASignature.from_p1363(raw).dump() if self.kind == "ec" else raw

    def take_outages(self) -> list[tuple[float, float]]:
        """The outages (epoch seconds, from, to) since last asked, one still going up to now:
        what the run reports it waited on the HSM."""
        with self._lock:
            spans, self._outages = self._outages, []
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
        session, key = self._free.get()
        try:
            found = [x509.load_der_x509_certificate(c[Attribute.VALUE])
                     for c in session.get_objects({Attribute.CLASS: ObjectClass.CERTIFICATE})]
            mine = [c for c in session.get_objects({Attribute.CLASS: ObjectClass.CERTIFICATE, **self._which()})]
        finally:
            self._free.put((session, key))
        if not mine:
            raise SignerSetupError(f"no certificate on the token for the {self.config.names()}: set CN_SIGNER_CERT, "
                                   "or put the CA's certificate on the token beside the key")
        cert = x509.load_der_x509_certificate(mine[0][Attribute.VALUE])
        return cert, [c for c in found if c != cert]

    def close(self) -> None:
        with self._lock:
            self._close_sessions()

    def _which(self) -> dict:
        return {Attribute.LABEL: self.config.key_label} if self.config.key_label else \
            {Attribute.ID: bytes.fromhex(self.config.key_id)}

    def _connect(self) -> None:
        """Find the token, log in once, find the key; each failure one line naming what. A module
        that sees no token at all, or fails before the PIN is judged, is asked again with backoff
        for the HSM's patience: a network HSM's first contact fails now and then when signers
        start together (`p11-kit server` failed 1 of 9 simultaneous first contacts here). A
        token listed under other labels, or a refused PIN, is answered at once."""
        deadline, delay = time.monotonic() + self.config.patience_s, 0.25
        while True:
            try:
                if self.lib is None:
                    self.lib = _load(self.config.module)
                return self._connect_once()
            except _NotReached as e:
                if time.monotonic() + delay > deadline:
                    raise SignerSetupError(f"{e} for {self.config.patience_s:g} s") from None
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
                if self.lib is not None:
                    self.lib.reinitialize()

    def _connect_once(self) -> None:
        try:
            token = self._token_once_more()
        except p11.NoSuchToken:
            labels = sorted(t.label for t in self.lib.get_tokens())
            said = (f"CN_PKCS11_TOKEN: no token labelled {self.config.token!r} in {self.config.module} "
                    f"(it has: {', '.join(labels) or 'none'})")
            raise (SignerSetupError(said) if labels else _NotReached(said + ": the HSM did not answer")) from None
        except p11.PKCS11Error as e:
            raise _NotReached(f"CN_PKCS11_MODULE {self.config.module}: cannot list its tokens "
                              f"({type(e).__name__})") from None
        try:
            session = token.open(user_pin=self.config.pin)
        except p11.UserAlreadyLoggedIn:  # another key of this process logged in to the token: its login is ours
            session = token.open()
        except PIN_REFUSALS as e:
            raise PinRefused(f"the HSM refused the PIN for token {self.config.token!r} ({type(e).__name__}): "
                             "it is not offered again") from None
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
        self._free.put((session, key))

    def _token_once_more(self):
        """The token; the module started again once if it lost its HSM (a process that signed for
        an earlier run: Ray reuses its workers)."""
        try:
            return self.lib.get_token(token_label=self.config.token)
        except (p11.DeviceError, p11.DeviceRemoved, p11.GeneralError, p11.TokenNotPresent):
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
            self._free.put((session, self._find_key(session)))

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

    def _lost(self) -> None:
        with self._lock:
            if not self._down_since:
                self._down_since, self._down_at, self._next_try = time.monotonic(), time.time(), time.monotonic()
                self._close_sessions()

    def _reconnect_if_due(self) -> None:
        """While the HSM is lost, one thread at a time tries to reconnect, with backoff (0.5, 1, 2,
        4, then every 5 s: an HSM back is found within seconds of its return); the others wait."""
        if not self._down_since:
            return
        with self._lock:
            if not self._down_since:
                return
            now = time.monotonic()
            if now < self._next_try:
                raise _Down(f"unreachable since {now - self._down_since:.0f} s ({self.config.module})")
            try:
                self.lib.reinitialize()
                self._connect_once()
                self._open_more(self.sessions - 1)
            except PinRefused:
                raise
            except Exception as e:
                self._close_sessions()
                self._next_try = now + min(RECONNECT_MAX_S, max(0.5, 2 * (now - self._down_since)))
                raise _Down(f"unreachable since {now - self._down_since:.0f} s: {type(e).__name__}") from None
            log.warning("the HSM is back after %.1f s (%s)", now - self._down_since, self.config.module)
            self._outages.append((self._down_at, time.time()))
            self._down_since = 0.0

    def _close_sessions(self) -> None:
        while not self._free.empty():
            self._free.get_nowait()
        for session in self._sessions:
            try:
                session.close()
            except Exception:  # the HSM is gone: its sessions are too
                pass
        self._sessions = []


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


def _load(module: str):
    """The module, started. A library that cannot be opened is said at once; one that opens but
    does not start (C_Initialize: a network module that did not reach its HSM) may be tried again."""
    try:
        ctypes.CDLL(module)
    except OSError as e:
        raise SignerSetupError(f"CN_PKCS11_MODULE {module}: cannot load it ({str(e).split(':')[-1].strip()})") \
            from None
    try:
        return pkcs11.lib(module)
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
