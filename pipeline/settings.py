"""Every setting the job reads, from environment variables, in one place.

Defaults run on one machine with nothing configured; a cluster run overrides them
with environment variables (12-factor), so every entry point (driver, actors, API,
notebook) sees the same configuration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import time
from dataclasses import dataclass, field
from email.utils import parseaddr
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from pipeline.errors import CannotRun

ROOT = str(Path(__file__).resolve().parent.parent)  # the repository: a str, it goes into PYTHONPATH and cwd
TEMPLATES = Path(ROOT) / "templates"  # the note's Typst template, broker.json, the e-mail texts
DEFAULT_KEY_DIR = Path(".keys")
PLACEHOLDER_OWNER_PASSWORD = "change-me-broker-owner-secret"  # public: in this repository
SELECTOR = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")
HOSTNAME = re.compile(r"(?=.{1,253}\Z)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z][A-Za-z0-9-]{0,62}\Z")


def cache_dir() -> Path:
    """Where a machine keeps what it builds once for the job (the C functions, the lean fonts)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contract-notes"


@dataclass(frozen=True)
class SmtpTarget:
    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    implicit_tls: bool = False
    rate: float = 0.0  # messages a second the relay takes from the whole cluster (?rate=); 0: no limit
    daily: int = 0  # messages a day (?daily=); 0: none known (the relay's quota reply still stops it)

    @property
    def name(self) -> str:
        """The relay's name in Redis, the metrics and the report: shared by every run on that Redis."""
        return f"{self.host}:{self.port}"

    def url(self) -> str:
        """Without credentials: what a run records, and what a rerun pins."""
        query = urlencode({k: str(int(v)) if v == int(v) else repr(v) for k, v in (("rate", self.rate), ("daily", self.daily)) if v})
        return f"{'smtps' if self.implicit_tls else 'smtp'}://{self.host}:{self.port}" + (f"?{query}" if query else "")


def gives_up_at(since: float, patience_s: float, deadline_at: float) -> float:
    """When a dependency lost at `since` stops being waited for: its patience is the floor (a
    blip is waited out even past the deadline, or with none), the run's deadline the reach (an
    outage of any length before it holds the day rather than failing accounts that one rerun
    would then have to send). Seconds since the epoch, both; a `deadline_at` of 0 is none."""
    return max(since + patience_s, deadline_at)


def waited_past(since: float, patience_s: float, deadline_at: float, patience: str) -> str:
    """Which of the two an outage that began at `since` was waited past: "the run's deadline
    08:05:00 UTC", or the setting named `patience` ("CN_REDIS_PATIENCE_S (30 s)")."""
    return f"the run's deadline {clock(deadline_at)}" if deadline_at > since + patience_s \
        else f"{patience} ({patience_s:g} s)"


