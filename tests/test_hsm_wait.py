"""A day waits out its HSM (issue 69): an outage longer than CN_HSM_PATIENCE_S holds the day
until the run's deadline (the page says what it waits for, the driver's log says it once), a
refusal that is the same on every try fails at once with the mechanism and the return value
named, and the library is started again only when no signature is in flight. The HSM is the
real `p11-kit server` serving the session's SoftHSM token, killed and started again."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline import api
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.seal.token import P11_KIT_CLIENT, SOFTHSM, STRANDED_S
from pipeline.settings import ROOT as PROJECT
from tests import servers
from tests.conftest import HSM_SOCKET, TRADE_DATE
from tests.helpers import outbox_messages
from tests.test_hsm import network_hsm, on_token  # noqa: F401 (a fixture, used by name)


@pytest.mark.waits
def test_an_hsm_outage_past_its_patience_holds_the_day_until_its_deadline(
        ray_session, settings, hsm, network_hsm, smtp_sink, tmp_path, session_dir, caplog):  # noqa: F811
    """CN_HSM_PATIENCE_S of 5 s, the HSM's server and its connections killed for 15 s once 15
    notes are mailed, the run's deadline four minutes off: nothing fails, each account is
    mailed once, the live page says "waiting for the HSM since ..." meanwhile and the driver's
    log says it once. Before, every note that reached the signer 5 s into the outage failed
    ("HSM unreachable for over 5 s"), whatever time the day had left."""
    day, accounts = tmp_path / "day", 120
    write_dumps(day, SynthOptions(dt.date.fromisoformat(TRADE_DATE), accounts, seed=69))
    s = on_token(settings, hsm, module=P11_KIT_CLIENT, shard_size=10, window=4, hsm_patience_s=5.0,
                 deadline_at=time.time() + 240)
    run_id = f"hsm-wait-{os.urandom(3).hex()}"
    state, back, seen = RunState(s.redis_url, run_id), [], {"page": []}

    def outage() -> None:
        until = time.monotonic() + 300
        while time.monotonic() < until and int(state.counts().get("delivered", 0) or 0) < 15:
            time.sleep(0.05)
        network_hsm.kill()
        seen["from"] = time.time()
        while time.time() - seen["from"] < 15:
            time.sleep(0.5)
            seen["page"] += api.summary(state, api.Seals(lambda run: open_store(s.store_url)))["waiting"]
        back.append(servers.start_p11kit_server(session_dir / "hsm" / HSM_SOCKET, SOFTHSM, hsm.label))
        seen["to"] = time.time()

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    caplog.set_level(logging.WARNING, logger="pipeline.cluster.driver")
    try:
        summary = run_day(s, RunRequest(TRADE_DATE, str(day), run_id))
        thread.join(60)
    finally:
        for server in back:
            server.stop()
    assert seen.get("to"), "the HSM was killed and brought back mid-run"
    assert summary["failed"] == 0 and summary["unconfirmed"] == 0, summary
    assert summary["delivered"] + summary["physical"] == accounts, summary
    assert summary["waited_s"].get("hsm", 0) >= 10, summary["waited_s"]
    assert any(w.startswith("waiting for the HSM since") for w in seen["page"]), seen["page"]
    told = [r.getMessage() for r in caplog.records if "waiting for the HSM since" in r.getMessage()]
    assert len(told) == 1 and "the run's deadline" in told[0], told
    to = [m["To"] for m in outbox_messages(smtp_sink.outbox)]
    assert len(to) == len(set(to)) == summary["delivered"], "every account mailed once"


OPEN_KEY = """
import sys
from pipeline.seal.token import TokenConfig, TokenKey
TokenKey(TokenConfig(sys.argv[1], sys.argv[2], sys.argv[3], pin=sys.stdin.read(), patience_s=20))
"""


@pytest.mark.parametrize("through", ["softhsm", "p11-kit"])
def test_a_mechanism_the_hsm_refuses_fails_in_seconds_named_not_after_the_patience(through, hsm, tmp_path):
    """The HSM configured to offer raw RSA and ECDSA only (SoftHSM's slots.mechanisms): the
    key's CKM_SHA256_RSA_PKCS is refused, the same on every try. Before, the refusal was taken
    for a lost HSM: re-initialise and log in again, for the whole patience (20 s here, 120 s
    by default), then "HSM unreachable"."""
    conf = tmp_path / "softhsm2.conf"
    conf.write_text(hsm.conf.read_text() + "slots.mechanisms = CKM_RSA_PKCS,CKM_ECDSA\n")
    env, server, module = {**os.environ, "SOFTHSM2_CONF": str(conf)}, None, SOFTHSM
    if through == "p11-kit":  # the restriction is the server's; the client's own configuration is the session's
        server = servers.start_p11kit_server(tmp_path / "p11.sock", SOFTHSM, hsm.label, softhsm_conf=conf)
        env, module = {**os.environ, "P11_KIT_SERVER_ADDRESS": server.url}, P11_KIT_CLIENT
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", OPEN_KEY, module, hsm.label, hsm.key_label],
                              input=hsm.pin_file.read_text(), capture_output=True, text=True, timeout=120,
                              cwd=PROJECT, env=env)
    finally:
        if server:
            server.stop()
    took, said = time.monotonic() - started, (done.stderr.strip().splitlines() or [""])[-1]
    assert done.returncode != 0 and "SignerSetupError" in said, done.stderr[-1500:]
    assert "CKM_SHA256_RSA_PKCS" in said and "CKR_MECHANISM_INVALID" in said, said
    assert took < 10, f"{took:.1f} s: waited out as if the HSM were lost"


SIGN_THROUGH_RESTARTS = """
import json, sys, threading, time
import pkcs11
from pkcs11 import _pkcs11, types

native_lib = _pkcs11.lib  # python-pkcs11's object for an instance of a module (pkcs11.lib keeps one a path)
count = threading.Lock()
seen = {"inside": 0, "overlaps": 0, "reinits": 0, "signed": 0, "libraries": 0}
libraries = {}  # a token's id: the instance of the library it came from
hold = float(sys.argv[5] or 0.3)
way = sys.argv[6]  # "sign": the caller's thread hands the call to one of the key's; "signing": futures, as a signer's
stranded_s = float(sys.argv[7])  # calls in the library this long are given up on

def counted(sign):  # a way into the library's C_Sign, with the signatures inside it counted
    def inside(key, *args, **kwargs):
        lib = libraries[id(key.session.token)]
        with count:
            seen["inside"] += 1
            lib.inside += 1
        try:
            time.sleep(hold)  # a slow HSM's round trip: the signatures spend their time inside the library
            return sign(key, *args, **kwargs)
        finally:
            with count:
                seen["inside"] -= 1
                lib.inside -= 1
    return inside

class Lib:  # an instance of the module, its C_Finalize + C_Initialize counted against the signatures inside it
    def __init__(self, path):
        self.lib, self.inside = native_lib(path), 0
        seen["libraries"] += 1
    def reinitialize(self):
        with count:
            seen["reinits"] += 1
            seen["overlaps"] += self.inside > 0
        return self.lib.reinitialize()
    def get_token(self, **kwargs):
        token = self.lib.get_token(**kwargs)
        libraries[id(token)] = self
        return token
    def __getattr__(self, name):
        return getattr(self.lib, name)

types.SignMixin.sign, _pkcs11.lib = counted(types.SignMixin.sign), Lib
from pipeline.seal import token
from pipeline.seal.token import TokenConfig, TokenKey
token._two_calls = counted(token._two_calls)  # ours: C_SignInit and C_Sign, beside python-pkcs11's
module, label, key_label = sys.argv[1:4]
pin = sys.stdin.readline().strip()
key = TokenKey(TokenConfig(module, label, key_label, pin=pin, sessions=8, patience_s=60, stranded_s=stranded_s))
stop, errors, told = time.monotonic() + float(sys.argv[4]), [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), told.set()), daemon=True).start()  # "stop", or the bound

