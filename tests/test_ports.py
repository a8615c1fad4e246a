"""The cluster's port table (pipeline/tls/ports.py) against what follows it: cluster.yaml's
`ray start` flags, docs/aws.md's table, and the firewall a node installs, applied for real in a
network namespace and tried from another (the `ray up` test tries it on the whole cluster)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from pipeline.settings import ROOT
from pipeline.tls import ports


def test_docs_aws_port_table_is_the_one_the_firewall_follows():
    page = (Path(ROOT) / "docs/aws.md").read_text()
    documented = page.split("<!-- ports: python -m pipeline.tls.ports -->\n", 1)[1].split("<!-- ports -->", 1)[0]
    assert documented == ports.table()


@pytest.mark.parametrize("role", ["head", "worker"])
def test_cluster_yaml_pins_each_of_ray_s_ports_to_a_row_of_the_table(role):
    config = yaml.safe_load((Path(ROOT) / "cluster.yaml").read_text())
    commands = config[f"{role}_start_ray_commands"]
    start = next(c for c in commands if "ray start" in c)
    pinned = {flag: int(n) for flag, n in re.findall(r"--([a-z-]*port)=(\d+)", start)}
    wanted = {"node-manager-port", "object-manager-port", "min-worker-port", "max-worker-port", "metrics-export-port",
              "dashboard-agent-listen-port", "runtime-env-agent-port", "dashboard-agent-grpc-port"}
    wanted |= {"port", "dashboard-port", "ray-client-server-port"} if role == "head" else set()
    assert set(pinned) == wanted, start
    for flag, port in pinned.items():
        row = ports.find(port)
        assert row is not None and row.where in ("every node", role), (flag, port)
    firewall = commands.index(next(c for c in commands if "tls firewall" in c))
    assert firewall < commands.index(start), "the firewall is up before Ray listens"


def test_a_node_s_firewall_holds_each_port_to_its_peers(tmp_path):
    """Two network namespaces on a veth pair: the node, and the rest of the security group (a
    stranger's address and the head's). The node listens on a port of each kind and installs the
    rules `tls firewall` prints; each address then tries each port."""
    net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
    node, rest = f"cnfw{os.getpid()}n", f"cnfw{os.getpid()}r"
    tried = {52366: "runtime-env agent", 52365: "dashboard agent", 8080: "metrics", 10001: "Ray client",
             23000: "Ray client's server for a driver", 6382: "raylet"}
    script = tmp_path / "listen.py"
    script.write_text(textwrap.dedent(f"""
        import socket, sys, time
        held = []
        for port in {sorted(tried)}:
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("{net}.2", port)); s.listen(16); held.append(s)
        print("up", flush=True)
        time.sleep(60)
    """))
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        import json, socket, sys
        def reach(src, port):
            s = socket.socket(); s.settimeout(1.5)
            try:
                s.bind((src, 0)); s.connect(("{net}.2", port)); return True
            except OSError:
                return False
            finally:
                s.close()
        print(json.dumps({{src: {{p: reach(src, p) for p in {sorted(tried)}}} for src in sys.argv[1:]}}))
    """))

    def sh(cmd: str) -> None:
        subprocess.run(cmd, shell=True, check=True, capture_output=True)

    sh(f"ip netns add {node} && ip netns add {rest} && ip link add {node}v type veth peer name {rest}v && "
       f"ip link set {node}v netns {node} && ip link set {rest}v netns {rest} && "
       f"ip -n {node} addr add {net}.2/24 dev {node}v && ip -n {rest} addr add {net}.3/24 dev {rest}v && "
       f"ip -n {rest} addr add {net}.4/24 dev {rest}v && ip -n {node} link set {node}v up && "
       f"ip -n {rest} link set {rest}v up && ip -n {node} link set lo up")
    listener = None
    try:
        listener = subprocess.Popen(["ip", "netns", "exec", node, sys.executable, str(script)], stdout=subprocess.PIPE)
        assert listener.stdout.readline() == b"up\n"
        subprocess.run(["ip", "netns", "exec", node, "sh", "-c", ports.firewall(f"{net}.4")], check=True)
        seen = json.loads(subprocess.run(["ip", "netns", "exec", rest, sys.executable, str(probe), f"{net}.3",
                                          f"{net}.4"], check=True, capture_output=True, text=True).stdout)
        itself = json.loads(subprocess.run(["ip", "netns", "exec", node, sys.executable, str(probe), f"{net}.2"],
                                           check=True, capture_output=True, text=True).stdout)
    finally:
        if listener:
            listener.kill()
            listener.wait()
        subprocess.run(f"ip netns del {node}; ip netns del {rest}", shell=True, capture_output=True)
    stranger, head, self_ = seen[f"{net}.3"], seen[f"{net}.4"], itself[f"{net}.2"]
    assert {tried[int(p)] for p, ok in stranger.items() if ok} == {"raylet"}, stranger
    assert {tried[int(p)] for p, ok in head.items() if ok} == {"raylet", "dashboard agent", "metrics"}, head
    assert all(self_.values()), self_
