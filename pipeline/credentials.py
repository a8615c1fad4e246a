"""The broker's secrets, read by each process that uses them from where the cluster keeps them.

A signer actor on a signer_smtp node cannot read a key file that exists only on the head, and
the key must not travel in file_mounts, the image or Ray's object store. So the driver passes
only the secret's name (CN_SECRET), and each signer and mailer reads the secret when it starts,
with its node's instance profile:

  CN_SECRET=aws-sm:NAME_OR_ARN        AWS Secrets Manager (region: the ARN's, else AWS_REGION,
                                      else AWS_DEFAULT_REGION)
  CN_SECRET=file:/path/secret.json    the same JSON in a file (simulated and embedded clusters)

The secret is one JSON object (make it with `python -m pipeline secret-json`):

  signer_key_pem       PEM private key (RSA or ECDSA P-256)                   required, unless pkcs11_pin
  signer_cert_pem      PEM certificate of that key                            required, unless pkcs11_pin
  pkcs11_pin           the HSM user's PIN (CN_PKCS11_MODULE: the key stays on the token; its
                       certificate from signer_cert_pem, else from the token)    optional
  signer_chain_pem     PEM intermediate and root certificates                 optional
  signer_key_password  the key's password, when it is encrypted               optional
  owner_password       the PDFs' owner (permissions) password                 required
  smtp_url             smtp://user:pass@relay:587 (comma-separated relays)    optional
  redis_password       the head's Redis user `cn` (pipeline/record/redis_acl.py)  optional
  token_key            keys the VERP addresses' and the client links' HMACs       optional
  dkim_key_pem         PEM RSA key the mailers sign with (DKIM), with CN_DKIM_SELECTOR and
                       CN_DKIM_DOMAIN; else CN_DKIM_KEY's file; neither: unsigned  optional

Without CN_SECRET the settings' own files and variables apply (one machine, CI). A REDIS_URL
naming the user `cn` and no password (the cluster's: redis://cn@HEAD:6380/0) gets the
secret's `redis_password`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import unquote, urlsplit

from cryptography import x509

from pipeline.record import keys
from pipeline.record.state import redis_client
from pipeline.seal.signer import Signer, SignerSetupError, load_signer, signer_from_pem
from pipeline.seal.token import PinRefused, TokenConfig, TokenKey
from pipeline.settings import REDIS_ADMIN, ConfigError, Settings, aws_region

if TYPE_CHECKING:
    from pipeline.mail.dkim_signer import DkimSigner

REQUIRED = ("owner_password",)
KEY_FILE = ("signer_key_pem", "signer_cert_pem")  # required unless the key is on a token (pkcs11_pin)
OPTIONAL = ("signer_key_pem", "signer_cert_pem", "signer_chain_pem", "signer_key_password", "smtp_url",
            "redis_password", "token_key", "pkcs11_pin", "dkim_key_pem")
log = logging.getLogger("pipeline.credentials")
_ARN_REGION = re.compile(r"^arn:aws[\w-]*:secretsmanager:([a-z0-9-]+):")


def fetch(ref: str) -> dict[str, str]:
    """The secret as a dict, or one line saying why not (never its content)."""
    kind, _, name = ref.partition(":")
    if kind == "file":
        try:
            text = Path(name).read_text()
        except OSError as e:
            raise ConfigError(f"CN_SECRET {ref}: cannot read it ({e.strerror})") from None
    elif kind == "aws-sm":
        text = _from_secrets_manager(ref, name)
    else:
        raise ConfigError(f"CN_SECRET {ref!r} must start with aws-sm: or file:")
    try:
        secret = json.loads(text)
    except ValueError:
        raise ConfigError(f"CN_SECRET {ref}: not a JSON object") from None
    if not isinstance(secret, dict):
        raise ConfigError(f"CN_SECRET {ref}: not a JSON object")
    missing = [k for k in REQUIRED + (() if secret.get("pkcs11_pin") else KEY_FILE) if not secret.get(k)]
    if missing:
        raise ConfigError(f"CN_SECRET {ref}: missing {', '.join(missing)}")
    wrong = [k for k in (*REQUIRED, *OPTIONAL) if k in secret and not isinstance(secret[k], str)]
    if wrong:  # named, never shown: the value may be the key itself
        raise ConfigError(f"CN_SECRET {ref}: {', '.join(wrong)} must be a string")
    unknown = sorted(set(secret) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ConfigError(f"CN_SECRET {ref}: unknown fields {', '.join(unknown)}")
    return secret


def _from_secrets_manager(ref: str, name: str) -> str:
    import boto3
    import botocore.exceptions

    region = _ARN_REGION.match(name)
    try:
        client = boto3.client("secretsmanager", region_name=region.group(1) if region else aws_region())
        return client.get_secret_value(SecretId=name)["SecretString"]
    except botocore.exceptions.ClientError as e:
        raise ConfigError(f"CN_SECRET {ref}: {e.response['Error'].get('Code')}: "
                          f"{e.response['Error'].get('Message', '')}") from None
    except (botocore.exceptions.BotoCoreError, KeyError) as e:
        raise ConfigError(f"CN_SECRET {ref}: {e}") from None


def with_redis_password(settings: Settings) -> Settings:
    """The settings a process on the head talks to its Redis with: only the Redis password is
    laid over (the rest of the secret stays with the actors that need it)."""
    if settings.redis_user() != REDIS_ADMIN or urlsplit(settings.redis_url).password:
        return settings
    return _redis(settings, fetch(settings.secret) if settings.secret else {})


REDIS_RENDER = "render"  # the render nodes' Redis user (pipeline/record/redis_acl.py)


def resolve(settings: Settings) -> Settings:
    """The settings with the secret's owner password, key password and relays laid over them;
    without a secret, on one machine, with the HMAC key file made once if it is missing."""
    if not settings.secret:
        _own_key_file(settings)
        return settings
    return _laid_over(settings, fetch(settings.secret))


def recorded_token_key(settings: Settings, found: dict) -> bytes:
    """The HMAC key a run recorded (its fingerprint, its secret or key file), read where the run
    said it is: the status service checks that run's links with it once its own key has been
    rotated. Never made anew; a key missing there, or another, is a ConfigError."""
    return resolve(dataclasses.replace(settings, secret=found.get("secret", ""), token_key="",
                                       token_key_file=found.get("token_key_file") or Settings.token_key_file,
                                       token_key_id=found["token_key_id"])).hmac_key()


def check_relay_logins(settings: Settings) -> None:
    """A relay `--smtp` names with a login, where a secret holds the relays' credentials: the
    mailers log in with the secret's (they lay its smtp_url over their settings), so a login
    given only on the command line would never be used and each mail refused. Said at once."""
    if not settings.secret:
        return
    held = {(t.host, t.port) for t in resolve(settings).smtp() if t.username}
    for t in settings.smtp():
        if t.username and (t.host, t.port) not in held:
            raise ConfigError(f"--smtp {t.url()}: the mailers log in to relays with the credentials in the secret "
                              f"({settings.secret}), and its smtp_url has none for {t.host}:{t.port}: add the relay "
                              "there (smtp_url, comma-separated), then name it with --smtp")


def for_mailer(settings: Settings) -> tuple[Settings, DkimSigner | None]:
    """What a mailer holds, from one read of the secret: the resolved settings, and the DKIM
    key loaded once (None: the mail goes unsigned, for the relay to sign)."""
    if not settings.secret:
        return resolve(settings), dkim_signer(settings)
    secret = fetch(settings.secret)
    return _laid_over(settings, secret), dkim_signer(settings, secret)


def dkim_signer(settings: Settings, secret: dict[str, str] | None = None) -> DkimSigner | None:
    """The DKIM signer: the secret's dkim_key_pem, else CN_DKIM_KEY's file; None without
    CN_DKIM_DOMAIN. A key that cannot be read or used is one line naming where it is from."""
    if not settings.dkim_domain:
        return None
    if secret is None:
        secret = fetch(settings.secret) if settings.secret else {}
    if secret.get("dkim_key_pem"):
        pem, where = secret["dkim_key_pem"].encode(), f"the DKIM key in {settings.secret}"
    elif settings.dkim_key:
        pem, where = _dkim_file(settings.dkim_key), f"CN_DKIM_KEY {settings.dkim_key}"
    else:
        raise ConfigError("CN_DKIM_DOMAIN and CN_DKIM_SELECTOR are set, but no DKIM key: CN_DKIM_KEY, or the "
                          "secret's dkim_key_pem")
    from pipeline.mail.dkim_signer import dkim_from_pem  # here: every Ray worker imports this module, few sign

    return dkim_from_pem(pem, settings.dkim_selector, settings.dkim_domain, where)


def _dkim_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"CN_DKIM_KEY {path}: cannot read it ({e.strerror})") from None


def owner_password(settings: Settings) -> str:
    """The owner password a run would use, read without making anything (no key file)."""
    return _laid_over(settings, fetch(settings.secret)).owner_password if settings.secret else settings.owner_password


def _own_key_file(settings: Settings) -> None:
    """A key file made once, 0600, by whichever process comes first. Never for a follow-up of a
    run that recorded its key (token_key_id): a new key would match none of its links."""
    path = Path(settings.token_key_file)
    if settings.token_key or settings.token_key_id or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(secrets.token_hex(32))
    except FileExistsError:  # another process made it first: theirs is the key
        pass


def render_redis_password(password: str) -> str:
    """Derived, so that the head's ACL file and the driver agree without a second secret."""
    return hmac.new(password.encode(), b"contract-notes redis user render", hashlib.sha256).hexdigest()


