"""cluster.yaml against Ray's own validator and AWS bootstrap (under moto), teardown through
the autoscaler SDK, and the capacity plan against hand-computed numbers."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.cluster import plan as cluster
from pipeline.cluster.driver import COMPILE_THREADS, MALLOC_ARENAS, WORKER_MALLOC
from pipeline.settings import ROOT

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def aws(tmp_path, monkeypatch):
    """cluster.yaml with its FILL-IN values filled from resources made in moto's AWS."""
    import boto3
    from moto import mock_aws

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # the tests' S3 server is not AWS
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "ap-south-1", "HOME": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)  # HOME: the bootstrap writes its SSH key under ~/.ssh
    with mock_aws():
        ec2, iam = boto3.client("ec2", region_name="ap-south-1"), boto3.client("iam")
        ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        subnet = ec2.describe_subnets()["Subnets"][0]
        group = ec2.create_security_group(GroupName="contract-notes", Description="the cluster",
                                          VpcId=subnet["VpcId"])["GroupId"]
        subnet = subnet["SubnetId"]
        arns = {}
        for name in ("contract-notes-head", "contract-notes-worker"):
            iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")
            arns[name] = iam.create_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Arn"]
            iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        config = yaml.safe_load(open(f"{ROOT}/cluster.yaml"))
        for name, node_type in config["available_node_types"].items():
            node_config = node_type["node_config"]
            node_config.update(ImageId=ami, SubnetIds=[subnet], SecurityGroupIds=[group])
            node_config["IamInstanceProfile"]["Arn"] = arns["contract-notes-head" if name == "head" else
                                                            "contract-notes-worker"]
        yield config, ec2, ami, subnet


def test_cluster_yaml_passes_rays_validation_and_the_aws_bootstrap(aws):
    from ray.autoscaler._private import commands
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = aws[0]
    validate_config(prepare_config(copy.deepcopy(config)))
    types = config["available_node_types"]
    assert types["head"]["resources"] == {"CPU": 0}
    assert types["render_spot"]["priority"] > types["render_ondemand"]["priority"]
    assert types["render_spot"]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert {types[t]["node_config"]["InstanceType"] for t in ("render_spot", "render_ondemand")} == {"c6a.8xlarge"}
    assert types["signer_smtp"]["node_config"]["InstanceType"] == "c6a.2xlarge"
    for node_type in types.values():
        assert all(isinstance(v, int) for v in node_type["resources"].values())
        assert node_type["node_config"]["InstanceInitiatedShutdownBehavior"] == "terminate"
        assert node_type["node_config"]["IamInstanceProfile"]["Arn"]
    assert {"render", "signer", "smtp"} <= {r for t in types.values() for r in t["resources"]}
    assert any("shutdown -h +" in c for c in config["initialization_commands"])  # the dead-man switch
    for commands_ in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = next(c for c in commands_ if "ray start" in c)
        assert "--metrics-export-port=8080" in start and "source ~/contract_notes/scripts/cluster.env" in start
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--port=6379" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "port 6380" in " ".join(config["head_setup_commands"])  # Redis clear of Ray's GCS port
    assert "redis" not in " ".join(config["setup_commands"] + config["worker_setup_commands"])
    assert "requirements-runtime.txt" in " ".join(config["setup_commands"])
    assert config["provider"]["cache_stopped_nodes"] is False and config["provider"]["use_internal_ips"] is True
    assert "availability_zone" not in config["provider"]  # the subnets decide
    shipped = set(config["file_mounts"])
    assert not any(part in m for m in shipped for part in ("tests", "bench", ".keys", "notebooks"))
    env = (Path(ROOT) / "scripts/cluster.env").read_text()
    assert "~/.ray/auth_token" in shipped and "RAY_AUTH_MODE=token" in env
    assert f"export MALLOC_ARENA_MAX={MALLOC_ARENAS} " in env  # the nodes' Ray and workers, as a local run's
    assert f"export LD_PRELOAD={WORKER_MALLOC};" in env and "libjemalloc2" in " ".join(config["setup_commands"])
    assert f"export RAYON_NUM_THREADS={COMPILE_THREADS} " in env

    booted = commands._bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    for node_type in booted["available_node_types"].values():  # ours, not Ray's with SSH open to 0.0.0.0/0
        assert node_type["node_config"]["SecurityGroupIds"] == config["available_node_types"]["head"][
            "node_config"]["SecurityGroupIds"]
    assert booted["auth"]["ssh_private_key"]


