"""The simulated cloud's network (tests/local_cloud.py), which the `ray up` tests' days cross."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import local_cloud  # noqa: E402


def _reaches(ns: str, host: str, port: int) -> bool:
    """A TCP connection from inside the instance's network within 2 s."""
    return subprocess.run(["ip", "netns", "exec", ns, "timeout", "2", "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def test_an_instance_that_ends_leaves_the_gateway_reachable_from_the_others_at_once():
    """The instance whose port has the lowest MAC on the bridge ends (its namespace deleted, as
    `terminate` does); another, which had reached the gateway, reaches it again at once. Before,
    the bridge had taken that port's MAC as the gateway's and changed it when the port went: the
    other instance's connections went unanswered for ~30 s, until its ARP entry was renewed."""
    subnet = random.choice([n for n in range(200, 250) if not Path(f"/sys/class/net/cnbr{n}").exists()])
    bridge, gateway = f"cnbr{subnet}", f"10.{subnet}.0.1"
    local_cloud.add_router(bridge, gateway, local_cloud.router_mac(subnet))
    ends, stays = f"cn{subnet}-10", f"cn{subnet}-11"
    listener = socket.socket()
    try:
        listener.bind((gateway, 0))
        listener.listen(8)  # the kernel completes the connections: nothing needs to accept them
        port = listener.getsockname()[1]
        for n, ns in ((10, ends), (11, stays)):
            local_cloud.plug(ns, f"cnv{subnet}x{n}", bridge, f"10.{subnet}.0.{n}", gateway)
        subprocess.run(["ip", "link", "set", f"cnv{subnet}x10", "address", "02:00:00:00:00:01"], check=True)  # lowest
        assert _reaches(stays, gateway, port) and _reaches(ends, gateway, port)
        subprocess.run(["ip", "netns", "del", ends], check=True)
        assert _reaches(stays, gateway, port), "the gateway lost with another instance's end"
    finally:
        listener.close()
        for ns in (ends, stays):
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", bridge], stderr=subprocess.DEVNULL)