def for_render(settings: Settings) -> Settings:
    """What render and split tasks get. With the head's Redis users (REDIS_URL names user `cn`),
    the `render` user instead, whose password is derived from `cn`'s: the render nodes cannot
    read the secret, and the password that could erase a mail guard never reaches them."""
    password = unquote(urlsplit(settings.redis_url).password or "")
    if settings.redis_user() != REDIS_ADMIN or not password:
        return settings
    return settings.redis_as(REDIS_RENDER, render_redis_password(password))


def read(settings: Settings) -> tuple[Settings, Signer]:
    """The resolved settings and the signing key, from one read of the secret (or, without
    one, the settings' files); with CN_PKCS11_MODULE, the key on the token."""
    if not settings.secret:
        _own_key_file(settings)
    if settings.pkcs11_module:
        return _from_token(settings, fetch(settings.secret) if settings.secret else {})
    if not settings.secret:
        try:
            return settings, load_signer(settings.signer_key, settings.signer_cert, settings.signer_key_password,
                                         settings.signer_chain)
        except SignerSetupError as e:
            if not settings.uses_default_key():
                raise
            raise SignerSetupError(f"{e}: set CN_SECRET to the cluster's secret (aws-sm:NAME with AWS_REGION, or "
                                   "file:PATH), or CN_SIGNER_KEY and CN_SIGNER_CERT to the key's files") from None
    secret = fetch(settings.secret)
    if not secret.get("signer_key_pem"):
        raise ConfigError(f"CN_SECRET {settings.secret} holds a pkcs11_pin and no key: set CN_PKCS11_MODULE, "
                          "CN_PKCS11_TOKEN and CN_PKCS11_KEY to sign with the token")
    return _laid_over(settings, secret), signer_from_pem(
        secret["signer_key_pem"].encode(), secret["signer_cert_pem"].encode(), secret.get("signer_key_password"),
        secret.get("signer_chain_pem", "").encode(), f"the signing key in {settings.secret}")


