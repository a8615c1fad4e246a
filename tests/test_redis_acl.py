"""The head's Redis users (pipeline/record/redis_acl.py) on a real redis-server: no client
without a password; the render tasks' user does what render and split tasks do, and nothing
that could send a note twice or stop a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis

from pipeline.day.split import split_day
from pipeline.embedded import free_port, wait_for_port
from pipeline.record import delivery_log, keys
from pipeline.record.redis_acl import acl_file
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.credentials import for_render, render_redis_password
from pipeline.settings import ROOT, Settings
from pipeline.stages import Batch, load_shard, render_stage, restore_from_log
from tests.test_hostile_input import INNOCENTS, trades_for
from tests.test_note_correctness import DATE, write_day

PASSWORD = "the-secret's-redis-password"


@pytest.fixture(scope="module")
def head_redis(tmp_path_factory):
    """A redis-server with the ACL file `python -m pipeline redis-acl` writes on the head."""
    work = tmp_path_factory.mktemp("acl")
    (work / "users.acl").write_text(acl_file(PASSWORD, render_redis_password(PASSWORD)))
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--dir", str(work), "--aclfile", str(work / "users.acl")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, process, "redis-server", own=True)
    yield Settings(redis_url=f"redis://cn@127.0.0.1:{port}/0", secret="file:unused")
    process.terminate()
    process.wait(10)


def test_nothing_is_answered_without_a_password(head_redis):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(head_redis.redis_url.replace("cn@", "")).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(head_redis.with_redis_password("a guess").redis_url).ping()


def test_the_render_user_splits_renders_and_restores_but_cannot_erase_a_guard_or_touch_the_run(head_redis, tmp_path):
    driver = head_redis.with_redis_password(PASSWORD)
    render = for_render(driver)
    assert render.redis_url.startswith("redis://render:") and PASSWORD not in render.redis_url
    assert driver.for_actors().redis_url == head_redis.redis_url, "actors read the password from the secret"
    run_id = f"acl-{time.time_ns()}"
    admin = RunState(driver.redis_url, run_id)
    epoch = admin.start({"date": DATE})
    lease = admin.take_lease(60).token
    # what split and render tasks do, as the render user
    state = RunState(render.redis_url, run_id)
    store = open_store(str(tmp_path / "store"))
    split = split_day(open_store(str(write_day(tmp_path / "in", trades=trades_for(INNOCENTS), clients=INNOCENTS))),
                      store, state, run_id, DATE, 100, "CNT")
    assert split.accounts == len(INNOCENTS)
    shard = split.shards[0]
    accounts = load_shard(store, run_id, shard)
    delivery_log.append(store, run_id, shard, [
        {"ucc": accounts[0]["ucc"], "status": "delivered", "message_id": "<m>", "at": time.time() + 60, "attempts": 1}])
    assert restore_from_log(store, state, run_id, shard, {a["ucc"] for a in accounts}) == 1
    batch = render_stage(Batch(run_id, DATE, shard, lease=lease), accounts, state, render_notes=lambda notes: [b"%PDF"] * len(notes))
    assert len(batch.items) == len(accounts) - 1 and batch.dropped == {"skipped": 1}
    # what only the driver, the signers and the mailers may do
    r, guard = state.r, keys.run_mailguard(run_id)
    other = next(c["ucc"] for c in INNOCENTS if c["ucc"] != accounts[0]["ucc"])
    refused = {
        "erase a guard": lambda: r.hdel(guard, accounts[0]["ucc"]),
        "expire the guards": lambda: r.expire(guard, 1),
        "delete the guards": lambda: r.delete(guard),
        "overwrite a guard": lambda: r.hset(guard, accounts[0]["ucc"], "x"),
        "claim a mail": lambda: state.claim_mail(other, "<m1>", epoch, lease),
        "change the epoch": lambda: r.hset(keys.run_meta(run_id), "epoch", "forged"),
        "take the lease": lambda: state.take_lease(60),
        "drop the lease": lambda: r.delete(keys.run_lease(run_id)),
        "flush Redis": lambda: r.flushall(),
        "reconfigure Redis": lambda: r.config_set("appendonly", "no"),
        "list the keys": lambda: r.keys("*"),
    }
    for what, do in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            do()
            pytest.fail(f"the render user could {what}")
    assert admin.claimed([accounts[0]["ucc"], other]) == {accounts[0]["ucc"]}
    assert admin.epoch() == epoch and admin.holds_lease(lease)
    assert admin.claim_mail(other, "<m1>", epoch, lease), "the driver's user may"


def test_a_signer_on_an_hsm_asks_the_head_s_redis_with_the_secret_s_password(head_redis, hsm, tmp_path, monkeypatch):
    """A signer actor's settings name Redis's user but not its password (each actor reads the
    secret itself): whether the token refused the PIN before is asked with the secret's password,
    and a refusal is kept where the next process looks. A wrong PIN in a process of its own: a
    process that logged in to the token stays logged in, and its next login is not judged."""
    from pipeline import credentials
    from pipeline.seal.token import SOFTHSM

    monkeypatch.setattr(credentials, "_logged_in", {})  # a fresh process: it logs in
    secret = tmp_path / "secret.json"
    given = {"pkcs11_pin": hsm.pin_file.read_text(), "owner_password": "owner", "redis_password": PASSWORD}
    secret.write_text(json.dumps(given))
    token = {"CN_PKCS11_MODULE": SOFTHSM, "CN_PKCS11_TOKEN": hsm.label, "CN_PKCS11_KEY": hsm.key_label,
             "CN_SIGNER_CERT": str(hsm.cert), "CN_SIGNER_CHAIN": str(hsm.chain), "CN_SECRET": f"file:{secret}",
             "REDIS_URL": head_redis.redis_url}
    resolved, signer = credentials.read(Settings.from_env(token))
    assert signer.about["key"] == "pkcs11" and resolved.redis_user() == "cn"

    secret.write_text(json.dumps({**given, "pkcs11_pin": "not-the-pin"}))
    refused = subprocess.run([sys.executable, "-c", "from pipeline import credentials; from pipeline.settings import "
                              "Settings; credentials.read(Settings.from_env())"], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, **token}, timeout=60)
    assert "PinRefused" in refused.stderr and "AuthenticationError" not in refused.stderr, refused.stderr[-1500:]
    driver = redis.Redis.from_url(head_redis.with_redis_password(PASSWORD).redis_url)
    assert driver.get(keys.hsm_pin_refused(hsm.label))
    driver.delete(keys.hsm_pin_refused(hsm.label))