def signing(nth):
    time.sleep(nth * 0.04)  # staggered: a signature is always about to end while the others are inside
    while time.monotonic() < stop and not told.is_set():
        try:
            if way == "signing":  # two at a time: the key's workers have a queue, as a signer's notes make one
                futures = [key.signing(b"contract-notes: a note") for _ in range(2)]
                [f.result() for f in futures]
            else:
                key.sign(b"contract-notes: a note")
            with count:
                seen["signed"] += 1
        except Exception as e:
            errors.append(repr(e))

threads = [threading.Thread(target=signing, args=(n,)) for n in range(8)]
for t in threads:
    t.start()
print("signing", flush=True)
for t in threads:
    t.join()
second = TokenKey(TokenConfig(module, label, key_label, pin=pin, sessions=2, patience_s=60))  # made after: the same module
second.sign(b"contract-notes: a second key's note")
seen["second_key"] = 1
print(json.dumps({**seen, "errors": errors[:3], "gate_overlaps": key.gate.overlaps}), flush=True)
"""


class Said:
    """A SIGN_THROUGH_RESTARTS signer, its stderr read as it comes: how many times it said the
    HSM is back."""

    def __init__(self, signer: subprocess.Popen):
        self.signer, self.lines = signer, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    @classmethod
    def signing(cls, hsm, server_url: str, hold_s: float | None = None, way: str = "sign",
                stranded_s: float = STRANDED_S) -> "Said":
        """Started through the server at `server_url`, once its threads sign; `hold_s`: how long
        each signature stays inside C_Sign (its default, unless given); `way`: each thread's
        signature by TokenKey.sign, or by TokenKey.signing, as a signer of several at once."""
        hold = "" if hold_s is None else str(hold_s)
        signer = subprocess.Popen([sys.executable, "-c", SIGN_THROUGH_RESTARTS, P11_KIT_CLIENT, hsm.label,
                                   hsm.key_label, "300", hold, way, str(stranded_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=PROJECT,
                                  env={**os.environ, "P11_KIT_SERVER_ADDRESS": server_url})
        try:
            signer.stdin.write(hsm.pin_file.read_text() + "\n")
            signer.stdin.flush()
            assert signer.stdout.readline().strip() == "signing", signer.stderr.read()[-1500:]
        except BaseException:
            signer.kill()
            raise
        return cls(signer)

    def __enter__(self) -> "Said":
        return self

    def __exit__(self, *exc) -> None:
        self.signer.kill()
        self.signer.wait()
        self.reader.join(10)  # at the end of stderr, now the signer is gone
        for pipe in (self.signer.stdin, self.signer.stdout, self.signer.stderr):
            pipe.close()

    def _read(self) -> None:
        for line in self.signer.stderr:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def back(self, times: int, within: float = 90) -> None:
        until = time.monotonic() + within
        while sum("the HSM is back" in line for line in self.lines) < times:
            assert self.signer.poll() is None and time.monotonic() < until, \
                f"the signer was not back {times} time(s): {self.text()[-1500:]}"
            time.sleep(0.05)

    def stop(self) -> tuple[str, str]:
        """The signer told to stop; its output and its stderr once it ended."""
        self.signer.stdin.write("stop\n")
        self.signer.stdin.flush()
        self.signer.wait(timeout=120)
        self.reader.join(10)
        return self.signer.stdout.read(), self.text()


@pytest.mark.parametrize("way", ["sign", "signing"])
def test_the_library_is_started_again_only_when_no_signature_is_in_flight(way, hsm, tmp_path):
    """Eight threads sign through `p11-kit server` while it is killed and started again three
    times: each loss is a reconnection (C_Finalize, C_Initialize, login), and none of them runs
    while a thread is inside the library's C_Sign (counted by wrapping python-pkcs11's entry
    point and ours, token._two_calls). Before, the thread that reconnected re-initialised the
    library under the others' signatures. The next kill waits for the signer to be back (a
    loaded machine's reconnection can take longer than the second between kills), and the
    signer signs until told to stop, not for a fixed time."""
    sock = tmp_path / "p11.sock"
    server = servers.start_p11kit_server(sock, SOFTHSM, hsm.label)
    try:
        with Said.signing(hsm, server.url, way=way) as said:
            for times in range(1, 4):  # the HSM lost and back, mid-signature
                time.sleep(1.0)
                server.kill()
                time.sleep(0.3)
                server = servers.start_p11kit_server(sock, SOFTHSM, hsm.label)
                said.back(times)
            time.sleep(1.0)  # signatures through the last start
            out, err = said.stop()
    finally:
        server.stop()
    seen = _signed_cleanly(said, out, err)
    reconnections = seen["reinits"] + seen["libraries"] - 1  # a fresh instance of the module is one too
    assert reconnections >= 3, seen


def _signed_cleanly(said, out: str, err: str) -> dict:
    """What the signer saw, once it ended: it signed, with no error, no instance of the module
    was started again under a signature inside it, and a key of the same module made after
    signed too (after a stranding, through the fresh instance, not the abandoned one)."""
    assert said.signer.returncode == 0, err[-1500:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["signed"] > 0 and seen["errors"] == [] and seen["second_key"] == 1, seen
    assert seen["overlaps"] == 0 and seen["gate_overlaps"] == 0, seen
    return seen


CUT_SHORT = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

/* Once the file $CUT_SHORT exists, the server's next reply header (a 12-byte write to a socket)
   with another request already waiting on that socket is sent, and the server's process group
   killed before the reply's body: the other request's caller waits on the socket. */
ssize_t write(int fd, const void *buf, size_t len) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    ssize_t n = real(fd, buf, len);
    const char *trigger = getenv("CUT_SHORT");
    struct stat st;
    int waiting = 0;
    if (trigger && len == 12 && n == 12 && fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)
        && ioctl(fd, FIONREAD, &waiting) == 0 && waiting > 0 && unlink(trigger) == 0)
        kill(0, SIGKILL);
    return n;
}
"""