def launch(ec2, ami, subnet, kind: str, node_type: str) -> str:
    tags = {"ray-cluster-name": "contract-notes", "ray-node-type": kind, "ray-user-node-type": node_type,
            "ray-node-status": "up-to-date", "Name": f"ray-contract-notes-{kind}"}
    reply = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="c6a.2xlarge", SubnetId=subnet,
                              TagSpecifications=[{"ResourceType": "instance",
                                                  "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
    return reply["Instances"][0]["InstanceId"]


def states(ec2) -> dict[str, str]:
    return {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances()["Reservations"]
            for i in r["Instances"]}


@pytest.mark.parametrize("crash", [False, True])
def test_the_end_of_a_run_terminates_the_workers_even_after_a_driver_crash(aws, crash):
    config, ec2, ami, subnet = aws
    head = launch(ec2, ami, subnet, "head", "head")
    workers = [launch(ec2, ami, subnet, "worker", "render_spot"), launch(ec2, ami, subnet, "worker", "signer_smtp")]
    calls = []

    def run():
        with cluster.session(True, deadline_min=25, config=config, release=lambda: calls.append("release"),
                             shutdown=cluster.terminate_head, request=lambda bundles: calls.append(("request", len(bundles)))) as current:
            current.size_for(1_500_000)
            if crash:
                raise RuntimeError("driver crashed mid-run")

    if crash:
        with pytest.raises(RuntimeError):
            run()
    else:
        run()

    after = states(ec2)
    assert all(after[w] in ("shutting-down", "terminated") for w in workers), after
    assert after[head] in ("shutting-down", "terminated")  # through the provider, as `ray down` does
    assert calls == [("request", len(cluster.plan(1_500_000, 25).bundles)), "release"]


def test_keep_cluster_only_releases_the_request(aws):
    config, ec2, ami, subnet = aws
    worker = launch(ec2, ami, subnet, "worker", "render_spot")
    calls = []
    with cluster.session(True, keep=True, config=config, release=lambda: calls.append("release"),
                         shutdown=lambda c: calls.append("shutdown")):
        pass
    assert calls == ["release"] and states(ec2)[worker] == "running"


def test_off_a_cluster_the_session_touches_nothing():
    calls = []
    with cluster.session(False, deadline_min=25, release=lambda: calls.append("release"),
                         teardown=lambda c: calls.append("teardown"), shutdown=lambda c: calls.append("shutdown"),
                         request=lambda b: calls.append("request")) as current:
        current.size_for(1000)
    assert calls == []


RATES = cluster.Rates(render_cpu_ms=11, sign_cpu_ms=8, mails_per_s_per_mailer=250, efficiency=0.8,
                      split_rows_per_s_per_core=60_000, rows_per_account=20, report_s_per_100k=6,
                      redis_bytes_per_account=225)


def test_the_plan_matches_hand_computed_numbers():
    # 1.5M accounts, 30M rows, 25 min. Report: 15 x 6 = 90 s. Budget = 1500 x 0.75 - 240 - 90 = 795 s.
    # Render: 1.5M x 11 ms / 0.8 = 20,625 core-s + the split's 30M / 60k = 500 = 21,125; one
    # c6a.8xlarge gives 795 x 32 = 25,440 -> 1 node. Split: 30M / (60k x 32) = 15.625 s.
    # Sign: 15,000 core-s over 795 x 8 = 6,360 per node -> 3 (2.36); mail: 1.5M / (795 x 4 x 250) -> 2.
    # Slowest stage: render 21,125 / 32 = 660.16 s: 240 + 660.16 + 90 = 990.16 s.
    # Head: 1.5M x 225 B = 0.31 GiB of Redis, x 1.5 + 2 GiB -> c6a.xlarge (8 GiB). Kept 14 days:
    # 4.40 GiB, x 1.5 + 2 = 8.6 GiB > 8 -> c6a.2xlarge.
    # Cost: 990.16 / 3600 h x (1.152 + 3 x 0.288) $/h = 0.5545 $.
    p = cluster.plan(1_500_000, 25, RATES)
    assert (p.render_nodes, p.signer_smtp_nodes, p.rows) == (1, 3, 30_000_000)
    assert (p.split_s, p.report_s) == (pytest.approx(15.625), pytest.approx(90))
    assert p.expected_s == pytest.approx(990.16, abs=0.01)
    assert (p.head.instance, round(p.head_redis_gib, 2)) == ("c6a.xlarge", 0.31)
    assert (p.head_kept.instance, round(p.head_kept_redis_gib, 2)) == ("c6a.2xlarge", 4.40)
    assert p.usd == pytest.approx(0.5545, abs=0.0001)
    assert len(p.bundles) == 4 and p.bundles[0] == {"CPU": 32, "render": 32}
    # 5M in 25 min: report 300 s, budget 585 s; render 70,416.7 / 18,720 -> 4; sign 50,000 / 4,680
    # -> 11 (10.7); mail -> 9. Slowest: sign 50,000 / 88 = 568.18 s -> 240 + 568.18 + 300 = 1108.18 s.
    big = cluster.plan(5_000_000, 25, RATES)
    assert (big.render_nodes, big.signer_smtp_nodes) == (4, 11)
    assert big.expected_s == pytest.approx(1108.18, abs=0.01)
    # a small day still gets one node of each type, and start-up dominates: 240 + 10/8 + 0.06 s.
    small = cluster.plan(1000, 10, RATES)
    assert (small.render_nodes, small.signer_smtp_nodes, small.expected_s) == (1, 1, pytest.approx(241.31))
    assert cluster.plan(1000, 10, RATES, retention_days=1).head_kept.instance == "c6a.xlarge"
    # 30M rows on 4 render nodes (128 vCPU): 30M / (60k x 128) = 3.9 s
    assert cluster.plan(1_500_000, 25, RATES, rows=30_000_000, min_render_nodes=4).split_s == pytest.approx(3.906, abs=0.001)


def test_the_plan_command_prints_the_plan_from_the_benchmarks_own_figures():
    out = subprocess.run([sys.executable, "-m", "pipeline", "plan", "--accounts", "1500000", "--deadline-min", "25"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    shown = json.loads(out.stdout.splitlines()[-1])
    measured = json.loads(cluster.MEASURED.read_text())
    rates = cluster.Rates.measured()
    assert rates.split_rows_per_s_per_core == measured["scale"]["split_rows_per_s_all"] / measured["scale"]["cores"]
    assert rates.mails_per_s_per_mailer == measured["mail"]["ours_mails_per_s"]
    expected = cluster.plan(1_500_000, 25, rates)
    assert shown == expected.as_dict()
    assert f"{expected.render_nodes} x c6a.8xlarge" in out.stderr and shown["split_min"] > 0


def test_the_plan_takes_the_control_plane_s_figures_from_the_full_size_day_once_it_has_run(tmp_path):
    measured = json.loads(cluster.MEASURED.read_text())
    measured.pop("fullday", None)
    large = {"accounts": 1_500_000, "rows": 36_000_000, "report_write_s": 90.0, "redis_bytes_per_account": 300.0}
    measured["fullday"] = {"sizes": [150_000, 1_500_000], "at_1500000": large, "at_150000": {}}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    rates = cluster.Rates.measured(tmp_path / "m.json")
    assert (rates.rows_per_account, rates.report_s_per_100k, rates.redis_bytes_per_account) == (24.0, 6.0, 300.0)
    assert rates.split_rows_per_s_per_core == measured["scale"]["split_rows_per_s_all"] / measured["scale"]["cores"]


def test_the_readmes_capacity_table_is_what_plan_prints():
    table = subprocess.run([sys.executable, "-m", "pipeline", "plan", "--table"], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout.strip()
    assert table.count("\n") == 6 and table in (Path(ROOT) / "docs" / "aws.md").read_text()


def cluster_run(env: dict, tmp_path) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("CN_", "SMTP_URL"))}
    return subprocess.run([sys.executable, f"{ROOT}/scripts/cluster_run.py", "2026-11-20", "s3://b/dumps"],
                          capture_output=True, text=True, env={**keep, **env}, cwd=tmp_path, timeout=60)


@pytest.mark.parametrize("env, error", [
    ({}, "CN_STORE='': set it to the day's bucket"),
    ({"CN_STORE": "s3://YOUR-BUCKET"}, "CN_STORE='s3://YOUR-BUCKET': set it"),
    ({"CN_STORE": "/data/store"}, "a folder on the head is not reachable from the workers"),
    ({"CN_STORE": "s3://notes"}, "CN_SECRET is not set"),
    ({"CN_STORE": "s3://notes", "CN_SECRET": "file:/nowhere.json"}, "CN_SECRET file:/nowhere.json: cannot read it"),
    ({"CN_STORE": "s3://notes", "CN_SECRET": "file:{secret}"}, "no relay: put smtp_url in the secret"),
    ({"CN_STORE": "s3://notes", "CN_SECRET": "file:{full}"}, "CN_TLS_DIR='' has no certificate from the cluster's CA"),
    ({"CN_STORE": "s3://notes", "CN_SECRET": "file:{full}", "CN_TLS_DIR": "{tmp}"}, "has no certificate"),
])
def test_cluster_run_names_a_missing_setting_in_one_line_before_anything_starts(env, error, tmp_path, keys_dir):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"signer_key_pem": (keys_dir / "signer.key.pem").read_text(),
                                  "signer_cert_pem": (keys_dir / "signer.cert.pem").read_text(),
                                  "owner_password": "o-7f3a"}))
    full = tmp_path / "full.json"  # everything but the node's certificate
    full.write_text(json.dumps({**json.loads(secret.read_text()), "smtp_url": "smtp://relay:587",
                                "redis_password": "r-1"}))
    out = cluster_run({k: v.format(secret=secret, full=full, tmp=tmp_path) for k, v in env.items()}, tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error: ") and error in out.stderr and len(out.stderr.splitlines()) == 1


def test_the_runtime_requirements_are_generated_from_the_pins():
    out = subprocess.run([sys.executable, f"{ROOT}/scripts/runtime_requirements.py", "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    runtime = (Path(ROOT) / "requirements-runtime.txt").read_text()
    assert "ray==2.60.0" in runtime and "pytest" not in runtime and "moto" not in runtime
    assert all(f"{p}==" in runtime for p in ("pandas", "matplotlib", "nbclient", "ipykernel")), "the notebook on a head"


@pytest.mark.parametrize("driver_lives_s", [1.0, 0.0])
def test_the_head_is_terminated_through_its_provider_after_the_driver_has_exited(tmp_path, driver_lives_s):
    """`driver_lives_s` 0: the driver exits as soon as it has started the waiter, as a day stopped
    by a wrong input URL does, before the waiter has imported what it needs (the `ray up` test of
    that day failed so, from a clean clone beside the other tests: the head never ended)."""
    config = tmp_path / "bootstrap.yaml"
    config.write_text(yaml.safe_dump({
        "cluster_name": "cn", "provider": {"type": "external", "module": "tests.recording_provider.RecordingProvider"},
        "auth": {"ssh_user": "ubuntu"}, "head_node_type": "head", "max_workers": 0,
        "available_node_types": {"head": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}},
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")},
        "file_mounts": {}, "cluster_synced_files": [], "rsync_exclude": [], "rsync_filter": []}))
    record = tmp_path / "terminated.jsonl"
    driver = ("import sys, time; from pipeline.cluster.plan import terminate_head_after_driver; "
              f"terminate_head_after_driver({str(config)!r}, grace_s=0.5); time.sleep({driver_lives_s})")
    env = {**os.environ, "PYTHONPATH": ROOT, "CN_RECORDED_TERMINATIONS": str(record), "HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-c", driver], env=env, cwd=ROOT, timeout=60, check=True)
    assert not record.exists()  # not while the driver runs, nor in the grace after it: the job's status is read
    deadline = time.monotonic() + 30
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert record.read_text().splitlines() == ['["head-1"]'], (tmp_path / "end-head.log").read_text()


@pytest.mark.parametrize("argv, said", [
    (["plan", "--accounts", "-5"], "'-5' is not a number of accounts"),
    (["demo", "--accounts", "0"], "'0' is not a number of accounts"),
    (["synth", "--date", "2026-11-20", "--accounts", "0", "--out", "x"], "'0' is not a number of accounts"),
    (["plan", "--table", "--accounts", "1500000"], "give --accounts or --table"),
])
def test_a_day_of_no_accounts_or_a_table_for_one_size_is_refused_in_one_line(argv, said, capsys):
    """Before: `plan --accounts -5` printed the split of -115 rows and exited 0; `demo --accounts
    0` ran Ray for 38 s and exited 0; `--table` ignored `--accounts`."""
    from pipeline.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code not in (0, None)
    assert said in capsys.readouterr().err + str(refused.value.code)


def test_a_day_that_cannot_meet_its_deadline_says_why_and_what_would():
    short = cluster.plan(1_500_000, 5)
    assert not short.as_dict()["fits_deadline"]
    assert short.advice().startswith("does not fit 5 min") and "at least" in short.advice(), short.advice()
    assert cluster.plan(1_500_000, 25).advice() == ""


def test_redis_unreachable_is_named_in_the_one_line_error(monkeypatch, capsys):
    from pipeline.__main__ import main
    from pipeline.embedded import free_port

    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    assert main(["close", "any-run"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: Redis cannot be reached"), err
    assert time.monotonic() - started < 10, "said at once, not after the ~30 s a blip mid-command is given (37 s before)"


def test_a_local_run_starts_its_own_ray_whatever_a_stale_ray_start_left_behind():
    """A `ray start` once run on the machine leaves /tmp/ray/ray_current_cluster: before, a
    local run or rerun then tried to join that address and ended in Ray's traceback ("When
    connecting to an existing cluster, num_cpus ... must not be provided")."""
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="cn-", dir="/tmp"))  # Ray's socket paths must stay short
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray/ray_current_cluster").write_text("192.0.2.77:6379\n")  # nothing listens there
    started = subprocess.run([sys.executable, "-c", "import ray; from pipeline.cluster.driver import init_ray; "
                              "from pipeline.settings import Settings; init_ray(Settings()); "
                              "print(ray.get_runtime_context().gcs_address); ray.shutdown()"],
                             capture_output=True, text=True, timeout=180, cwd=ROOT,
                             env={**os.environ, "RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": "", "PYTHONPATH": ROOT})
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert started.returncode == 0, started.stderr[-2000:]
    assert "192.0.2.77" not in started.stdout