def _from_token(settings: Settings, secret: dict[str, str]) -> tuple[Settings, Signer]:
    """The signer of a key that stays on its HSM: one login a process, never with a PIN the
    token refused before (the refusal is kept in Redis: keys.hsm_pin_refused), the certificate
    checked against the key by a probe signature."""
    if secret.get("signer_key_pem") or settings.signer_key != Settings.signer_key:
        raise ConfigError("CN_PKCS11_MODULE and a key file (" + ("the secret's signer_key_pem" if secret.get(
            "signer_key_pem") else f"CN_SIGNER_KEY={settings.signer_key}") + ") are both set: a run signs with one "
            "key; unset one")
    try:
        bytes.fromhex(settings.pkcs11_key_id)
    except ValueError:
        raise ConfigError(f"CN_PKCS11_KEY_ID {settings.pkcs11_key_id!r}: not hex (the key's CKA_ID, e.g. 01a2)") \
            from None
    config = TokenConfig(settings.pkcs11_module, settings.pkcs11_token, settings.pkcs11_key, settings.pkcs11_key_id,
                         _pin(settings, secret), settings.pkcs11_sessions, settings.hsm_patience_s,
                         settings.deadline_at)
    resolved = _laid_over(settings, secret)  # an actor's Redis password is the secret's
    r = redis_client(resolved.redis_url, patience_retries=0)
    key = _logged_in.get(config)
    if key is not None:  # logged in for an earlier run (a rerun in the same process): kept while the HSM signs
        key.config = config  # this run's deadline
        key.on_refused, key.refusal = _refusals(config, r)  # this run's Redis, before the probe may reconnect
        key.tell(lambda since: None)  # an outage the probe meets is not the earlier run's to note
        if not key.alive():  # not signing: the HSM lost since, the PIN refused (so remembered), the sessions gone
            del _logged_in[config]
            key.close()
            key = None
    key = key or _log_in(config, r)
    cert, chain = _token_certificate(settings, secret, key)
    key.check_certificate(cert)
    if key.extractable:
        log.warning("the signing key on token %r is marked extractable: it can leave the HSM (CKA_EXTRACTABLE)",
                    config.token)
    about = {"key": "pkcs11", "token": config.token, "module": config.module, "extractable": key.extractable,
             "sessions": key.sessions, "round_trip_ms": round(key.round_trip_s * 1000, 2)}
    return resolved, Signer(key.sign, key.algorithm, cert, chain, key.sessions, about, key.outages_since, key.tell,
                            key.signing)


