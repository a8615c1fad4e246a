"""Every port a node of cluster.yaml's cluster listens on, who must reach it, and the firewall
that holds it to them.

Ray's token proves a peer; it is not a licence to run code, yet any Ray listener that takes a
job, a runtime environment, a task or an actor runs code for whoever holds it, and the token is
on every node. So each port that can run code or read state answers only the peers that need
it: a node's own agents answer the node (its raylet, its workers), a worker's log and metrics
ports the head too; what must cross the cluster (the GCS, the raylets, the workers' gRPC) is
mutual TLS with the cluster's CA, which a token alone does not pass (pipeline/tls/ca.py).

This table is the one place the ports are named: cluster.yaml's `ray start` flags, docs/aws.md's
port table and security groups, and the rules `python -m pipeline tls firewall` prints for a
node's setup all follow it, and tests hold each to it (tests/test_ports.py; the `ray up` test
lists every node's listening sockets and plays the stranger against each port).
"""

from __future__ import annotations

from dataclasses import dataclass

# Who may connect, as iptables and the security groups enforce it
NODE = "the node itself"
NODE_AND_HEAD = "the node itself and the head"
CLUSTER = "the cluster's nodes"
BASTION_AND_HEAD = "the bastion, and the head (its autoscaler sets up each worker over SSH)"
CHAIN = "CN-PORTS"  # the node's own iptables chain: made anew at each `ray up`, jumped to from INPUT


@dataclass(frozen=True)
class Port:
    first: int
    last: int
    where: str  # "head" or "every node"
    peers: str
    wire: str  # "TLS", "HTTP" (plain) or "SSH"
    serves: str
    proof: str  # what a peer that reaches it must still prove

    @property
    def span(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"

    def __contains__(self, port: int) -> bool:
        return self.first <= port <= self.last


def _one(port: int, where: str, peers: str, wire: str, serves: str, proof: str) -> Port:
    return Port(port, port, where, peers, wire, serves, proof)


PORTS = (
    _one(22, "every node", BASTION_AND_HEAD, "SSH", "SSH: `ray up`'s set-up, `ray submit`, the dashboard's tunnel", "an SSH key"),
    _one(6379, "head", CLUSTER, "TLS", "Ray's GCS (gRPC)", "mutual TLS with the cluster's CA, then the token"),
    _one(6380, "head", CLUSTER, "TLS", "the run's Redis", "a certificate from the cluster's CA, then an ACL user"),
    _one(6381, "head", CLUSTER, "HTTP", "the certificate service (`tls serve`): CSRs in, certificates out",
         "an HMAC of the token, for an IP the cloud lists as the cluster's"),
    _one(6382, "every node", CLUSTER, "TLS", "the raylet (gRPC): tasks, leases, actors", "mutual TLS, then the token"),
    _one(6383, "every node", CLUSTER, "TLS", "the object manager (gRPC): objects between the nodes",
         "mutual TLS, then the token"),
    _one(8080, "every node", NODE_AND_HEAD, "HTTP", "Ray's metrics export, scraped by Prometheus on the head",
         "none: reachability alone"),
    _one(8265, "head", NODE, "HTTP", "the dashboard and job API (bound to 127.0.0.1: the SSH tunnel's end)",
         "the token"),
    _one(9090, "head", NODE, "HTTP", "Prometheus (bound to 127.0.0.1)", "none: reachability alone"),
    _one(10001, "head", NODE, "TLS", "Ray client's server (gRPC): runs a remote driver's tasks",
         "mutual TLS, then the token"),
    Port(10002, 19999, "every node", CLUSTER, "TLS", "Ray's worker processes (gRPC): each task's and actor's calls",
         "mutual TLS, then the token"),
    Port(23000, 23999, "head", NODE, "TLS", "Ray client's server for each connected driver (Ray binds them to "
         "127.0.0.1; the rule holds them there whatever a later Ray binds)", "mutual TLS, then the token"),
    _one(44217, "head", NODE, "HTTP", "the autoscaler's metrics", "none: reachability alone"),
    _one(44227, "head", NODE, "HTTP", "the dashboard's own metrics", "none: reachability alone"),
    _one(52365, "every node", NODE_AND_HEAD, "HTTP", "the dashboard agent: the node's logs; on the head also "
         "job submission", "the token"),
    _one(52366, "every node", NODE, "HTTP", "the runtime-env agent: installs what a runtime environment names, "
         "a `pip` package's build included", "the token"),
    _one(52367, "every node", CLUSTER, "TLS", "the dashboard agent (gRPC): the node's state for the head's dashboard",
         "mutual TLS, then the token"),
)


def find(port: int) -> Port | None:
    return next((p for p in PORTS if port in p), None)


def firewall(head_ip: str) -> str:
    """The node's rules as a shell script for `sudo sh`: its own chain, emptied and filled again
    (a second `ray up` leaves one copy), a DROP for every port that answers fewer than the
    cluster. A connection from the node to its own address is LOCAL, as its raylet's to its agents
    is. CLUSTER and BASTION_AND_HEAD ports are the security groups' to hold (docs/aws.md)."""
    lines = [f"iptables -N {CHAIN} 2>/dev/null || iptables -F {CHAIN}",
             f"iptables -C INPUT -j {CHAIN} 2>/dev/null || iptables -I INPUT -j {CHAIN}"]
    for p in PORTS:
        allowed = {NODE: "", NODE_AND_HEAD: f" ! -s {head_ip}"}.get(p.peers)
        if allowed is not None:
            lines.append(f"iptables -A {CHAIN} -p tcp --dport {p.span.replace('-', ':')} "
                         f"-m addrtype ! --src-type LOCAL{allowed} -j DROP")
    return "set -e\n" + "\n".join(lines) + "\n"


def table() -> str:
    """docs/aws.md's port table, made from PORTS (`python -m pipeline.tls.ports`)."""
    rows = ["| port | where | answers | wire | what listens | a peer that reaches it must still prove |",
            "|---|---|---|---|---|---|"]
    rows += [f"| `{p.span}` | {p.where} | {p.peers} | {p.wire} | {p.serves} | {p.proof} |" for p in PORTS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