@pytest.mark.parametrize("way", ["sign", "signing"])
def test_a_server_dying_mid_reply_strands_no_signature(way, hsm, tmp_path):
    """Eight threads sign through `p11-kit server` with no pause between signatures, and the
    server dies between a reply's header and its body, another request waiting (its own
    `write`, preloaded, kills it there: a loaded machine's SIGKILL landing between the two
    writes; with no other request waiting, nothing is stranded). p11-kit's client then
    never returns the calls waiting on that socket (the reply's number stays claimed, and no
    one is woken). Every signature still ends, through a fresh instance of the module (a
    python-pkcs11 object of its own: `pkcs11.lib` gave back the one it keeps for the path, the
    stranded calls' own, which the next reconnection then started again under them), with no
    error, and no instance is started again under a signature inside it. Before, the
    reconnection waited for those calls for good: the signer hung ("the HSM is taken as lost",
    never "back"). Through `signing`, as a signer of several notes at once signs, the calls
    stranded are on the key's workers, with no caller's thread to give up on them: their
    signatures are made again on fresh workers (TokenKey._redrive), or they never end."""
    shim, trigger, sock = tmp_path / "cut_short.so", tmp_path / "cut-short-now", tmp_path / "p11.sock"
    (tmp_path / "cut_short.c").write_text(CUT_SHORT)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "cut_short.c"), "-ldl"], check=True)
    for _ in range(3):  # on a loaded machine the waiting caller may not be waiting on the socket yet: not stranded
        server = servers.start_p11kit_server(sock, SOFTHSM, hsm.label, env={"LD_PRELOAD": str(shim),
                                                                            "CUT_SHORT": str(trigger)})
        try:
            with Said.signing(hsm, server.url, hold_s=0, way=way) as said:
                time.sleep(1.0)
                trigger.touch()  # the next reply is cut short
                server.process.wait(timeout=30)
                assert not trigger.exists(), "the server died mid-reply"
                time.sleep(0.3)
                server = servers.start_p11kit_server(sock, SOFTHSM, hsm.label)
                said.back(1)
                time.sleep(1.0)  # signatures through the fresh instance
                out, err = said.stop()
        finally:
            server.stop()
        seen = _signed_cleanly(said, out, err)
        if "started afresh" in err:
            break
    assert "started afresh" in err and seen["libraries"] == 2, (seen, err[-1500:])
    assert way == "sign" or "made again on fresh workers" in err, err[-1500:]  # not only through `sign`


