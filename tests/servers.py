"""Real servers for the tests, each a child process on a free loopback port, stopped by PID."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.embedded import EmbeddedError, Service, free_port, wait_for_port

S3_ACCESS_KEY = "cn-test-access"
S3_SECRET_KEY = "cn-test-secret-0123456789"


def start_versitygw(root: Path, nometa: bool = False, keep_alive: bool = False,
                    tls: tuple[Path, Path] | None = None, port: int = 0) -> Service:
    """An S3-compatible server (versitygw, posix backend with metadata: conditional writes work) speaking S3 over
    HTTP; with `nometa`, one that accepts a second If-None-Match PUT of a key, as some S3-compatible stores do;
    with `keep_alive`, one that keeps a connection for the next request, as S3 does (versitygw closes each);
    with `tls` (a certificate and its key), over HTTPS; `port`, one a stopped server had (its `root` again: back
    with its objects)."""
    binary = shutil.which("versitygw", path=str(Path(__file__).resolve().parent.parent / ".venv" / "bin"))
    binary = binary or shutil.which("versitygw")
    if not binary:
        raise EmbeddedError("versitygw not found: run scripts/test.sh, which builds it")
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = (root.parent / "versitygw.log").open("ab")
    process = subprocess.Popen(
        [binary, "--access", S3_ACCESS_KEY, "--secret", S3_SECRET_KEY, "--port", f"127.0.0.1:{port}",
         *(["--keep-alive"] if keep_alive else []), *(["--cert", str(tls[0]), "--key", str(tls[1])] if tls else []),
         "posix", *(["--nometa"] if nometa else []), str(root)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    wait_for_port(port, process, "versitygw", own=True)
    return Service("s3", process, f"{'https' if tls else 'http'}://127.0.0.1:{port}")


def start_secrets_manager(root: Path) -> Service:
    """moto's server: AWS Secrets Manager's JSON protocol over HTTP (what boto3 speaks to AWS)."""
    import sys

    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = (root / "moto.log").open("ab")
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log, stderr=subprocess.STDOUT)
    wait_for_port(port, process, "moto server", own=True)
    return Service("secretsmanager", process, f"http://127.0.0.1:{port}")


def self_signed(directory: Path, stem: str, common_name: str, *extensions) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA bundle) and its key, as STEM.crt and STEM.key;
    `extensions`: (extension, critical) pairs."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
               .not_valid_after(now + dt.timedelta(days=30)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical)
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def make_tls_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed server certificate for 127.0.0.1."""
    import ipaddress

    from cryptography import x509

    return self_signed(directory, "smtp", "127.0.0.1",
                       (x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
                       (x509.BasicConstraints(ca=True, path_length=None), True))


def make_tls_chain(directory: Path) -> tuple[Path, Path, Path]:
    """(CA bundle, certificate, key) of a server at 127.0.0.1 whose certificate a CA of its own
    issued: rustls (obstore's TLS) refuses a self-signed CA certificate as a server's own, as
    make_tls_certificate makes for servers OpenSSL checks."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    ca_path, ca_key_path = self_signed(directory, "ca", "test CA", (x509.BasicConstraints(ca=True, path_length=None), True))
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    key, now = rsa.generate_private_key(public_exponent=65537, key_size=2048), dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


DOVECOT_USER, DOVECOT_PASSWORD = "bounces", "bounce-box-secret"


@dataclass
class FolderService(Service):
    """A server in a folder of its own, made for it in /tmp: stopped, its folder goes too (left, the
    Postfix of one relay test left 1,000 messages there a run)."""

    root: Path

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _started_or_removed(root: Path, start: Callable[[], FolderService]) -> FolderService:
    """A service started in `root`, or, if it does not start, `root` removed before the error goes on."""
    try:
        return start()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def start_dovecot(mail_root: Path | None = None) -> Service:
    """Debian's Dovecot as the bounce domain's IMAP mailbox: a throwaway configuration, one
    user, plain IMAP on a free loopback port. Its mail lives in a folder of its own (Dovecot
    refuses to run mail as root, and a test's tmp_path is closed to other users), or in
    `mail_root` (an MTA's maildirs, one per user, owned by nobody); url is
    imap://bounces:PASSWORD@127.0.0.1:PORT/INBOX."""
    import tempfile

    binary = shutil.which("dovecot") or "/usr/sbin/dovecot"
    if not Path(binary).exists():
        raise EmbeddedError("dovecot not found: run scripts/install.sh (dovecot-imapd)")
    root = Path(tempfile.mkdtemp(prefix="cn-dovecot-"))
    return _started_or_removed(root, lambda: _dovecot(root, binary, mail_root))


def _dovecot(root: Path, binary: str, mail_root: Path | None) -> FolderService:
    import pwd

    root.chmod(0o755)
    nobody = pwd.getpwnam("nobody")
    for sub in ("run", "state", "mail", "home"):
        (root / sub).mkdir()
    for sub in ("mail", "home"):
        os.chown(root / sub, nobody.pw_uid, nobody.pw_gid)
    (root / "users").write_text(f"{DOVECOT_USER}:{{PLAIN}}{DOVECOT_PASSWORD}\n")
    port = free_port()
    (root / "dovecot.conf").write_text(f"""protocols = imap
listen = 127.0.0.1
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
base_dir = {root}/run
state_dir = {root}/state
log_path = {root}/dovecot.log
mail_location = maildir:{mail_root or root / "mail"}/%u
first_valid_uid = 1
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {root}/users
}}
userdb {{
  driver = static
  args = uid={nobody.pw_uid} gid={nobody.pw_gid} home={root}/home/%u
}}
service imap-login {{
  inet_listener imap {{
    address = 127.0.0.1
    port = {port}
  }}
  inet_listener imaps {{
    port = 0
  }}
}}
service pop3-login {{
  inet_listener pop3 {{
    port = 0
  }}
}}
service submission-login {{
  inet_listener submission {{
    port = 0
  }}
}}
""")
    process = subprocess.Popen([binary, "-F", "-c", str(root / "dovecot.conf")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    wait_for_port(port, process, "dovecot", own=True)
    return FolderService("imap", process, f"imap://{DOVECOT_USER}:{DOVECOT_PASSWORD}@127.0.0.1:{port}/INBOX", root)


def start_postfix(mailboxes: dict[str, str], domains: set[str], bounce_domain: str, policy: str = "",
                  milter: str = "") -> Service:
    """Debian's Postfix as the clients' mail server: it takes every message on a free loopback
    port, delivers to the addresses in `mailboxes` (address -> maildir name) and, like a real
    provider after its 250, bounces the rest of `domains` ("5.1.1 unknown user") to the
    envelope sender.
    Mail for `bounce_domain` (the VERP addresses: bounces+TOKEN@...) goes to the maildir
    `bounces/`. Its folders are service.root / "vmail" / NAME. `policy` (HOST:PORT) is asked at
    the end of each message's data (smtpd_end_of_data_restrictions), as a rate-limiting policy
    service is. `milter` (HOST:PORT): a milter each message passes through, as OpenDKIM signs
    (start_opendkim); a milter that does not answer defers the message, never passes it unsigned."""
    import tempfile

    master = Path("/usr/lib/postfix/sbin/master")
    if not master.exists() or not shutil.which("postfix"):
        raise EmbeddedError("postfix not found: run scripts/install.sh")
    root = Path(tempfile.mkdtemp(prefix="cn-postfix-"))
    return _started_or_removed(root, lambda: _postfix(root, master, mailboxes, domains, bounce_domain, policy, milter))


def _postfix(root: Path, master: Path, mailboxes: dict[str, str], domains: set[str], bounce_domain: str, policy: str,
             milter: str) -> FolderService:
    import pwd

    root.chmod(0o755)
    nobody = pwd.getpwnam("nobody")
    etc, port = root / "etc", free_port()
    for sub in ("etc", "spool", "lib", "vmail"):
        (root / sub).mkdir()
    os.chown(root / "lib", pwd.getpwnam("postfix").pw_uid, -1)
    os.chown(root / "vmail", nobody.pw_uid, nobody.pw_gid)
    services = []
    for line in Path("/etc/postfix/master.cf").read_text().splitlines():
        fields = line.split()
        if line.startswith(("#", " ", "\t")) or len(fields) < 8:
            services.append(line)
        elif fields[0] == "smtp" and fields[1] == "inet":
            services.append(f"127.0.0.1:{port} inet n - n - - smtpd")
        else:  # nothing chrooted: the queue is in a folder of the test's
            services.append(" ".join(fields[:4] + ["n"] + fields[5:]))
    (etc / "master.cf").write_text("\n".join(services) + "\n")
    domains = sorted(set(domains) | {bounce_domain})
    (etc / "mailboxes").write_text("".join(f"{a} {box}/\n" for a, box in mailboxes.items()) +
                                   f"bounces@{bounce_domain} bounces/\n")
    (etc / "main.cf").write_text(f"""compatibility_level = 3.6
queue_directory = {root}/spool
data_directory = {root}/lib
mail_owner = postfix
setgid_group = postdrop
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
myhostname = mx.client.example
mydomain = client.example
myorigin = client.example
mydestination =
alias_maps =
alias_database =
virtual_mailbox_domains = {", ".join(domains)}
virtual_mailbox_base = {root}/vmail
virtual_mailbox_maps = texthash:{etc}/mailboxes
virtual_uid_maps = static:{nobody.pw_uid}
virtual_gid_maps = static:{nobody.pw_gid}
virtual_minimum_uid = 1
recipient_delimiter = +
smtpd_reject_unlisted_recipient = no
mynetworks = 127.0.0.0/8
smtpd_relay_restrictions = permit_mynetworks, reject
maillog_file_prefixes = {root}
maillog_file = {root}/maillog
biff = no
smtputf8_enable = no
""" + (f"smtpd_end_of_data_restrictions = check_policy_service inet:{policy}\n" if policy else "")
      + (f"smtpd_milters = inet:{milter}\nmilter_default_action = tempfail\n" if milter else ""))
    subprocess.run(["postfix", "-c", str(etc), "check"], check=True)  # makes the queue's folders
    process = subprocess.Popen([str(master), "-c", str(etc), "-d"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_for_port(port, process, "postfix", own=True)
    return FolderService("smtp", process, f"smtp://127.0.0.1:{port}", root)


def start_opendkim(root: Path, key: Path, selector: str, domain: str) -> Service:
    """Debian's OpenDKIM as a signing milter on a free loopback port (Postfix's `smtpd_milters`):
    the relay that signs when the mailers do not (CN_DKIM_* unset), relaxed/relaxed as they would."""
    binary = shutil.which("opendkim", path="/usr/sbin:/usr/bin")
    if not binary:
        raise EmbeddedError("opendkim not found: run scripts/install.sh")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (root / "opendkim.conf").write_text(f"""Syslog no
Mode s
Domain {domain}
Selector {selector}
KeyFile {key}
Canonicalization relaxed/relaxed
SignatureAlgorithm rsa-sha256
InternalHosts 127.0.0.1
RequireSafeKeys false
Socket inet:{port}@127.0.0.1
PidFile {root}/opendkim.pid
""")
    process = subprocess.Popen([binary, "-f", "-x", str(root / "opendkim.conf")], stdout=subprocess.DEVNULL,
                               stderr=(root / "opendkim.log").open("ab"))
    wait_for_port(port, process, "opendkim", own=True)
    return Service("milter", process, f"127.0.0.1:{port}")


def start_tsa(directory: Path, faults: dict[str, str | bytes] | None = None):
    """An RFC 3161 time-stamping authority on a free loopback port: `openssl ts -reply` (OpenSSL's
    own TSA) behind a small HTTP handler, with a TSA certificate of its own. Returns (url, the
    TSA's certificate, a function that stops it). While `faults["answer"]` says so, it answers
    as a TSA that cannot serve: "refuse", an RFC 3161 reply of status rejection (a TSA over its
    quota, or its signing key unavailable); "garbage", a 200 whose body is no reply at all (64
    random bytes); "garbage in a sequence", the same behind a DER SEQUENCE's header, which
    asn1crypto takes for a reply until its fields are read; "unauthorised", HTTP 401 (a TSA that
    takes no credentials it was given); bytes, those bytes. `faults["authorization"]` is the last
    request's Authorization header (a TSA's account, from the URL's user and password)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    self_signed(directory, "tsa", "Test Time-Stamping Authority",
                (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.TIME_STAMPING]), True))
    (directory / "serial").write_text("01\n")
    config = directory / "tsa.cnf"
    config.write_text(f"""[ tsa ]
default_tsa = test_tsa
[ test_tsa ]
dir = {directory}
serial = $dir/serial
crypto_device = builtin
signer_cert = $dir/tsa.crt
signer_key = $dir/tsa.key
signer_digest = sha256
default_policy = 1.2.3.4.1
digests = sha256
accuracy = secs:1
ordering = yes
tsa_name = yes
ess_cert_id_chain = no
ess_cert_id_alg = sha256
""")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            query = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            fault = (faults or {}).get("answer")
            if faults is not None:
                faults["authorization"] = self.headers.get("Authorization", "")
            if fault == "unauthorised":
                return self._reply(401, b"")
            if isinstance(fault, bytes):  # a reply of the test's own making
                return self._reply(200, fault)
            if fault:
                return self._reply(200, {"refuse": _tsa_refusal, "garbage": lambda: os.urandom(64),
                                         "garbage in a sequence": lambda: b"\x30\x3e" + os.urandom(62)}[fault]())
            with lock:  # one serial file
                (directory / "query.tsq").write_bytes(query)
                done = subprocess.run(["openssl", "ts", "-reply", "-config", str(config), "-queryfile",
                                       str(directory / "query.tsq"), "-out", str(directory / "reply.tsr")],
                                      capture_output=True)
                reply = (directory / "reply.tsr").read_bytes() if done.returncode == 0 else b""
            self._reply(200 if reply else 500, reply)

        def _reply(self, status: int, reply: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/timestamp-reply")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_address[1]}/", directory / "tsa.crt", stop


def _tsa_refusal() -> bytes:
    """A TimeStampResp refusing the request (PKIStatus rejection, no token), as RFC 3161 has a TSA
    say no. Its SEQUENCE made here: asn1crypto's TimeStampResp will not leave out the token."""
    from asn1crypto import tsp

    status = tsp.PKIStatusInfo({"status": "rejection", "status_string": ["the time-stamping service is unavailable"],
                                "fail_info": {"system_failure"}}).dump()
    return b"\x30" + bytes([len(status)]) + status


class RatePolicy:
    """A Postfix policy service (the SMTPD policy delegation protocol) that lets `rate` messages
    a second through, with a bucket of one second's worth, and `daily` (0: any number) in all,
    and answers above them as Amazon SES does: what policyd-rate-limit and postfwd do for a
    mail administrator."""

    def __init__(self, rate: float, daily: int = 0):
        import socketserver
        import threading

        self.rate, self.daily, self.tokens, self.filled = rate, daily, rate, time.monotonic()
        self.accepted = self.throttled = 0
        self.lock = threading.Lock()
        policy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                while True:
                    request = {}
                    for raw in self.rfile:
                        line = raw.decode().strip()
                        if not line:
                            break
                        key, _, value = line.partition("=")
                        request[key] = value
                    else:
                        return
                    self.wfile.write(f"action={policy.decide(request)}\n\n".encode())

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def decide(self, request: dict) -> str:
        with self.lock:
            if self.daily and self.accepted >= self.daily:
                return "454 4.7.0 Throttling failure: Daily message quota exceeded."
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.filled) * self.rate)
            self.filled = now
            if self.tokens < 1:
                self.throttled += 1
                return "454 4.7.0 Throttling failure: Maximum sending rate exceeded."
            self.tokens -= 1
            self.accepted += 1
            return "dunno"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_p11kit_server(socket_path: Path, provider: str, token_label: str,
                        softhsm_conf: Path | None = None, env: dict[str, str] | None = None) -> "HsmService":
    """p11-kit server: the token behind a socket, as a network HSM is behind its client module
    (p11-kit-client.so, with P11_KIT_SERVER_ADDRESS=unix:path=SOCKET). Needs SOFTHSM2_CONF, or
    `softhsm_conf`: the HSM's own configuration (the mechanisms it offers, say); `env`, more of
    the server's environment."""
    socket_path.unlink(missing_ok=True)
    env = {**os.environ, **({"SOFTHSM2_CONF": str(softhsm_conf)} if softhsm_conf else {}), **(env or {})}
    process = subprocess.Popen(["p11-kit", "server", "-f", "-n", str(socket_path), "--provider", provider,
                                f"pkcs11:token={token_label}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True, env=env)  # a connection is served by a child: the group is the HSM
    deadline = time.monotonic() + 20
    while not socket_path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"p11-kit server did not start: {process.stderr.read().decode()[-500:]}")
        time.sleep(0.05)
    return HsmService("p11-kit server", process, f"unix:path={socket_path}")


class HsmService(Service):
    def kill(self) -> None:
        """The HSM gone at once: the server and the children serving each connection."""
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def stop(self) -> None:
        self.kill()


class DelayingProxy:
    """A socket in front of another that passes what it reads on `delay_s` after it read it, in
    order, as a network's latency does: requests in flight together are each delayed once, not
    one after another (p11-kit's client sends every session's calls on one connection, several
    at once). A network HSM's round trip, on one machine; replies pass at once. The first
    `drop_first` connections are closed unanswered: an HSM that misses a first contact. `target`
    a (host, port): a TCP port of its own on loopback (`url`), S3's round trip in front of an S3
    server, at a fraction of an HTTP proxy's CPU (none of it parsed)."""

    def __init__(self, listen: Path | None, target: Path | tuple[str, int], delay_s: float, drop_first: int = 0):
        import socket as sk
        import threading

        self.listen, self.target, self.delay_s, self.drop_first = listen, target, delay_s, drop_first
        self.family = sk.AF_INET if isinstance(target, tuple) else sk.AF_UNIX
        self.server = sk.socket(self.family, sk.SOCK_STREAM)
        if self.family == sk.AF_INET:
            self.server.bind(("127.0.0.1", 0))
        else:
            listen.unlink(missing_ok=True)
            self.server.bind(str(listen))
        self.server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"unix:path={self.listen}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def _accept(self) -> None:
        import socket as sk
        import threading

        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.drop_first:
                self.drop_first -= 1
                client.close()
                continue
            upstream = sk.socket(self.family, sk.SOCK_STREAM)
            try:
                upstream.connect(self.target if self.family == sk.AF_INET else str(self.target))
            except OSError:  # the server is down: this connection refused, as across a network; the link stays
                for s in (client, upstream):
                    s.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src, dst, delayed: bool) -> None:
        """What src sends, to dst: each chunk `delay_s` after it was read, if `delayed`, by a
        thread of its own, so that the chunks behind it are read (and their delay begins) meanwhile."""
        import contextlib
        import queue
        import socket as sk
        import threading

        due: queue.SimpleQueue = queue.SimpleQueue()

        def send() -> None:
            try:
                while (chunk := due.get()) is not None:
                    time.sleep(max(0.0, chunk[0] - time.monotonic()))
                    dst.sendall(chunk[1])
            except OSError:
                pass
            finally:
                for s in (src, dst):  # shut down first: a thread in recv() on it returns, each peer reads its end
                    with contextlib.suppress(OSError):
                        s.shutdown(sk.SHUT_RDWR)
                    with contextlib.suppress(OSError):
                        s.close()

        if delayed:
            threading.Thread(target=send, daemon=True).start()
        try:
            while data := src.recv(65536):
                if delayed:
                    due.put((time.monotonic() + self.delay_s, data))
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            due.put(None)
            if not delayed:
                send()  # nothing queued: it closes both ends

    def stop(self) -> None:
        self.server.close()
        if self.listen:
            self.listen.unlink(missing_ok=True)


def delaying_link(url: str, delay_s: float) -> DelayingProxy:
    """A DelayingProxy in front of the TCP server at `url` (an S3 server's): its own `url` to use."""
    from urllib.parse import urlsplit

    target = urlsplit(url)
    return DelayingProxy(None, (target.hostname, target.port), delay_s)


INTERNAL_ERROR = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"


class S3Between:
    """An HTTP proxy in front of the S3 server, passing each request on as it came (its Host
    header too: the signature covers it), that can answer the first `throttle` requests with 503
    SlowDown, flip a byte of each object it passes, either way, or pass the first `lose` PUTs on
    and close the connection instead of replying. `faults` fails the PUTs of chosen keys (by how
    the key ends): "refuse" answers each with 500 InternalError and passes none on (the store's
    retries meet it every time, until the test takes the fault away); "lose" passes the first on
    and closes the connection instead of its reply; "refuse gets" answers the key's GETs, not its
    PUTs, with 500 InternalError. `delay_s` holds each request that long before passing it on (a
    region's round trip to S3); `most_puts` is the most PUTs it held at once. `passed(key)` is called once a PUT of `key`
    was stored and answered: a test's moment to fail another dependency there; `arriving(key,
    body)` before a PUT is passed on: another writer's moment to get there first. `put_keys`
    lists the key of every PUT that reached the server, in order."""

    def __init__(self, upstream: str, throttle: int = 0, corrupt: bool = False, lose: int = 0,
                 faults: dict[str, str] | None = None, passed=None, arriving=None, timed_out: int = 0,
                 delay_s: float = 0.0):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import unquote, urlsplit

        self.upstream, self.throttle, self.corrupt, self.requests = urlsplit(upstream), throttle, corrupt, 0
        self.lose, self.puts, self.faults, self.passed, self.put_keys = lose, 0, faults or {}, passed, []
        self.arriving, self.timed_out = arriving, timed_out  # timed_out: the first PUTs answered 400 RequestTimeout
        self.delay_s, self.puts_now, self.most_puts, counting = delay_s, 0, 0, threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if proxy.fault(self._key()) == "refuse gets":
                    return self._answer(500, {"Content-Type": "application/xml"}, INTERNAL_ERROR)
                self._pass_on(b"")

            def do_HEAD(self):
                self._pass_on(b"")

            def do_DELETE(self):
                self._pass_on(b"")

            def do_PUT(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                fault = proxy.fault(self._key())
                if proxy.timed_out > 0:  # S3's answer to an upload that stalled: nothing stored, send it again
                    proxy.timed_out -= 1
                    error = b"<Error><Code>RequestTimeout</Code><Message>Your socket connection to the server was not read from or written to within the timeout period.</Message></Error>"
                    return self._answer(400, {"Content-Type": "application/xml"}, error)
                if fault == "refuse":
                    return self._answer(500, {"Content-Type": "application/xml"}, INTERNAL_ERROR)
                if proxy.arriving:
                    proxy.arriving(self._key(), body)
                with counting:
                    proxy.puts_now += 1
                    proxy.most_puts = max(proxy.most_puts, proxy.puts_now)
                try:
                    self._pass_on(bytes([body[0] ^ 1]) + body[1:] if proxy.corrupt else body, lost=fault == "lose")
                finally:
                    with counting:
                        proxy.puts_now -= 1

            def _key(self) -> str:
                return unquote(urlsplit(self.path).path).split("/", 2)[-1]

            def _pass_on(self, sent: bytes, lost: bool = False):
                with counting:  # PUTs arrive together (a signer's archive writes): "the first N" stay N
                    proxy.requests += 1
                    throttled = proxy.requests <= proxy.throttle
                time.sleep(proxy.delay_s)
                if throttled:
                    body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    return self._answer(503, {"Content-Type": "application/xml"}, body)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                conn.request(self.command, self.path, body=sent or None, headers=dict(self.headers.items()))
                reply = conn.getresponse()
                body = reply.read()
                if proxy.corrupt and reply.status == 200 and self.command == "GET":
                    body = bytes([body[0] ^ 1]) + body[1:]
                if self.command == "PUT":
                    with counting:
                        proxy.puts += 1
                        proxy.put_keys.append(self._key())
                        lost = lost or proxy.puts <= proxy.lose
                    if lost:
                        self.close_connection = True
                        return
                headers = {k: v for k, v in reply.getheaders() if k.lower() != "connection"}
                self._answer(reply.status, headers, body)
                if self.command == "PUT" and reply.status == 200 and proxy.passed:
                    proxy.passed(self._key())

            def _answer(self, status, headers, body):
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() != "content-length":
                        self.send_header(k, v)
                # a HEAD's reply says the object's length, and has no body
                length = next((v for k, v in headers.items() if k.lower() == "content-length"), str(len(body)))
                self.send_header("Content-Length", length if self.command == "HEAD" else str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def fault(self, key: str) -> str:
        """The fault a PUT of `key` meets: a "lose" once, a "refuse" until taken away."""
        for ending, fault in list(self.faults.items()):
            if key.endswith(ending):
                if fault == "lose":
                    del self.faults[ending]
                return fault
        return ""

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