def clock(epoch_s: float) -> str:
    """HH:MM:SS UTC: how an outage's start and the run's deadline are said, to compare at a glance."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(epoch_s))


def setting(env: str, default, what: str, low: float | None = None, high: float | None = None,
            secret: bool = False):
    """One setting, declared once: its environment variable, default, range and meaning (the
    docs' settings table is made from these, tests/test_docs.py). `secret`: kept out of repr."""
    return field(default=default, repr=not secret, metadata={"env": env, "range": (low, high), "what": what})


@dataclass(frozen=True)
class Settings:
    store_url: str = setting("CN_STORE", "store", "a folder or s3://bucket[/prefix]: where the run's record is kept")
    redis_url: str = setting("REDIS_URL", "redis://127.0.0.1:6379/0", "the run's live state", secret=True)
    smtp_url: str = setting("SMTP_URL", "smtp://127.0.0.1:1025", "relays, comma-separated: "
                            "smtp[s]://[user:pass@]host:port[?rate=R&daily=N]", secret=True)
    shard_size: int = setting("CN_SHARD_SIZE", 100, "accounts a shard", 1, 100_000)
    window: int = setting("CN_WINDOW", 0, "shards in flight; 0: two per render CPU of the cluster, at least 6",
                          0, 100_000)
    signers: int = setting("CN_SIGNERS", 0, "signer actors; 0: one per `signer` slot of the cluster", 0, 10_000)
    mailers: int = setting("CN_MAILERS", 0, "mailer actors; 0: one per `smtp` slot", 0, 10_000)
    smtp_connections: int = setting("CN_SMTP_CONNECTIONS", 4, "connections per relay, per mailer", 1, 1000)
    smtp_idle_s: float = setting("CN_SMTP_IDLE_S", 30.0, "an idle relay connection is closed after this long",
                                 0, 3600)
    smtp_wait_s: float = setting("CN_SMTP_WAIT_S", 30.0, "the longest wait for one relay reply", 0.001, 3600)
    smtp_max_per_conn: int = setting("CN_SMTP_MAX_PER_CONN", 1000, "messages a connection sends before it is "
                                     "renewed", 1, 1_000_000)
    smtp_helo: str = setting("CN_SMTP_HELO", "", "the name the mailers greet with (default: the host's)")
    smtp_starttls: str = setting("CN_SMTP_STARTTLS", "auto", "auto, always (a relay without it gets no mail) or never")
    smtp_ca_file: str = setting("CN_SMTP_CA_FILE", "", "the CA that the relays' certificates chain to")
    smtp_attempts: int = setting("CN_SMTP_ATTEMPTS", 4, "tries of one mail on a temporary failure", 1, 100)
    smtp_patience_s: float = setting("CN_SMTP_PATIENCE_S", 600.0, "the least a relay outage is waited out before "
                                     "its mails fail; up to the run's deadline if that is later", 0, 86_400)
    domain_rates: str = setting("CN_DOMAIN_RATES", "", "DOMAIN=RATE,...: messages a second to each receiving "
                                "domain, cluster-wide (each above 0)")
    signer_key: str = setting("CN_SIGNER_KEY", str(DEFAULT_KEY_DIR / "signer.key.pem"), "the signing key (PEM)")
    signer_cert: str = setting("CN_SIGNER_CERT", str(DEFAULT_KEY_DIR / "signer.cert.pem"),
                               "the signing certificate (PEM)")
    signer_chain: str = setting("CN_SIGNER_CHAIN", str(DEFAULT_KEY_DIR / "root.cert.pem"),
                                "the certificates above it (PEM)")
    pkcs11_module: str = setting("CN_PKCS11_MODULE", "", "the HSM's PKCS#11 library: with it, the notes are signed by "
                                 "the key on the token and no key file is read (docs/aws.md)")
    pkcs11_token: str = setting("CN_PKCS11_TOKEN", "", "the token's label")
    pkcs11_key: str = setting("CN_PKCS11_KEY", "", "the private key's label on the token")
    pkcs11_key_id: str = setting("CN_PKCS11_KEY_ID", "", "the private key's id (hex), instead of its label")
    pkcs11_pin: str = setting("CN_PKCS11_PIN", "", "the token user's PIN (on a cluster: the secret's pkcs11_pin)",
                              secret=True)
    pkcs11_pin_file: str = setting("CN_PKCS11_PIN_FILE", "", "a file holding the PIN")
    pkcs11_sessions: int = setting("CN_PKCS11_SESSIONS", 0, "signatures in flight per signer actor; 0: sized from "
                                   "the HSM's measured round trip", 0, 64)
    hsm_patience_s: float = setting("CN_HSM_PATIENCE_S", 120.0, "the least a lost HSM's signatures wait for it "
                                    "(an HSM's failover, a network blip) before its notes fail (a rerun signs "
                                    "them); up to the run's deadline if that is later", 1, 3600)
    redis_patience_s: float = setting("CN_REDIS_PATIENCE_S", 30.0, "the least a Redis outage (a restart, a "
                                      "failover) is waited out before a call fails; up to the run's deadline if "
                                      "that is later", 0, 86_400)
    store_patience_s: float = setting("CN_STORE_PATIENCE_S", 120.0, "the least an S3 outage (no answer, or 500, "
                                      "502, 503, 504 replies past a request's own attempts) is waited out before a "
                                      "run's request fails; up to the run's deadline if that is later", 0, 86_400)
    deadline_at: float = setting("CN_DEADLINE_AT", 0.0, "the run's deadline, in seconds since the epoch (`run "
                                 "--deadline-min` sets it from the run's start): until then an HSM, relay, Redis or S3 "
                                 "outage holds the day; 0: none, each CN_*_PATIENCE_S alone", 0, 1e11)
    day_deadline_h: float = setting("CN_DAY_DEADLINE_H", 12.0, "a run's or rerun's deadline when neither "
                                    "--deadline-min nor CN_DEADLINE_AT gives one, in hours from its start: a "
                                    "dependency's outage is waited out until then", 0.1, 24)
    hsm_ops_s: float = setting("CN_HSM_OPS_S", 0.0, "the HSM's signatures a second, for `plan` (CloudHSM publishes "
                               "2,000 RSA-2048 a second for a cluster of two HSMs); 0: not known", 0, 1_000_000)
    signer_key_password: str | None = setting("CN_SIGNER_KEY_PASSWORD", None, "the signing key's password",
                                              secret=True)
    owner_password: str = setting("CN_OWNER_PASSWORD", PLACEHOLDER_OWNER_PASSWORD, "the PDFs' owner password "
                                  "(`run` refuses the public placeholder but with --test-keys)", secret=True)
    encryption: str = setting("CN_ENCRYPTION", "aes256", "aes256, or none")
    pdf_tags: bool = setting("CN_PDF_TAGS", False, "tagged PDF: doubles render time and grows files ~8x")
    sign_reason: str = setting("CN_SIGN_REASON", "Contract note issued under SEBI regulations", "the signature's "
                               "reason")
    sign_location: str = setting("CN_SIGN_LOCATION", "Bengaluru, India", "the signature's location")
    sign_contact: str = setting("CN_SIGN_CONTACT", "compliance@broker.example.com", "the signature's contact")
    mail_from: str = setting("CN_MAIL_FROM", "Contract Notes <contract-notes@broker.example.com>", "the From header")
    mail_reply_to: str = setting("CN_MAIL_REPLY_TO", "Client Support <support@broker.example.com>",
                                 "the Reply-To header")
    dkim_key: str = setting("CN_DKIM_KEY", "", "the DKIM signing key (PEM, RSA): with CN_DKIM_SELECTOR and "
                            "CN_DKIM_DOMAIN the mailers sign each message; on a cluster the secret's dkim_key_pem. "
                            "Unset: unsigned, for a relay that signs (SES Easy DKIM, OpenDKIM; docs/aws.md)")
    dkim_selector: str = setting("CN_DKIM_SELECTOR", "", "the DKIM selector (s=): the key's TXT record is "
                                 "SELECTOR._domainkey.DOMAIN")
    dkim_domain: str = setting("CN_DKIM_DOMAIN", "", "the DKIM signing domain (d=): the From domain, or a parent "
                               "or child of it (DMARC's relaxed alignment)")
    holidays_file: str = setting("CN_HOLIDAYS_FILE", "", "the broker's trading-holiday list, laid over "
                                 "pipeline/day/data/holidays.json")
    broker_file: str = setting("CN_BROKER_FILE", "", "the issuing entity's details, memberships and tariff (default: "
                               "templates/broker.json); a broker whose commodity membership is a company of its own "
                               "runs the day once per entity, each with its file (docs/input.md)")
    state_ttl_s: int = setting("CN_STATE_TTL_S", 14 * 24 * 3600, "how long Redis keeps a run's state", 60,
                               10 * 365 * 86_400)
    api_token: str = setting("CN_API_TOKEN", "", "bearer token for reruns and unmasked PII in the status service",
                             secret=True)
    secret: str = setting("CN_SECRET", "", "where each signer and mailer reads the key and passwords: aws-sm:NAME "
                          "or file:PATH (pipeline/credentials.py)")
    spot_wait_s: float = setting("CN_SPOT_WAIT_S", 120.0, "no spot render node launched by then: on-demand is "
                                 "asked for", 0, 86_400)
    capacity_wait_s: float = setting("CN_CAPACITY_WAIT_S", 900.0, "a role still without a node by then: the run "
                                     "stops (exit 2)", 0, 86_400)
    on_end: str = setting("CN_ON_END", "", "called when a run ends, however it ends: a webhook URL (the summary "
                          "JSON POSTed) or a command (the JSON on its stdin)", secret=True)
    heartbeat_url: str = setting("CN_HEARTBEAT_URL", "", "a dead man's switch (healthchecks.io's ping API): "
                                 "URL/start when a run starts and every CN_HEARTBEAT_S while it runs, URL when it "
                                 "ends with exit status 0, URL/fail otherwise", secret=True)
    heartbeat_s: float = setting("CN_HEARTBEAT_S", 60.0, "seconds between the heartbeat's pings (the monitor's "
                                 "grace: a few of them)", 0.1, 3600)
    imds_url: str = setting("CN_IMDS_URL", "", "the instance metadata service a worker's spot notice watcher reads; "
                            "empty: EC2's, on an EC2 instance only")
    lease_s: float = setting("CN_LEASE_S", 30.0, "seconds without a renewal before a driver's run, or a bounce "
                             "reader, is taken over", 1, 3600)
    head_grace_s: float = setting("CN_HEAD_GRACE_S", 60.0, "between the driver's exit and the head's end: the "
                                  "job's status and logs flush", 0, 3600)
    token_key: str = setting("CN_TOKEN_KEY", "", "keys the VERP and link HMACs; from the secret on a cluster",
                             secret=True)
    token_key_file: str = setting("CN_TOKEN_KEY_FILE", str(DEFAULT_KEY_DIR / "token.key"), "without CN_TOKEN_KEY "
                                  "or a secret: the HMAC key's file, made once on one machine")
    token_key_id: str = setting("CN_TOKEN_KEY_ID", "", "the fingerprint of the key a run recorded: a follow-up "
                                "must find that key, never make one")
    bounce_local: str = setting("CN_BOUNCE_LOCAL", "bounces", "MAIL FROM is bounce_local+TOKEN@bounce_domain")
    bounce_domain: str = setting("CN_BOUNCE_DOMAIN", "bounces.broker.example.com", "its MX receives the bounces")
    message_id_domain: str = setting("CN_MESSAGE_ID_DOMAIN", "contract-notes.invalid", "the Message-IDs' domain "
                                     "(the broker's mail domain); a run records its own, and its reruns keep it")
    bounce_window_h: float = setting("CN_BOUNCE_WINDOW_H", 72.0, "hours after the run's end before `close` may "
                                     "deem the mail delivered", 1, 720)
    bounce_max_bytes: int = setting("CN_BOUNCE_MAX_BYTES", 5_000_000, "a bigger \"bounce\" is reported, never "
                                    "parsed", 1, 1_000_000_000)
    paper_due_days: int = setting("CN_PAPER_DUE_DAYS", 1, "days after the reason is known that a paper note is "
                                  "due", 0, 30)
    shell_settings: str = setting("CN_SHELL_SETTINGS", "", "of the settings a run recorded its notes and mails "
                                  "with, those a resumed run, rerun or follow-up takes from its shell instead "
                                  "(variables, comma-separated, e.g. CN_MAIL_REPLY_TO); the run's record keeps its own")
    link_base: str = setting("CN_LINK_BASE", "http://127.0.0.1:8000", "the status service's public address, for "
                             "the client's link")
    link_days: float = setting("CN_LINK_DAYS", 90.0, "how long a client's link to their note works", 1, 3650)
    tls_dir: str = setting("CN_TLS_DIR", "", "this node's ca.crt, node.crt, node.key from the cluster's CA: a "
                           "rediss:// REDIS_URL uses them; unset, a run uses none and the `tls` commands ~/.cn-tls")
    tsa_url: str = setting("CN_TSA_URL", "", "an RFC 3161 time-stamping authority: `close` timestamps the proof")

    def __post_init__(self) -> None:
        """A value outside its range stops whatever reads it, before anything is sent: a window of
        1e9 hours mailed a whole day and then crashed writing the report; one of 0 let `close`
        seal at once; links valid for 0 days went out expired."""
        for f in dataclasses.fields(self):
            value, (low, high) = getattr(self, f.name), f.metadata["range"]
            if f.type == "float" and not math.isfinite(value) or low is not None and not low <= value <= high:
                limits = f" (from {low:g} to {high:g})" if low is not None else " (a finite number)"
                raise ConfigError(f"{f.metadata['env']}={value!r} is out of range{limits}")
        if self.heartbeat_url and urlsplit(self.heartbeat_url).scheme not in ("http", "https"):
            raise ConfigError("CN_HEARTBEAT_URL must be an http:// or https:// URL (a monitor's ping URL)")
        if not HOSTNAME.match(self.message_id_domain):
            raise ConfigError(f"CN_MESSAGE_ID_DOMAIN={self.message_id_domain!r} is not a domain name")
        self.domain_limits()
        self.check_dkim()

    def check_dkim(self) -> None:
        """DKIM is all of key, selector and domain or none of them, and its d= aligns with the
        From domain: a signature that does not align passes DKIM and still fails DMARC, and
        1.5M notes would go to spam. Without the Public Suffix List, aligned means the same
        domain, a parent or a child (sibling subdomains are refused)."""
        if not (self.dkim_selector or self.dkim_domain):
            if self.dkim_key:
                raise ConfigError("CN_DKIM_KEY is set without CN_DKIM_SELECTOR and CN_DKIM_DOMAIN: set both to sign")
            return
        if not (self.dkim_selector and self.dkim_domain):
            raise ConfigError("CN_DKIM_SELECTOR and CN_DKIM_DOMAIN go together: set both, or neither")
        if not HOSTNAME.match(self.dkim_domain):
            raise ConfigError(f"CN_DKIM_DOMAIN={self.dkim_domain!r} is not a domain name")
        if not SELECTOR.match(self.dkim_selector):
            raise ConfigError(f"CN_DKIM_SELECTOR={self.dkim_selector!r} is not a selector (labels: letters, digits, "
                              "hyphens, dots)")
        sender = self.mail_from_domain()
        if not aligned(sender, self.dkim_domain.lower()):
            raise ConfigError(f"CN_DKIM_DOMAIN={self.dkim_domain} does not align with the From domain {sender!r} "
                              "(CN_MAIL_FROM): DMARC would fail; sign as the From domain, a parent or a subdomain of it")

    def mail_from_domain(self) -> str:
        return parseaddr(self.mail_from)[1].rpartition("@")[2].lower()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if env is None else env
        values = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["env"])
            if raw is not None and raw != "":
                values[f.name] = _coerce(f.type, raw, f.metadata["env"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values.get("tls_dir") and values.get("redis_url"):
            values["redis_url"] = with_tls_files(values["redis_url"], values["tls_dir"])
        made = cls(**values)
        made.check_urls()
        return made

    def with_deadline(self, minutes: float | None = None) -> "Settings":
        """These settings with the run's deadline set: `minutes` from now (--deadline-min), else
        the one CN_DEADLINE_AT gives, else CN_DAY_DEADLINE_H from now. A day never meets an
        outage without a deadline to wait for."""
        if minutes:
            return dataclasses.replace(self, deadline_at=time.time() + minutes * 60)
        return self if self.deadline_at else dataclasses.replace(self, deadline_at=time.time() +
                                                                 self.day_deadline_h * 3600)

    def check_urls(self) -> None:
        """A malformed URL setting is one line naming it, before anything connects (a Redis URL
        without its scheme was a 33-line traceback from the client library)."""
        if urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"REDIS_URL: {without_password(self.redis_url)!r} is not a Redis URL "
                              "(redis://host:port/db, rediss://... or unix://...)")
        scheme = self.store_url.split(":", 1)[0] if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", self.store_url) else ""
        if scheme and (scheme != "s3" or not self.store_url.startswith("s3://")):
            raise ConfigError(f"CN_STORE: {self.store_url!r} is neither a folder nor s3://bucket[/prefix]")
        try:
            self.smtp()
        except ConfigError as e:
            raise ConfigError(f"SMTP_URL: {e}") from None

    def smtp(self) -> list[SmtpTarget]:
        """SMTP_URL may list several relays, comma-separated; mail is spread across them."""
        return [parse_smtp_url(u.strip()) for u in self.smtp_url.split(",") if u.strip()]

    def relays(self) -> str:
        """The relays as URLs without credentials: what a run records, and what a rerun pins."""
        return ",".join(t.url() for t in self.smtp())

    def pinned_to(self, relays: str) -> "Settings":
        """These settings mailing through `relays` (URLs without credentials), with the
        credentials these settings hold for the same host and port: a rerun mails through its
        run's relays, and no password travels through Ray or the run's record."""
        own = {(t.host, t.port): t for t in self.smtp()}
        urls = []
        for t in (parse_smtp_url(u.strip()) for u in relays.split(",") if u.strip()):
            have = own.get((t.host, t.port))
            user = f"{quote(have.username, safe='')}:{quote(have.password or '', safe='')}@" if have and have.username else ""
            urls.append(t.url().replace("://", f"://{user}", 1))
        return dataclasses.replace(self, smtp_url=",".join(urls))

    def domain_limits(self) -> dict[str, float]:
        """CN_DOMAIN_RATES as {domain: messages a second}."""
        limits = {}
        for part in filter(None, (p.strip() for p in self.domain_rates.split(","))):
            domain, _, rate = part.partition("=")
            limits[domain.strip().lower()] = _rate(rate, f"CN_DOMAIN_RATES {domain.strip()!r}")
        return limits

    def relay_rate(self) -> float:
        """The relays' messages a second together, or 0 when one of them has no rate (no limit known)."""
        rates = [t.rate for t in self.smtp()]
        return sum(rates) if rates and all(rates) else 0.0

    def redis_user(self) -> str:
        return unquote(urlsplit(self.redis_url).username or "")

    def with_redis_password(self, password: str) -> "Settings":
        return self.redis_as(self.redis_user(), password)

    def for_actors(self) -> "Settings":
        """What signer and mailer actors get: with a secret, `cn`'s password is left out (each
        actor reads it from the secret, as it reads the key); without one, these settings with
        the HMAC key read here (an actor's working folder is not the driver's)."""
        if not self.secret:
            return dataclasses.replace(self, token_key=self.hmac_key().decode())
        return self.redis_as(REDIS_ADMIN) if self.redis_user() == REDIS_ADMIN else self

    def redis_as(self, user: str, password: str = "") -> "Settings":
        parts = urlsplit(self.redis_url)
        login = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
        return dataclasses.replace(self, redis_url=parts._replace(
            netloc=f"{login}@{parts.hostname}:{parts.port or 6379}").geturl())

    def hmac_key(self) -> bytes:
        """The key of the VERP and link HMACs: CN_TOKEN_KEY, or the secret's once resolved, or
        on one machine the key file that credentials.resolve makes once, so that `bounces` and
        the status service, run later, check what the run signed. With `token_key_id` (a
        follow-up of a run that recorded its key) the key must be that one: a new key would sign
        what no earlier link or VERP address matches."""
        key = self._hmac_key()
        if self.token_key_id and key_id(key) != self.token_key_id:
            raise ConfigError(f"the HMAC key ({self.token_key_source()}) is not the one the run signed its links "
                              f"and VERP addresses with (key id {self.token_key_id}, this one {key_id(key)})")
        return key

    def token_key_source(self) -> str:
        """Where the HMAC key comes from, as a run records it (never the key)."""
        return "CN_TOKEN_KEY" if self.token_key and not self.secret else f"secret {self.secret}" if self.secret \
            else f"file {self.token_key_file}"

    def _hmac_key(self) -> bytes:
        if self.token_key:
            return self.token_key.encode()
        if self.secret:
            raise ConfigError(f"CN_SECRET {self.secret}: no token_key (python -m pipeline secret-json makes one)")
        path = Path(self.token_key_file)
        if not path.exists():
            raise ConfigError(f"the run's HMAC key file {path} is missing (key id {self.token_key_id}): it is never "
                              "made anew for a run that has one; restore it, or set CN_TOKEN_KEY_FILE"
                              if self.token_key_id else f"the HMAC key file {path} is missing: a run makes it on one "
                              "machine; or set CN_TOKEN_KEY, or CN_TOKEN_KEY_FILE to the run's")
        return path.read_text().strip().encode()

    def anchored(self) -> "Settings":
        """These settings with every folder and file made absolute: what a run records and
        passes on, so that a command typed later, elsewhere, or a worker with another working
        folder, finds the same store and keys."""
        names = KEY_FILES + ("holidays_file", "broker_file", "pkcs11_pin_file", "dkim_key")
        files = {f: str(Path(getattr(self, f)).resolve()) for f in names if getattr(self, f)
                 and not (self.pkcs11_module and f == "signer_key")}  # with a token, only a key named is a key
        return dataclasses.replace(self, store_url=absolute_store(self.store_url), **files)

    def uses_default_key(self) -> bool:
        return not self.secret and not self.pkcs11_module and self.signer_key == Settings.signer_key \
            and self.signer_cert == Settings.signer_cert

    def summary(self) -> dict[str, str]:
        """What a run records about its configuration: no secrets, no credentials."""
        return {
            "store_url": self.store_url,
            "redis_url": without_password(self.redis_url),
            "smtp": ",".join(f"{t.host}:{t.port}" for t in self.smtp()),
            "shard_size": str(self.shard_size),
            "window": str(self.window),
            "signers": str(self.signers),
            "mailers": str(self.mailers),
            "encryption": self.encryption,
            "secret": self.secret,
            "dkim": f"{self.dkim_selector}._domainkey.{self.dkim_domain}" if self.dkim_domain else "",
        }


def aligned(sender: str, signer: str) -> bool:
    """DMARC relaxed alignment, short of the Public Suffix List: one domain equal to, or under, the other."""
    return bool(sender) and (sender == signer or sender.endswith("." + signer) or signer.endswith("." + sender))


def effective(env: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Every setting as this process would run with it: its variable, its value (a secret's
    masked, a URL's password masked) and where the value came from."""
    env = os.environ if env is None else env
    settings, rows = Settings.from_env(env), []
    for f in dataclasses.fields(Settings):
        value, name = getattr(settings, f.name), f.metadata["env"]
        shown = ",".join(without_password(u) for u in str(value).split(",")) if "://" in str(value) else str(value)
        if not f.repr and value not in (None, ""):  # a secret: a URL keeps its host, nothing else is shown
            shown = ",".join(_host_only(u) for u in str(value).split(",")) if "://" in str(value) else "*** (set)"
        if f.name == "owner_password" and value == PLACEHOLDER_OWNER_PASSWORD:
            shown = "the public placeholder: `run` refuses it"
        rows.append({"setting": name, "value": shown, "from": "environment" if env.get(name) else "default"})
    return rows


KEY_FILES = ("signer_key", "signer_cert", "signer_chain", "token_key_file")


TLS_CA, TLS_CERT, TLS_KEY = "ca.crt", "node.crt", "node.key"  # a node's folder (CN_TLS_DIR; tls/ca.py)


def tls_files(folder: str | Path) -> tuple[str, str, str]:
    """The CA's certificate, the node's certificate and its key, in a node's TLS folder."""
    folder = Path(folder).expanduser()
    return str(folder / TLS_CA), str(folder / TLS_CERT), str(folder / TLS_KEY)


def with_tls_files(redis_url: str, folder: str) -> str:
    """A rediss:// URL that names no certificate gets this node's: the same path on every node of
    the cluster, so the URL the driver passes to its tasks works where they run."""
    parts = urlsplit(redis_url)
    if parts.scheme != "rediss" or "ssl_" in parts.query:
        return redis_url
    files = dict(zip(("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"), tls_files(folder)))
    return parts._replace(query="&".join(filter(None, (parts.query, urlencode(files))))).geturl()


def absolute_store(url: str) -> str:
    """s3://... as it is; a folder (or file://folder) as an absolute folder."""
    if "://" in url and not url.startswith("file://"):
        return url
    return str(Path(url.removeprefix("file://")).resolve())


def key_id(key: bytes) -> str:
    """A fingerprint of the HMAC key that a run records, to tell its key from another: not the key."""
    return hashlib.sha256(b"contract-notes token key id\0" + key).hexdigest()[:16]


def aws_region(env: dict[str, str] | None = None) -> str | None:
    """The region boto3 is given: AWS_REGION (what docs/aws.md sets), else AWS_DEFAULT_REGION
    (what botocore alone reads)."""
    env = os.environ if env is None else env
    return env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None


REDIS_ADMIN = "cn"  # the head's Redis user for the driver and actors (pipeline/record/redis_acl.py)


class ConfigError(CannotRun, ValueError):
    pass


def _coerce(kind: str, raw: str, name: str):
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[raw.lower()]
    except KeyError:
        raise ConfigError(f"{name}={raw!r} is not a boolean (true/false)") from None
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind}") from None
    return raw


def parse_smtp_url(url: str) -> SmtpTarget:
    parts = urlsplit(url)
    if parts.scheme not in ("smtp", "smtps"):
        raise ConfigError(f"SMTP URL must start with smtp:// or smtps://, got {parts.scheme!r}")
    if not parts.hostname:
        raise ConfigError("SMTP URL has no host")
    implicit_tls = parts.scheme == "smtps"
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(query) - {"rate", "daily"}
    if unknown:
        raise ConfigError(f"SMTP URL for {parts.hostname}: unknown setting {', '.join(sorted(unknown))} (rate, daily)")
    daily = _rate(query["daily"], f"SMTP URL for {parts.hostname}: daily") if "daily" in query else 0
    if daily != int(daily):
        raise ConfigError(f"SMTP URL for {parts.hostname}: daily={query['daily']} is not a whole number of messages")
    return SmtpTarget(
        host=parts.hostname,
        port=parts.port or (465 if implicit_tls else 25),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        implicit_tls=implicit_tls,
        rate=_rate(query["rate"], f"SMTP URL for {parts.hostname}: rate") if "rate" in query else 0.0,
        daily=int(daily),
    )


def _rate(raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{what}={raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what}={raw!r} must be a positive number")
    return value


def _host_only(url: str) -> str:
    """A secret URL as shown: scheme, user and host; a password, a token in its path or query masked
    (a Redis URL's database number kept)."""
    parts = urlsplit(without_password(url))
    path = parts.path if parts.path.strip("/").isdigit() or parts.path in ("", "/") else "/***"
    return parts._replace(path=path, query="***" if parts.query else "", fragment="").geturl()


def without_password(url: str) -> str:
    """A URL as it may be shown, logged or recorded: its password masked (its host kept as written)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}").geturl()
