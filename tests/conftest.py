"""Session fixtures: one real redis-server, one S3 server, one Ray instance for the whole run;
an SMTP sink per test (cheap, and each test counts its own messages)."""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from pathlib import Path

import boto3
import pytest

from pipeline import credentials
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.embedded import start_redis, start_smtp_sink
from pipeline.seal.sign import make_test_certificate
from pipeline.seal.token import LocalToken, make_test_token
from pipeline.settings import Settings
from tests import servers

TRADE_DATE = "2026-11-20"
NEXT_DATE = "2026-11-23"  # the next trading day: a store's second run (a date's notes are one run's)
# The tests that mostly wait (a simulated cloud's instances, a browser following a run, relays held to their
# rates, an outage's 20 s), beside the slow tests, which mostly keep the cores busy (scripts/test.sh): the
# `ray up` and browser tests in a session of their own from the start, the longest first; the others once
# the quick session has ended and the cores are no longer all busy (run beside it, the four marked `waits`
# elsewhere took 213 s instead of 110, and a node-loss day's raylet missed Ray's 30-s start). These files
# first, in this order.
WAITING_FILES = ("test_ray_up.py", "test_browser.py", "test_relay_rates.py", "test_node_loss.py")
# The quick lane (`bash scripts/test.sh -m quick`, README): every test but those that start Ray, a
# cloud of namespaces, a whole demo or a benchmark (marked `bench` where it is written: each bench
# a process of its own with its own Ray, which scripts/test.sh runs beside the quick tests).
# Whatever needs one of these runs in the full suite.
SLOW_FIXTURES = {"ray_session", "cloud", "api_run", "clone"}  # clone: the README typed on a copy, after its demo
SLOW_FILES = {*WAITING_FILES, "test_faults.py",
              "test_bounces.py", "test_one_count.py", "test_browser.py", "test_notebook.py",
              "test_end_to_end.py", "test_scale.py", "test_heartbeat.py", "test_autoscaler.py",
              "test_metrics_export.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in WAITING_FILES:
            item.add_marker(pytest.mark.waits)
        if not SLOW_FIXTURES & set(item.fixturenames) and item.path.name not in SLOW_FILES \
                and not item.get_closest_marker("bench"):
            item.add_marker(pytest.mark.quick)
    items.sort(key=lambda item: WAITING_FILES.index(item.path.name) if item.path.name in WAITING_FILES
               else len(WAITING_FILES))


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def redis_url(session_dir):
    service = start_redis(session_dir / "redis")
    yield service.url
    service.stop()


@pytest.fixture(scope="session")
def s3_endpoint(session_dir):
    service = servers.start_versitygw(session_dir / "s3")
    env = {"AWS_ENDPOINT_URL": service.url, "AWS_ACCESS_KEY_ID": servers.S3_ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": servers.S3_SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield service.url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    service.stop()


@pytest.fixture(scope="session")
def secrets_endpoint(session_dir):
    """AWS Secrets Manager over HTTP, where signer and mailer actors read CN_SECRET=aws-sm:..."""
    service = servers.start_secrets_manager(session_dir / "secretsmanager")
    saved = os.environ.get("AWS_ENDPOINT_URL_SECRETS_MANAGER")
    os.environ["AWS_ENDPOINT_URL_SECRETS_MANAGER"] = service.url
    yield service.url
    if saved is None:
        os.environ.pop("AWS_ENDPOINT_URL_SECRETS_MANAGER", None)
    else:
        os.environ["AWS_ENDPOINT_URL_SECRETS_MANAGER"] = saved
    service.stop()


@pytest.fixture(autouse=True)
def _own_boto3_session(monkeypatch):
    """Each test's `boto3.client` reads the credentials its environment holds: boto3's default
    session keeps those of the first client a process makes (moto's "testing" ones, say), and
    the tests' S3 server refuses them."""
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    name = f"notes-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def smtp_server(tmp_path):
    """Starts SMTP servers that keep what they receive, misbehaving as told (see smtp_sink)."""
    started = []

    def start(name: str = "outbox", **faults):
        outbox = tmp_path / name
        args = []
        if faults:
            path = tmp_path / f"{name}-faults.json"
            path.write_text(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in faults.items()}))
            args = ["--faults", str(path)]
        service = start_smtp_sink(outbox, tmp_path / f"{name}.log", args)
        service.outbox = outbox
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


@pytest.fixture
def imap_box():
    """Dovecot as the bounce domain's IMAP mailbox (tests/servers.py)."""
    service = servers.start_dovecot()
    yield service
    service.stop()


@pytest.fixture
def smtp_sink(smtp_server):
    return smtp_server()


@pytest.fixture(scope="session")
def keys_dir(session_dir) -> Path:
    make_test_certificate(session_dir / "keys")
    credentials.resolve(Settings(token_key_file=str(session_dir / "keys" / "token.key")))  # the HMAC key, as a run makes it
    return session_dir / "keys"


@pytest.fixture
def settings(tmp_path, redis_url, smtp_sink, keys_dir) -> Settings:
    return Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, smtp_url=smtp_sink.url,
                    shard_size=8, window=4, signers=1, mailers=1,  # as a local run has
                    signer_key=str(keys_dir / "signer.key.pem"), signer_cert=str(keys_dir / "signer.cert.pem"),
                    signer_chain=str(keys_dir / "root.cert.pem"), owner_password="test-owner-secret",
                    token_key_file=str(keys_dir / "token.key"))


@pytest.fixture(scope="session")
def hsm(session_dir) -> LocalToken:
    """A SoftHSM2 token for the session (its key made on the token, not extractable), found by
    every process through SOFTHSM2_CONF; a network HSM's client module finds `p11-kit server`
    at HSM_SOCKET (tests/servers.py starts it where a test wants one)."""
    token = make_test_token(session_dir / "hsm")
    make_test_token(session_dir / "hsm", label="cn-ec", key_type="ec")  # made before any process logs in to the store
    make_test_token(session_dir / "hsm", label="cn-extractable", extractable=True)
    os.environ["P11_KIT_SERVER_ADDRESS"] = f"unix:path={session_dir / 'hsm' / HSM_SOCKET}"
    return token


HSM_SOCKET = "p11-kit.sock"


@pytest.fixture(scope="session")
def ray_session(s3_endpoint, secrets_endpoint, hsm):
    """One local Ray for the whole session, with the role resources a cluster advertises.
    Started after the S3 and Secrets Manager servers and the HSM, so its workers inherit their
    endpoints."""
    import ray

    from pipeline.cluster.driver import job_config, workers_environment

    with workers_environment():  # the allocator and compile threads a run's Ray has
        context = ray.init(num_cpus=2, resources={"render": 2, "signer": 2, "smtp": 2}, include_dashboard=False,
                           object_store_memory=300 * 1024 * 1024, log_to_driver=False, job_config=job_config())
    yield context
    ray.shutdown()


@pytest.fixture
def day(tmp_path) -> Path:
    """A small synthetic day: 30 accounts, heavy-tailed trades."""
    out = tmp_path / "input"
    write_dumps(out, SynthOptions(dt.date.fromisoformat(TRADE_DATE), 30, seed=7))
    return out


@pytest.fixture
def next_day(tmp_path) -> Path:
    """The next trading day's dumps, the same accounts trading again."""
    out = tmp_path / "input-next"
    write_dumps(out, SynthOptions(dt.date.fromisoformat(NEXT_DATE), 30, seed=7))
    return out
