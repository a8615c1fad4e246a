"""cluster.yaml against Ray's own validator and AWS bootstrap (under moto), teardown through
the autoscaler SDK, and the capacity plan against hand-computed numbers."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from pipeline import cluster
from pipeline.driver import ROOT

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
        subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
        arns = {}
        for name in ("contract-notes-head", "contract-notes-worker"):
            iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")
            arns[name] = iam.create_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Arn"]
            iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        config = yaml.safe_load(open(f"{ROOT}/cluster.yaml"))
        for name, node_type in config["available_node_types"].items():
            node_config = node_type["node_config"]
            node_config.update(ImageId=ami, SubnetIds=[subnet])
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
    assert all("--metrics-export-port=8080" in c[-1] for c in (config["head_start_ray_commands"],
                                                                config["worker_start_ray_commands"]))
    assert config["provider"]["cache_stopped_nodes"] is False

    booted = commands._bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    for node_type in booted["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"]
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
                             shutdown=lambda: calls.append("shutdown"),
                             request=lambda bundles: calls.append(("request", len(bundles)))) as current:
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
    assert after[head] == "running"  # the head shuts itself down (the "shutdown" step)
    assert calls == [("request", 4), "release", "shutdown"]


def test_keep_cluster_only_releases_the_request(aws):
    config, ec2, ami, subnet = aws
    worker = launch(ec2, ami, subnet, "worker", "render_spot")
    calls = []
    with cluster.session(True, keep=True, config=config, release=lambda: calls.append("release"),
                         shutdown=lambda: calls.append("shutdown")):
        pass
    assert calls == ["release"] and states(ec2)[worker] == "running"


def test_off_a_cluster_the_session_touches_nothing():
    calls = []
    with cluster.session(False, deadline_min=25, release=lambda: calls.append("release"),
                         teardown=lambda c: calls.append("teardown"), shutdown=lambda: calls.append("shutdown"),
                         request=lambda b: calls.append("request")) as current:
        current.size_for(1000)
    assert calls == []


def test_the_plan_matches_hand_computed_numbers():
    # 1.5M accounts in 25 min. Budget = 25 x 60 x 0.75 - 240 = 885 s.
    # Render: 1.5M x 11 ms / 0.8 = 20,625 core-s; one c6a.8xlarge gives 885 x 32 = 28,320 -> 1 node.
    # Sign: 1.5M x 8 ms / 0.8 = 15,000 core-s over 885 x 8 = 7,080 per node -> 3 nodes (2.12);
    # mail: 1.5M / (885 x 1000) -> 2 nodes; so 3 signer/SMTP nodes.
    # Slowest stage: render 20,625 / 32 = 644.53 s (sign 625 s, mail 500 s): 240 + 644.53 = 884.53 s.
    # Cost: 884.53 / 3600 h x (1.152 + 3 x 0.288) $/h = 0.4953 $.
    p = cluster.plan(1_500_000, 25)
    assert (p.render_nodes, p.signer_smtp_nodes) == (1, 3)
    assert p.expected_s == pytest.approx(884.53, abs=0.01)
    assert p.usd == pytest.approx(0.4953, abs=0.0001)
    assert len(p.bundles) == 4 and p.bundles[0] == {"CPU": 32, "render": 32}
    # 5M in 25 min: render 68,750 / 28,320 -> 3; sign 50,000 / 7,080 -> 8 (7.06); mail -> 6.
    # Slowest: sign 50,000 / 64 = 781.25 s -> 1021.25 s.
    big = cluster.plan(5_000_000, 25)
    assert (big.render_nodes, big.signer_smtp_nodes) == (3, 8)
    assert big.expected_s == pytest.approx(1021.25)
    # a small day still gets one node of each type, and start-up dominates: 240 + 10/8 s.
    small = cluster.plan(1000, 10)
    assert (small.render_nodes, small.signer_smtp_nodes, small.expected_s) == (1, 1, 241.25)


def test_the_plan_command_prints_the_same_plan():
    out = subprocess.run([sys.executable, "-m", "pipeline", "plan", "--accounts", "1500000", "--deadline-min", "25"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    shown = json.loads(out.stdout.splitlines()[-1])
    assert shown == cluster.plan(1_500_000, 25).as_dict()
    assert "1 x c6a.8xlarge" in out.stderr and "3 x c6a.2xlarge" in out.stderr