_logged_in: dict[TokenConfig, TokenKey] = {}  # one login a process: the driver's preflight, its run, its close


_refused_here: dict[tuple[str, str, str], str] = {}  # (module, token, PIN) refused to this process: never offered again


def _user(config: TokenConfig) -> tuple[str, str, str]:
    return config.module, config.token, config.pin


def _log_in(config: TokenConfig, r) -> TokenKey:
    """A new login, unless this process or another met a refusal of the PIN. One this process
    met is kept in this run's Redis too (a later run of the process may use another Redis), and
    holds until the process ends: a refusal in Redis is forgotten by `--pin-corrected`."""
    keep, known = _refusals(config, r)
    if said := _refused_here.get(_user(config)):
        try:
            keep(said)
        except Exception as e:
            log.warning("the HSM's refusal of the PIN is not kept for other processes: %s", type(e).__name__)
        raise PinRefused(f"{said} by this process, whatever the run: once the PIN is corrected, restart it (a "
                         "notebook: its kernel) and run with --pin-corrected")
    if refused := known():
        raise PinRefused(refused)
    # the key keeps a refusal it meets (its login's, or a reconnection's from the probe signatures on)
    key = TokenKey(config, keep, known)
    _logged_in[config] = key
    return key


def _refusals(config: TokenConfig, r) -> tuple[Callable[[str], None], Callable[[], str]]:
    """A key's hooks: keep a refusal of the PIN this process met, for its life and in this run's
    Redis (the first one's time: one read from another process is not a refusal anew), and read
    one another process met."""
    def keep(said: str) -> None:
        _refused_here[_user(config)] = said
        r.set(keys.hsm_pin_refused(config.token), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              nx=True)

    return keep, lambda: _refusal(config, r)


def _refusal(config: TokenConfig, r) -> str:
    """The token's refusal of the PIN, as whichever process met it kept it; "" if none."""
    at = r.get(keys.hsm_pin_refused(config.token))
    return (f"the HSM refused the PIN for token {config.token!r} at {at}: it is not offered again (an HSM locks "
            "its user after a few failures); once the PIN is corrected, run again with --pin-corrected") if at else ""


def pin_corrected(settings: Settings) -> bool:
    """Forgets the token's refusal of a PIN (`--pin-corrected`): the next login may try once."""
    return bool(redis_client(settings.redis_url, patience_retries=0).delete(keys.hsm_pin_refused(settings.pkcs11_token)))


