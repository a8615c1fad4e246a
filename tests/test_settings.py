import dataclasses

import pytest

from pipeline.record.storage import FolderStore, S3Store, StorageError, open_store
from pipeline.settings import ConfigError, Settings, parse_smtp_url


def test_defaults_run_locally_with_nothing_configured():
    s = Settings.from_env({})
    assert s.redis_url.startswith("redis://127.0.0.1")
    assert isinstance(open_store(s.store_url), FolderStore)


def test_environment_overrides_defaults_and_flags_override_environment():
    s = Settings.from_env({"CN_SHARD_SIZE": "250", "REDIS_URL": "redis://r:1/2"}, redis_url="redis://flag:3/0")
    assert s.shard_size == 250
    assert s.redis_url == "redis://flag:3/0"


def test_a_non_numeric_setting_names_the_variable():
    with pytest.raises(ConfigError, match="CN_WINDOW"):
        Settings.from_env({"CN_WINDOW": "lots"})


def test_smtp_urls_carry_credentials_and_implicit_tls():
    t = parse_smtp_url("smtps://user%40x:p%2Fw@relay.example.com")
    assert (t.host, t.port, t.username, t.password, t.implicit_tls) == ("relay.example.com", 465, "user@x", "p/w", True)
    assert parse_smtp_url("smtp://127.0.0.1:2525").port == 2525
    with pytest.raises(ConfigError):
        parse_smtp_url("http://relay")


def test_the_config_summary_never_shows_secrets():
    s = Settings.from_env({"REDIS_URL": "redis://:hunter2@r:6379/0", "CN_OWNER_PASSWORD": "topsecret"})
    text = repr(s) + str(s.summary())
    assert "hunter2" not in text and "topsecret" not in text


def test_storage_urls_choose_the_backend():
    assert isinstance(open_store("s3://bucket/pre/fix"), S3Store)
    assert open_store("s3://bucket/pre/fix").prefix == "pre/fix"
    with pytest.raises(StorageError):
        open_store("gs://bucket")


@pytest.mark.parametrize("name,value", [("CN_BOUNCE_WINDOW_H", "1e9"), ("CN_BOUNCE_WINDOW_H", "nan"),
                                        ("CN_BOUNCE_WINDOW_H", "inf"), ("CN_BOUNCE_WINDOW_H", "0"),
                                        ("CN_BOUNCE_WINDOW_H", "-1"), ("CN_LINK_DAYS", "0"), ("CN_LINK_DAYS", "-1"),
                                        ("CN_LINK_DAYS", "nan"), ("CN_LINK_DAYS", "inf"), ("CN_PAPER_DUE_DAYS", "-1"),
                                        ("CN_SMTP_PATIENCE_S", "nan")])
def test_a_setting_out_of_its_range_stops_the_run_in_one_line_before_anything_is_sent(
        name, value, tmp_path, monkeypatch, capsys):
    from pipeline.__main__ import main

    monkeypatch.setenv(name, value)
    assert main(["run", "--date", "2026-11-20", "--input", str(tmp_path / "in"), "--store", str(tmp_path / "s"),
                 "--test-keys"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and name in errors[0] and "out of range" in errors[0], errors
    assert not (tmp_path / "s").exists()


def test_config_shows_each_setting_where_it_came_from_and_no_secret(monkeypatch, capsys):
    import json

    from pipeline.__main__ import main

    monkeypatch.setenv("SMTP_URL", "smtp://mailer:relay-pass-9@relay.example:587")
    monkeypatch.setenv("CN_OWNER_PASSWORD", "owner-pass-9")
    monkeypatch.setenv("CN_SHARD_SIZE", "77")
    monkeypatch.delenv("CN_WINDOW", raising=False)
    assert main(["config", "--json"]) == 0
    out = capsys.readouterr().out
    rows = {r["setting"]: r for r in json.loads(out)}
    assert "relay-pass-9" not in out and "owner-pass-9" not in out
    assert rows["SMTP_URL"] == {"setting": "SMTP_URL", "value": "smtp://mailer:***@relay.example:587",
                                "from": "environment"}
    assert rows["CN_OWNER_PASSWORD"]["value"] == "*** (set)"
    assert rows["CN_SHARD_SIZE"]["value"] == "77" and rows["CN_WINDOW"]["from"] == "default"
    assert len(rows) == len(dataclasses.fields(Settings)), "every setting"
    # the public placeholder is not a secret that is set: said as what it is (before: "*** (set)")
    monkeypatch.delenv("CN_OWNER_PASSWORD")
    assert main(["config", "--json"]) == 0
    rows = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["CN_OWNER_PASSWORD"]["value"] == "the public placeholder: `run` refuses it"


def test_version_names_the_release():
    import subprocess
    import sys

    from pipeline import __version__
    from pipeline.settings import ROOT

    done = subprocess.run([sys.executable, "-m", "pipeline", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith(f"contract-notes-on-Ray {__version__}"), done


def test_a_bad_or_unreachable_s3_store_is_one_line_exit_2_never_a_traceback(s3_endpoint, capsys):
    """Before: `verify RUN --store s3://` printed botocore's "Invalid bucket name" traceback, and
    a store S3 answers with an error (a bucket that is not there) a ClientError traceback."""
    from pipeline.__main__ import main

    for store in ("s3://", "s3://Not_A_Bucket/x", "s3://no-such-bucket-here/x"):
        assert main(["verify", "some-run", "--store", store]) == 2, store
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error:") and "Traceback" not in err[0], (store, err)


def test_a_run_without_a_deadline_has_one_all_the_same(monkeypatch):
    """Before, `run` without --deadline-min had none: an HSM outage past CN_HSM_PATIENCE_S (120 s)
    failed every later note though the day had hours left. Now CN_DAY_DEADLINE_H (12 h) from its start."""
    import time

    monkeypatch.delenv("CN_DEADLINE_AT", raising=False)
    now = time.time()
    assert abs(Settings.from_env().with_deadline().deadline_at - (now + 12 * 3600)) < 60
    assert abs(Settings.from_env().with_deadline(30).deadline_at - (now + 1800)) < 60
    monkeypatch.setenv("CN_DEADLINE_AT", str(now + 99))
    assert Settings.from_env().with_deadline().deadline_at == now + 99
