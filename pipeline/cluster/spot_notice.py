"""On every worker node: watch EC2's instance metadata for a spot interruption notice (or an
earlier rebalance recommendation) and drain this node through Ray before EC2 ends it.

EC2 announces a spot reclaim two minutes ahead (`spot/instance-action`: the action and its
time), and sometimes earlier recommends moving off (`events/recommendations/rebalance`). On
either, this node is drained through the GCS as autoscaler v2 drains it (reason PREEMPTION,
with the deadline): Ray places no new task or actor here (a worker the driver leased just
before may take one more task within its 500 ms lease), what runs may finish, the driver's
pools choose this node's actors no more (pipeline/cluster/fleet.py), and the day's capacity
request (request_resources) has the autoscaler launch a replacement once the node is gone.

IMDSv2 only (a session token first). At boot the metadata and the GCS may not answer yet: each is
asked again with backoff (`PROBES` times), and a node the watcher cannot protect (not an EC2
instance, metadata still silent, Ray unreachable) is said at WARNING, never at INFO. A watcher
that exits for want of metadata exits 1, and its supervisor starts it again; one with nothing to
protect (not EC2) or whose node is drained exits 0. cluster.yaml's worker_start_ray_commands start
it after `ray start` under a restart loop (docs/operations.md, "A spot notice"):

    until python -m pipeline.cluster.spot_notice --address $RAY_HEAD_IP:6379; do sleep 5; done

The GCS calls are Ray's private ones, kept in pipeline/cluster/ray_private.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import socket
import threading
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
PROBES = 8  # tries of the metadata (and of the GCS) at start, 1 s apart and doubling: about two minutes
BACKOFF_CAP_S = 30.0


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


def drain(gcs_address: str, node_id: str, found: Notice) -> bool:
    """Drains the node through the GCS (what `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`
    does); True if the GCS accepted."""
    from pipeline.cluster import ray_private

    deadline_ms = int(time.time() * 1000) + found.deadline_s * 1000
    accepted, why = ray_private.drain_node(gcs_address, node_id, f"spot {found.kind}: {found.said}", deadline_ms)
    if not accepted:
        log.error("the GCS did not accept draining node %s: %s", node_id, why)
    return accepted


def probed(what: str, probe: Callable[[], object], probes: int = PROBES, first_s: float = 1.0,
           sleep: Callable[[float], None] = time.sleep) -> bool:
    """True once `probe` answers; False, said at WARNING, after `probes` failures with doubling
    waits between them. At boot IMDS or the GCS may not answer for a while: one refusal there
    must not leave the node unwatched for the rest of its life."""
    wait = first_s
    for attempt in range(1, probes + 1):
        try:
            probe()
            return True
        except Exception as e:  # refused, timed out (Ray's RpcError), not yet registered: all "not now"
            if attempt == probes:
                log.warning("this node is not protected from a spot notice: %s did not answer after %d tries (%s)",
                            what, probes, e)
                return False
            log.info("%s: %s (try %d of %d; again in %.0f s)", what, e, attempt, probes, wait)
            sleep(wait)
            wait = min(wait * 2, BACKOFF_CAP_S)
    return False


def watch(metadata: Metadata, on_notice: Callable[[Notice], bool], poll_s: float = POLL_S,
          stop: Callable[[], bool] = lambda: False, probes: int = PROBES, first_s: float = 1.0) -> Notice | None:
    """Polls until a notice is acted on; a rebalance first, then still watching for the notice
    itself (its deadline is the shorter). None if the metadata never answered."""
    if not probed(f"the instance metadata ({metadata.base})", lambda: metadata.get("instance-id"), probes, first_s):
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
        log.warning("this node is not protected from a spot notice: not an EC2 instance (%s) and no CN_IMDS_URL",
                    DMI_VENDOR)
        return 0  # nothing will ever come: the supervisor need not start it again
    from ray.util import get_node_ip_address

    from pipeline.cluster import ray_private

    ip = get_node_ip_address()
    find = (lambda: args.node_id) if args.node_id else (lambda: ray_private.node_id_at(args.address, ip))
    # Said now, not at the notice; beside the watch (an unreachable GCS costs 40 s a try), not before it
    threading.Thread(target=probed, args=(f"Ray's GCS ({args.address}) for the node at {ip}", find),
                     daemon=True).start()

    def act(found: Notice) -> bool:
        try:
            return drain(args.address, find(), found)
        except Exception as e:  # Ray's RpcError included: said, and tried again at the next look
            log.error("could not drain this node (%s): %s", ip, e)
            return False

    noticed = watch(Metadata(metadata or IMDS), act, args.poll_s)
    return 0 if noticed else 1  # no metadata: started again by its supervisor (cluster.yaml)


if __name__ == "__main__":
    socket.setdefaulttimeout(10)
    raise SystemExit(main())