def _pin(settings: Settings, secret: dict[str, str]) -> str:
    if secret.get("pkcs11_pin"):
        return secret["pkcs11_pin"]
    if settings.pkcs11_pin:
        return settings.pkcs11_pin
    if settings.pkcs11_pin_file:
        where = f"CN_PKCS11_PIN_FILE {settings.pkcs11_pin_file}"
        path = Path(settings.pkcs11_pin_file)
        try:
            if not path.is_file():  # a FIFO or a device would block the read: a PIN is a file's text
                raise ConfigError(f"{where}: not a regular file")
            return path.read_bytes()[:4096].decode("utf-8").strip()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: not UTF-8 text (a PIN is text)") from None
    raise ConfigError("CN_PKCS11_MODULE is set, but no PIN: the secret's pkcs11_pin, CN_PKCS11_PIN or "
                      "CN_PKCS11_PIN_FILE")


def _token_certificate(settings: Settings, secret: dict[str, str], key: TokenKey):
    """The certificate and chain given (the secret's, or CN_SIGNER_CERT/CHAIN's files), else the
    token's; one that is not PEM is named in one line."""
    try:
        return _given_certificate(settings, secret) or key.certificate()
    except ValueError:
        where = "the secret's signer_cert_pem/signer_chain_pem" if secret.get("signer_cert_pem") else \
            f"CN_SIGNER_CERT {settings.signer_cert} or CN_SIGNER_CHAIN {settings.signer_chain}"
        raise ConfigError(f"{where}: not a PEM certificate") from None


def _given_certificate(settings: Settings, secret: dict[str, str]):
    if secret.get("signer_cert_pem"):
        return (x509.load_pem_x509_certificate(secret["signer_cert_pem"].encode()),
                x509.load_pem_x509_certificates(secret["signer_chain_pem"].encode())
                if secret.get("signer_chain_pem", "").strip() else [])
    if Path(settings.signer_cert).is_file():
        chain = Path(settings.signer_chain).read_bytes() if settings.signer_chain and \
            Path(settings.signer_chain).is_file() else b""
        return x509.load_pem_x509_certificate(Path(settings.signer_cert).read_bytes()), \
            x509.load_pem_x509_certificates(chain) if chain.strip() else []
    return None


def _laid_over(settings: Settings, secret: dict[str, str]) -> Settings:
    settings = dataclasses.replace(settings, **{k: secret[k] for k in ("owner_password", "signer_key_password",
                                                                       "smtp_url", "token_key") if secret.get(k)})
    return _redis(settings, secret) if settings.redis_user() == REDIS_ADMIN else settings


def _redis(settings: Settings, secret: dict[str, str]) -> Settings:
    if urlsplit(settings.redis_url).password:
        return settings
    if not secret.get("redis_password"):
        raise ConfigError(f"REDIS_URL names the Redis user {REDIS_ADMIN} without a password, and "
                          f"{settings.secret or 'no CN_SECRET'} has no redis_password")
    return settings.with_redis_password(secret["redis_password"])


def secret_json(settings: Settings) -> str:
    """The secret's JSON from the settings' key files and variables: what to store in Secrets Manager.
    With CN_SECRET naming the secret it replaces (a new signing key, the move to an HSM), that
    secret's HMAC key and Redis password are kept: a new HMAC key would leave every earlier run's
    links, bounces and reruns refused (the key its record names is gone)."""
    kept = fetch(settings.secret) if settings.secret else {}
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None

    if settings.pkcs11_module:  # the key stays on the HSM: its user's PIN instead, and the certificate if given
        secret = {"pkcs11_pin": _pin(settings, {}), "owner_password": settings.owner_password}
        if Path(settings.signer_cert).is_file():
            secret["signer_cert_pem"] = read(settings.signer_cert)
    else:
        secret = {"signer_key_pem": read(settings.signer_key), "signer_cert_pem": read(settings.signer_cert),
                  "owner_password": settings.owner_password}
    if settings.signer_chain and (not settings.pkcs11_module or Path(settings.signer_chain).is_file()):
        secret["signer_chain_pem"] = read(settings.signer_chain)
    if settings.signer_key_password:
        secret["signer_key_password"] = settings.signer_key_password
    secret["smtp_url"] = settings.smtp_url
    if settings.dkim_key:
        secret["dkim_key_pem"] = read(settings.dkim_key)
    secret["redis_password"] = kept.get("redis_password") or secrets.token_urlsafe(32)  # the head's Redis: no one types it
    secret["token_key"] = kept.get("token_key") or secrets.token_hex(32)
    if kept:
        log.warning("secret-json: the HMAC key and Redis password of %s kept", settings.secret)
    return json.dumps(secret)
