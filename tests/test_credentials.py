"""The signing key, owner password and relay credentials read by each actor from CN_SECRET."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from pipeline import credentials
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.record import keys
from pipeline.settings import PLACEHOLDER_OWNER_PASSWORD, ROOT, ConfigError
from tests.conftest import TRADE_DATE
from tests.helpers import assert_signed_and_encrypted, client_rows, outbox_messages


def test_a_file_secret_made_by_secret_json_gives_back_the_key_and_passwords(settings, tmp_path):
    path = tmp_path / "secret.json"
    path.write_text(credentials.secret_json(settings))
    bare = dataclasses.replace(settings, secret=f"file:{path}", owner_password=PLACEHOLDER_OWNER_PASSWORD,
                               signer_key="/nowhere.pem", smtp_url="smtp://127.0.0.1:1")

    resolved = credentials.resolve(bare)
    assert (resolved.owner_password, resolved.smtp_url) == (settings.owner_password, settings.smtp_url)
    assert credentials.read(bare)[1].cert.serial_number == credentials.read(settings)[1].cert.serial_number


def test_a_secret_made_again_over_the_one_cn_secret_names_keeps_its_hmac_key_and_redis_password(settings, tmp_path):
    """docs/aws.md's move to an HSM makes the secret again: its new random HMAC key left every
    earlier run's links, bounces and reruns refused (the key their record names was gone)."""
    first = tmp_path / "first.json"
    first.write_text(credentials.secret_json(settings))
    again = json.loads(credentials.secret_json(dataclasses.replace(settings, secret=f"file:{first}")))
    kept = json.loads(first.read_text())
    assert (again["token_key"], again["redis_password"]) == (kept["token_key"], kept["redis_password"])
    assert json.loads(credentials.secret_json(settings))["token_key"] != kept["token_key"], "a first secret's is new"


@pytest.mark.parametrize("content, error", [
    (None, "cannot read it"),
    ("not json", "not a JSON object"),
    ('["a"]', "not a JSON object"),
    ('{"signer_key_pem": "k", "signer_cert_pem": "c"}', "missing owner_password"),
    ('{"signer_key_pem": "k", "signer_cert_pem": "c", "owner_password": "o", "ownerpassword": "x"}',
     "unknown fields ownerpassword"),
])
def test_a_bad_secret_is_one_line_that_never_shows_its_content(tmp_path, content, error):
    path = tmp_path / "secret.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=error) as raised:
        credentials.fetch(f"file:{path}")
    assert "\n" not in str(raised.value) and '"k"' not in str(raised.value)


def test_an_unknown_secret_store_is_refused():
    with pytest.raises(ConfigError, match="must start with aws-sm: or file:"):
        credentials.fetch("vault:contract-notes")


def test_a_secret_missing_from_secrets_manager_names_it(secrets_endpoint, monkeypatch):
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="aws-sm:contract-notes/absent: You must specify a region"):
        credentials.fetch("aws-sm:contract-notes/absent")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with pytest.raises(ConfigError, match="aws-sm:contract-notes/absent: ResourceNotFoundException"):
        credentials.fetch("aws-sm:contract-notes/absent")


@pytest.mark.usefixtures("ray_session")
def test_every_actor_reads_the_key_and_relay_from_secrets_manager(settings, day, smtp_sink, secrets_endpoint,
                                                                  ray_session):
    owner = "owner-from-the-secret-7f3a"
    secret = json.loads(credentials.secret_json(dataclasses.replace(settings, owner_password=owner)))
    arn = boto3.client("secretsmanager", region_name="ap-south-1").create_secret(
        Name=f"contract-notes/{os.getpid()}", SecretString=json.dumps(secret))["ARN"]
    # Nothing secret in the settings the driver hands to Ray: no key file, no relay, the public placeholder
    bare = dataclasses.replace(settings, secret=f"aws-sm:{arn}", signer_key="/nowhere/key.pem",
                               signer_cert="/nowhere/cert.pem", signer_chain="", smtp_url="smtp://127.0.0.1:1",
                               owner_password=PLACEHOLDER_OWNER_PASSWORD)

    summary = run_day(bare, RunRequest(TRADE_DATE, str(day)))

    assert summary["delivered"] == summary["accounts"] > 0
    assert len(outbox_messages(smtp_sink.outbox)) == summary["delivered"]
    clients = client_rows(day)
    ucc = sorted(clients)[0]
    archived = Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, ucc)
    assert_signed_and_encrypted(archived, clients[ucc]["pan"])
    shown = subprocess.run(["qpdf", f"--password={owner}", "--show-encryption", str(archived)],
                           capture_output=True, text=True)
    assert "Supplied password is owner password" in shown.stdout
    logs = Path(ray_session.address_info["session_dir"]) / "logs"
    leaked = [p.name for p in logs.rglob("*") if p.is_file() and owner.encode() in p.read_bytes()]
    assert not leaked, f"the owner password is in Ray's logs: {leaked}"