@pytest.mark.parametrize("way", ["sign", "signing"])
def test_an_hsm_gone_silent_is_given_up_on_and_its_signatures_made_through_a_fresh_connection(way, hsm, tmp_path):
    """Eight threads sign through `p11-kit server`, which then stops answering with no error
    said (SIGSTOP: its connections open, nothing read or written, as a network that drops
    every packet or a server hung), and a server starts at the same address (the HSM's
    failover). Past `stranded_s` with no answer, the calls inside the library are given up on
    as stranded: the HSM is taken as lost, their signatures are made again, and a fresh
    instance of the module reaches the new server. Before, nothing was ever said, so nothing
    gave up: every session held by a silent call, the signer waited for good ("the HSM is
    taken as lost" never said, nor "back")."""
    sock = tmp_path / "p11.sock"
    server = silent = servers.start_p11kit_server(sock, SOFTHSM, hsm.label)
    try:
        with Said.signing(hsm, server.url, way=way, stranded_s=4) as said:
            time.sleep(1.0)
            os.killpg(silent.process.pid, signal.SIGSTOP)  # the server and each connection's child
            server = servers.start_p11kit_server(sock, SOFTHSM, hsm.label)  # the path now names the new one
            said.back(1, within=60)
            time.sleep(1.0)  # signatures through the fresh instance
            out, err = said.stop()
    finally:
        silent.kill()
        server.stop()
    seen = _signed_cleanly(said, out, err)
    assert "no answer" in err and "started afresh" in err and seen["libraries"] == 2, (seen, err[-1500:])
    assert way == "sign" or "made again on fresh workers" in err, err[-1500:]
