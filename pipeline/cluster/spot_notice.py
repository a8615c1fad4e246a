"""On every worker node: watch EC2's instance metadata for a spot interruption notice (or an
earlier rebalance recommendation) and drain this node through Ray before EC2 ends it.

EC2 announces a spot reclaim two minutes ahead (`spot/instance-action`: the action and its
time), and sometimes earlier recommends moving off (`events/recommendations/rebalance`). On
either, this node is drained through the GCS as autoscaler v2 drains it (reason PREEMPTION,
with the deadline): Ray places no new task or actor here (a worker the driver leased just
before may take one more task within its 500 ms lease), what runs may finish, the driver's
pools choose this node's actors no more (pipeline/cluster/fleet.py), and the day's capacity
request (request_resources) has the autoscaler launch a replacement once the node is gone.

IMDSv2 only (a session token first). On a machine that is not an EC2 instance (its DMI vendor
says so), or where the metadata does not answer, the watcher says so once and exits. cluster.yaml's worker_start_ray_commands
start it in the background after `ray start`:

    python -m pipeline.cluster.spot_notice --address $RAY_HEAD_IP:6379 &
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("pipeline.cluster.spot_notice")
IMDS = "http://169.254.169.254"
DMI_VENDOR = "/sys/devices/virtual/dmi/id/sys_vendor"
TOKEN_TTL_S = 21600
POLL_S = 5.0  # EC2 updates the notice about every 5 s; two minutes leave 24 looks
REBALANCE_DEADLINE_S = 600  # a recommendation comes before any notice: the node has at least this long
NOTICE_DEADLINE_S = 120  # a notice's own time, when it cannot be read


@dataclass(frozen=True)
class Notice:
    kind: str  # "interruption" or "rebalance"
    deadline_s: int  # seconds until EC2 ends the node (as said, or assumed)
    said: str  # what the metadata said, for the drain's reason message


class Metadata:
    """IMDSv2: a session token, then reads with it; the token is renewed when refused."""

    def __init__(self, base: str = IMDS, timeout_s: float = 2.0):
        self.base, self.timeout_s, self.token = base.rstrip("/"), timeout_s, ""

    def get(self, path: str) -> str | None:
        """The value at `path` under latest/meta-data, or None when absent (404)."""
        for _ in range(2):
            if not self.token:
                self.token = self._token()
            request = urllib.request.Request(f"{self.base}/latest/meta-data/{path}",
                                             headers={"X-aws-ec2-metadata-token": self.token})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code != 401:
                    raise
                self.token = ""  # expired: a new one
        raise OSError("the instance metadata refused a fresh token")

    def _token(self) -> str:
        request = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
            return r.read().decode()


def notice(metadata: Metadata, now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)) \
        -> Notice | None:
    """The interruption notice if there is one, else the rebalance recommendation, else None."""
    action = metadata.get("spot/instance-action")
    if action:
        deadline = NOTICE_DEADLINE_S
        try:
            when = dt.datetime.fromisoformat(json.loads(action)["time"].replace("Z", "+00:00"))
            deadline = max(0, int((when - now()).total_seconds()))
        except (ValueError, KeyError, TypeError):
            pass
        return Notice("interruption", deadline, action.strip()[:200])
    rebalance = metadata.get("events/recommendations/rebalance")
    if rebalance:
        return Notice("rebalance", REBALANCE_DEADLINE_S, rebalance.strip()[:200])
    return None


def this_node(gcs_address: str, ip: str) -> str:
    """This node's id (hex): the alive node whose raylet is at this machine's IP."""
    import ray

    client = ray._raylet.GcsClient(address=gcs_address)
    for node_id, info in client.get_all_node_info().items():
        if info.node_manager_address == ip and info.state == 0:  # ALIVE
            return node_id.hex()
    raise LookupError(f"no alive Ray node at {ip} in {gcs_address}")


def drain(gcs_address: str, node_id: str, found: Notice) -> bool:
    """Drains the node through the GCS (what `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`
    does); True if the GCS accepted."""
    import ray
    from ray.core.generated import autoscaler_pb2

    client = ray._raylet.GcsClient(address=gcs_address)
    deadline_ms = int(time.time() * 1000) + found.deadline_s * 1000
    accepted, why = client.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                      f"spot {found.kind}: {found.said}", deadline_ms)
    if not accepted:
        log.error("the GCS did not accept draining node %s: %s", node_id, why)
    return accepted


def watch(metadata: Metadata, on_notice: Callable[[Notice], bool], poll_s: float = POLL_S,
          stop: Callable[[], bool] = lambda: False) -> Notice | None:
    """Polls until a notice is acted on; a rebalance first, then still watching for the notice
    itself (its deadline is the shorter). None if the machine has no metadata."""
    try:
        metadata.get("instance-id")
    except OSError as e:
        log.info("no instance metadata here (%s): nothing to watch", e)
        return None
    acted: Notice | None = None
    while not stop():
        try:
            found = notice(metadata)
        except OSError as e:  # a metadata blip: look again next time
            log.warning("instance metadata: %s", e)
            found = None
        if found and (acted is None or found.kind != acted.kind) and on_notice(found):
            log.warning("spot %s: node drained, %d s until EC2 ends it", found.kind, found.deadline_s)
            acted = found
            if found.kind == "interruption":
                return found
        time.sleep(poll_s)
    return acted


def on_ec2() -> bool:
    """EC2's Nitro instances (c6a is one) name their vendor in the DMI tables: a machine that is
    not one never sends a request to the metadata address."""
    try:
        return "Amazon EC2" in open(DMI_VENDOR).read()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Drain this Ray node on an EC2 spot interruption notice.")
    ap.add_argument("--address", required=True, help="the head's GCS, HOST:PORT")
    ap.add_argument("--metadata", default="", help="the instance metadata service (default: CN_IMDS_URL, else "
                                                   "EC2's on an EC2 instance)")
    ap.add_argument("--poll-s", type=float, default=POLL_S)
    ap.add_argument("--node-id", default="", help="this node's id (found by its IP when not given)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s spot_notice %(levelname)s %(message)s")
    from pipeline.settings import Settings

    metadata = args.metadata or Settings.from_env().imds_url
    if not metadata and not on_ec2():
        log.info("not an EC2 instance (%s) and no CN_IMDS_URL: nothing to watch", DMI_VENDOR)
        return 0
    from ray.util import get_node_ip_address

    ip = get_node_ip_address()

    def act(found: Notice) -> bool:
        try:
            return drain(args.address, args.node_id or this_node(args.address, ip), found)
        except (LookupError, OSError, RuntimeError) as e:
            log.error("could not drain this node (%s): %s", ip, e)
            return False

    watch(Metadata(metadata or IMDS), act, args.poll_s)
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(10)
    raise SystemExit(main())