@pytest.mark.parametrize("secret, why", [
    ('{"signer_key_pem": "k", "signer_cert_pem": "c"}', "missing owner_password"),
    # made before the VERP addresses: said at once, not by each mailer
    ('{"signer_key_pem": "k", "signer_cert_pem": "c", "owner_password": "o"}',
     "no token_key (python -m pipeline secret-json makes one)"),
], ids=["incomplete", "no-token-key"])
def test_run_with_an_incomplete_secret_stops_at_once_with_one_line(tmp_path, secret, why):
    path = tmp_path / "secret.json"
    path.write_text(secret)
    out = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "CN_SECRET": f"file:{path}", "PYTHONPATH": ROOT})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"error: CN_SECRET file:{path}: {why}"
    assert "Traceback" not in out.stderr


PIN_PROBE = """
import json, os, sys
import psutil, ray
from pipeline.cluster.driver import init_ray
from pipeline.settings import Settings
os.environ["CN_PKCS11_PIN"] = "pin-4242-secret"
os.environ["CN_OWNER_PASSWORD"] = "owner-4242-secret"
init_ray(Settings.from_env())
seen = ray.get(ray.remote(num_cpus=0)(lambda: [os.environ.get(k) for k in ("CN_PKCS11_PIN", "CN_OWNER_PASSWORD")])
               .remote())
leaked = set()
for p in psutil.Process().children(recursive=True):
    try:
        if b"4242-secret" in open(f"/proc/{p.pid}/environ", "rb").read():
            leaked.add(p.name())
    except OSError:
        pass
print(json.dumps({"worker": seen, "leaked_into": sorted(leaked), "driver": os.environ.get("CN_PKCS11_PIN")}))
ray.shutdown()
"""


def test_the_pin_and_passwords_stay_out_of_every_process_a_local_run_starts():
    """Before, CN_PKCS11_PIN and CN_OWNER_PASSWORD were in the environment of the GCS, the raylet,
    Ray's agents and every worker of a local run: each reads what it needs as its settings."""
    import json
    import subprocess
    import sys

    from pipeline.settings import ROOT

    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="cnpin", dir="/tmp") as tmp:  # short: Ray's socket paths
        done = subprocess.run([sys.executable, "-c", PIN_PROBE], cwd=ROOT, capture_output=True, text=True,
                              timeout=180, env={**env, "RAY_TMPDIR": tmp, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"worker": [None, None], "leaked_into": [], "driver": "pin-4242-secret"}, seen


def test_a_rerun_through_a_relay_whose_login_only_the_command_line_names_is_refused_at_once(
        settings, tmp_path, monkeypatch, capsys):
    """With a secret, the mailers log in with the secret's relay credentials: a login given only
    to `--smtp` was never used, and every mail the rerun made was refused by the relay."""
    from pipeline.__main__ import main

    secret = tmp_path / "secret.json"
    secret.write_text(credentials.secret_json(dataclasses.replace(settings, smtp_url="smtp://cn:pw@relay-a:587")))
    monkeypatch.setenv("CN_SECRET", f"file:{secret}")
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    assert main(["rerun", "no-such-run", "--failed", "--smtp", "smtp://cn:other@relay-b:587"]) == 2
    assert "its smtp_url has none for relay-b:587" in capsys.readouterr().err
    assert main(["rerun", "no-such-run", "--failed", "--smtp", "smtp://cn:pw@relay-a:587"]) == 2
    assert "relay-a" not in capsys.readouterr().err, "a relay the secret logs in to is taken (the run is not there)"
