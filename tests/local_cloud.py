"""A small cloud on this machine, for `ray up` of cluster.yaml end to end in CI.

Each instance is a set of Linux namespaces: its own network (a veth on a bridge, a private IP,
no internet), PIDs (so the yaml's `ray stop` sees only the instance's processes), hostname and
mounts (its own /home/ubuntu, /tmp, /run, Redis files and name lookups), like a VM. The cloud's API runs on the
host at the bridge address; `LocalCloudProvider` is Ray's node provider for it (the laptop's
`ray up` and the head's autoscaler both use it), and its command runner plays SSH: commands run
in the instance through the API (like SSM Run Command), files are uploaded as tar, and
`ray dashboard`'s port forward is an HTTP CONNECT to the instance's loopback.

The image (the AMI) is the host's Debian plus: the runtime packages pre-installed in a venv that
the yaml's `python3 -m venv ~/venv && pip install -r requirements-runtime.txt` finds satisfied;
`sudo`, `apt-get` (packages must be in the image), `systemctl` (redis-server only) and
`shutdown` (asks the API to end the instance: InstanceInitiatedShutdownBehavior terminate).

    python tests/local_cloud.py variant cluster.yaml http://10.88.0.1:PORT > cluster-local.yaml

writes the variant of cluster.yaml this cloud runs: only the provider section differs.
Needs root (namespaces, a bridge); its root folder must not be under /tmp (each instance has its own). The cloud refuses spot launches when asked to
(`refuse_spot`), as EC2 does in a capacity shortage.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

NODE_HOME = "/home/ubuntu"
IMDS_TOKEN = "cn-local-cloud-imds-token"  # IMDSv2's session token: asked for, then carried
SHIMS = ("sudo", "apt-get", "systemctl", "shutdown")


def variant(cluster_yaml: str, api: str) -> str:
    """cluster.yaml with its provider section pointing at this cloud; the rest is kept as is."""
    config = yaml.safe_load(cluster_yaml)
    config["provider"] = {"type": "external", "module": "local_cloud.LocalCloudProvider", "api": api,
                          "use_internal_ips": True, "cache_stopped_nodes": False}
    return yaml.safe_dump(config, sort_keys=False)


# ----------------------------------------------------------------------------- the cloud (host side)

class Cloud:
    """The API server's state: instances, their namespaces and their processes."""

    def __init__(self, root: Path, subnet: int, python_paths: list[str], image_env: dict[str, str],
                 refuse_spot: bool = False):
        if Path("/tmp") in root.resolve().parents:
            raise CloudError(f"{root}: the cloud's folder must not be under /tmp (instances see their own /tmp)")
        self.root, self.subnet, self.refuse_spot = root, subnet, refuse_spot
        self.bridge, self.gateway = f"cnbr{subnet}", f"10.{subnet}.0.1"
        self.instances: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.launches: list[dict] = []  # every launch asked for, refused or not
        self.image_env = image_env
        self.home_files: dict[str, str] = {}  # what an AMI baked from a set-up node holds in ~ (a setup's stamps)
        self.next = 10
        add_router(self.bridge, self.gateway, router_mac(subnet))
        self.image = root / "image"
        self.python_paths = python_paths
        _build_image(self.image, len(python_paths))

    def launch(self, node_config: dict, tags: dict, count: int) -> list[str]:
        spot = node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
        self.launches.append({"type": node_config.get("InstanceType"), "spot": spot, "refused": spot and self.refuse_spot})
        if spot and self.refuse_spot:
            raise CloudError("InsufficientInstanceCapacity: There is no Spot capacity available that matches "
                             "your request.")
        return [self._start(node_config, tags) for _ in range(count)]

    def _start(self, node_config: dict, tags: dict) -> str:
        with self.lock:
            n, self.next = self.next, self.next + 1
        iid, ip = f"i-{self.subnet:02x}{n:06x}", f"10.{self.subnet}.0.{n}"
        ns, veth, node = f"cn{self.subnet}-{n}", f"cnv{self.subnet}x{n}", self.root / iid
        for d in ("homes/ubuntu", "tmp", "run", "etc-redis", "var-lib-redis", "var-log-redis", "profile.d"):
            (node / d).mkdir(parents=True, exist_ok=True)
        # Names as the VPC's resolver answers them: its own ip-a-b-c-d (Ray's agents look it up), and a
        # resolver that refuses at once (the gateway, where nothing listens on port 53), not the host's,
        # which this network cannot reach: each lookup would wait out its timeouts (20 s a name)
        (node / "hosts").write_text(f"127.0.0.1 localhost\n{ip} ip-{ip.replace('.', '-')}\n")
        (node / "resolv.conf").write_text(f"nameserver {self.gateway}\noptions timeout:1 attempts:1\n")
        os.chmod(node / "tmp", 0o1777)
        shutil.copytree("/etc/skel", node / "homes/ubuntu", dirs_exist_ok=True)
        for name, text in self.home_files.items():
            (node / "homes/ubuntu" / name).write_text(text)
        _copy_venv(self.image / "venv", node / "homes/ubuntu/venv")
        shutil.copytree("/etc/redis", node / "etc-redis", dirs_exist_ok=True)
        shutil.copytree("/etc/profile.d", node / "profile.d", dirs_exist_ok=True)
        env = {**self.image_env, "CN_SIM_API": self.api, "CN_SIM_INSTANCE": iid,
               "CN_IMDS_URL": f"{self.api}/imds/{iid}"}  # its instance metadata (IMDSv2), as EC2's at 169.254.169.254
        (node / "profile.d/zz-cn-sim.sh").write_text(
            f"export PATH={self.image}/bin:$PATH\n" + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        try:
            return self._boot(iid, ip, ns, veth, node, node_config, tags)
        except Exception:
            _sh(f"ip netns del {ns}", check=False)
            raise

    def _boot(self, iid: str, ip: str, ns: str, veth: str, node: Path, node_config: dict, tags: dict) -> str:
        plug(ns, veth, self.bridge, ip, self.gateway)
        binds = [(p, self.image / f"py{i}") for i, p in enumerate(self.python_paths)] + [(node / src, dst) for src, dst in (
            ("homes", "/home"), ("run", "/run"), ("etc-redis", "/etc/redis"), ("var-lib-redis", "/var/lib/redis"),
            ("var-log-redis", "/var/log/redis"), ("profile.d", "/etc/profile.d"), ("hosts", "/etc/hosts"),
            ("resolv.conf", "/etc/resolv.conf"), ("tmp", "/tmp"))]  # /tmp last
        mounts = " && ".join(f"mount --bind {src} {dst}" for src, dst in binds)
        init = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--ipc",
             "sh", "-c", f"hostname ip-{ip.replace('.', '-')} && {mounts} && mkdir -p /run/redis && "
                         "echo ready && exec sleep infinity"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(node / "init.log", "wb"),
            start_new_session=True)
        if init.stdout.readline() != b"ready\n":
            init.wait()
            raise CloudError(f"instance {iid} did not boot: {(node / 'init.log').read_text()}")
        pid1 = _child(init.pid)
        with self.lock:
            self.instances[iid] = {"id": iid, "ip": ip, "tags": dict(tags), "state": "running", "ns": ns,
                                   "init": init, "pid1": pid1, "node": str(node),
                                   "pidns": os.readlink(f"/proc/{pid1}/ns/pid"),
                                   "type": node_config.get("InstanceType")}
        return iid

    def terminate(self, iid: str) -> None:
        with self.lock:
            inst = self.instances.get(iid)
            if inst is None or inst["state"] != "running":
                return
            inst["state"] = "shutting-down"
        try:
            os.kill(inst["pid1"], signal.SIGKILL)  # the kernel ends every process of the instance
        except ProcessLookupError:
            pass
        inst["init"].wait()
        deadline = time.monotonic() + 30
        while self._alive(inst["pidns"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        _sh(f"ip netns del {inst['ns']}", check=False)  # its veth goes with it
        inst["state"] = "terminated"

    def close(self) -> None:
        for iid in list(self.instances):
            self.terminate(iid)
        if getattr(self, "server", None):
            self.server.shutdown()
        _sh(f"ip link del {self.bridge}", check=False)

    def exec(self, iid: str, argv: list[str], stdin: bytes = b"") -> tuple[int, bytes]:
        inst = self._running(iid)
        login = ["env", "-i", "-C", NODE_HOME, f"HOME={NODE_HOME}", "USER=ubuntu", "LOGNAME=ubuntu", "SHELL=/bin/bash",
                 "TERM=dumb", "LANG=C.UTF-8", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        p = subprocess.run(["nsenter", "-t", str(inst["pid1"]), "-m", "-u", "-i", "-n", "-p", *login, *argv],
                           input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return p.returncode, p.stdout

    def upload(self, iid: str, target: str, tar: bytes) -> None:
        """Unpacks a tar into the instance's filesystem at `target` (~ is its home)."""
        inst = self._running(iid)
        if target != "~" and not target.startswith("~/"):
            raise CloudError(f"upload target {target!r}: only paths under ~/ are supported")
        where = Path(inst["node"]) / "homes/ubuntu" / target[2:]
        where.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(where, filter="tar")

    def connect(self, iid: str, port: int) -> socket.socket:
        """A TCP connection to the instance's own 127.0.0.1:port (what `ssh -L` reaches)."""
        inst = self._running(iid)
        result: dict = {}

        def inside():  # setns applies to this thread only; the socket keeps the namespace
            with open(f"/proc/{inst['pid1']}/ns/net") as ns:
                _setns(ns.fileno())
            try:
                result["sock"] = socket.create_connection(("127.0.0.1", port), timeout=10)
            except OSError as e:
                result["error"] = e

        t = threading.Thread(target=inside)
        t.start()
        t.join()
        if "error" in result:
            raise result["error"]
        result["sock"].settimeout(None)
        return result["sock"]

    def metadata(self, iid: str, path: str) -> str | None:
        """The instance's metadata at `path` (under latest/meta-data), or None: EC2 answers 404."""
        inst = self.instances.get(iid)
        if inst is None:
            return None
        return {"instance-id": iid, "local-ipv4": inst["ip"]}.get(path) or inst.get("metadata", {}).get(path)

    def spot_notice(self, iid: str, after_s: float) -> None:
        """EC2's spot interruption notice in the instance's metadata; the instance ends `after_s`
        later, without grace, whatever runs on it."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + after_s))
        self.instances[iid].setdefault("metadata", {})["spot/instance-action"] = json.dumps(
            {"action": "terminate", "time": when})
        self.shutdown_later(iid, after_s)

    def shutdown_later(self, iid: str, after_s: float) -> None:
        timer = threading.Timer(after_s, self.terminate, (iid,))
        timer.daemon = True
        timer.start()

    def listing(self) -> list[dict]:
        with self.lock:
            return [{k: i[k] for k in ("id", "ip", "tags", "state", "type")} for i in self.instances.values()]

    def _running(self, iid: str) -> dict:
        inst = self.instances.get(iid)
        if inst is None or inst["state"] != "running":
            raise CloudError(f"instance {iid} is not running")
        return inst

    def leftovers(self, but: str = "") -> list[int]:
        """Host PIDs of anything still running in any instance this cloud ever started (`but` one)."""
        return self._alive(*{i["pidns"] for i in self.instances.values() if i["id"] != but})

    @staticmethod
    def _alive(*spaces: str) -> list[int]:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") in spaces:
                    left.append(int(pid))
            except OSError:
                continue
        return left


class CloudError(Exception):
    pass


def serve(cloud: Cloud, host: str, port: int = 0) -> ThreadingHTTPServer:
    """The cloud's API on the bridge address, running until the cloud is closed."""

    class Api(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the test reads the cloud's state, not its log
            pass

        def _reply(self, code: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _route(self, fn) -> None:
            try:
                try:
                    self._reply(200, fn())
                except CloudError as e:
                    self._reply(409, {"error": str(e)})
                except Exception as e:  # a broken request must not take the cloud down
                    self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            except OSError:  # the caller is gone: an instance that asked to end itself
                self.close_connection = True

        def _text(self, code: int, text: str) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            parts = self.path.strip("/").split("/", 4)  # imds/IID/latest/meta-data/PATH
            if parts[0] == "imds":
                if self.headers.get("X-aws-ec2-metadata-token") != IMDS_TOKEN:
                    return self._text(401, "")
                value = cloud.metadata(parts[1], parts[4]) if len(parts) == 5 and parts[3] == "meta-data" else None
                return self._text(200 if value else 404, value or "")
            self._route(cloud.listing)

        def do_POST(self):
            parts = self.path.strip("/").split("/")
            body = self._body()
            if parts == ["instances"]:
                req = json.loads(body)
                self._route(lambda: cloud.launch(req["node_config"], req["tags"], req["count"]))
            elif len(parts) == 3 and parts[2] == "tags":
                self._route(lambda: cloud.instances[parts[1]]["tags"].update(json.loads(body)))
            elif len(parts) == 3 and parts[2] == "run":
                req = json.loads(body)

                def run():
                    code, out = cloud.exec(parts[1], req["argv"])
                    return {"code": code, "output": out.decode(errors="replace")}
                self._route(run)
            elif len(parts) == 3 and parts[2] == "shutdown":
                after = float(json.loads(body).get("after_s", 0))
                self._route(lambda: cloud.shutdown_later(parts[1], after))
            else:
                self._reply(404, {"error": self.path})

        def do_PUT(self):  # /instances/ID/files?to=~/target, or IMDSv2's token
            url = urllib.parse.urlsplit(self.path)
            body = self._body()
            if url.path.startswith("/imds/") and url.path.endswith("/latest/api/token"):
                ok = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                return self._text(200 if ok else 400, IMDS_TOKEN if ok else "")
            self._route(lambda: cloud.upload(url.path.strip("/").split("/")[1],
                                             urllib.parse.parse_qs(url.query)["to"][0], body))

        def do_DELETE(self):
            parts = self.path.strip("/").split("/")
            self._route(lambda: cloud.terminate(parts[1]))

        def do_CONNECT(self):
            iid, port = self.path.rsplit(":", 1)
            try:
                remote = cloud.connect(iid, int(port))
            except (CloudError, OSError) as e:
                self._reply(502, {"error": str(e)})
                return
            self.send_response(200)
            self.end_headers()
            _pipe(self.connection, remote)
            self.close_connection = True

    server = ThreadingHTTPServer((host, port), Api)
    server.daemon_threads = True
    cloud.server, cloud.port = server, server.server_address[1]
    cloud.api = f"http://{host}:{cloud.port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _build_image(image: Path, n_paths: int) -> None:
    """The AMI: a venv that sees the runtime packages, the provider module, and the shims."""
    (image / "bin").mkdir(parents=True, exist_ok=True)
    python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()  # the image's python3: ours
    (image / "bin/python3").unlink(missing_ok=True)
    (image / "bin/python3").symlink_to(python)
    if not (image / "venv/bin/python").exists():
        subprocess.run([str(python), "-m", "venv", str(image / "venv")], check=True)
    site = next((image / "venv/lib").glob("python3*/site-packages"))
    # The packages are the host's, bound at image/pyN in each instance (the host's may be under /tmp)
    mounts = [image / f"py{i}" for i in range(n_paths)]
    for m in mounts:
        m.mkdir(exist_ok=True)
    (site / "zz_cn_image.pth").write_text("".join(f"{m}\n" for m in mounts))
    shutil.copy(__file__, site / "local_cloud.py")
    (image / "venv/bin/ray").write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -c '
                                        '"import sys; sys.argv[0] = \'ray\'; from ray.scripts.scripts import main; main()" "$@"\n')
    os.chmod(image / "venv/bin/ray", 0o755)
    for name in SHIMS:
        shim = image / "bin" / name
        shim.write_text(f"#!/usr/bin/python3\nimport sys\nsys.path.insert(0, {str(site)!r})\n"
                        f"from local_cloud import shim\nsys.exit(shim({name!r}, sys.argv[1:]))\n")
        os.chmod(shim, 0o755)


def _copy_venv(image_venv: Path, to: Path) -> None:
    """The image's venv as if it had been built at ~/venv (its scripts name their python)."""
    shutil.copytree(image_venv, to, symlinks=True)
    for script in (to / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            text = script.read_bytes()
            if text.startswith(f"#!{image_venv}/bin/python".encode()):
                script.write_bytes(text.replace(str(image_venv).encode(), f"{NODE_HOME}/venv".encode(), 1))


def shim(name: str, args: list[str]) -> int:
    """The image's sudo, apt-get, systemctl and shutdown, run inside an instance."""
    if name == "sudo":
        os.execvp("env", ["env", *args])
    if name == "apt-get":
        if "install" not in args:
            return 0
        wanted = [a for a in args[args.index("install") + 1:] if not a.startswith("-")]
        missing = [p for p in wanted if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                                       text=True).stdout != "install ok installed"]
        if missing:
            print(f"E: Unable to locate package {' '.join(missing)} (not in this image)", file=sys.stderr)
            return 100
        return 0
    if name == "systemctl":
        if args[:1] in (["restart"], ["start"]) and args[1:] == ["redis-server"]:
            pidfile = Path("/run/redis/redis-server.pid")
            if pidfile.exists():
                subprocess.run(["kill", pidfile.read_text().strip()], check=False)
                time.sleep(0.5)
            return subprocess.run(["redis-server", "/etc/redis/redis.conf", "--daemonize", "yes",
                                   "--supervised", "no"]).returncode
        return 0
    if name == "shutdown":
        when = next((a for a in args if not a.startswith("-")), "now")
        after = 0.0 if when == "now" else float(when.lstrip("+")) * 60
        _call(os.environ["CN_SIM_API"], "POST", f"/instances/{os.environ['CN_SIM_INSTANCE']}/shutdown",
              {"after_s": after})
        return 0
    raise SystemExit(f"no shim {name}")


def router_mac(subnet: int) -> str:
    """Locally administered, one a subnet (10.SUBNET.0.0/24; the `ray up` tests' clouds take 100-199,
    tests/test_local_cloud.py 200-249)."""
    return f"02:cb:00:00:{subnet:02x}:01"


def add_router(bridge: str, gateway: str, mac: str) -> None:
    """The VPC's router: a bridge holding the gateway's address (the cloud's API, S3 and relay
    listen there). Its MAC is set, as a VPC router's does not change: a bridge left to itself
    takes the lowest MAC of its ports, so ending the instance whose port held it changed the
    gateway's MAC, and every other instance lost the gateway for ~30 s, until its ARP entry was
    renewed (most likely what left a resumed day's first mails unanswered for 70 s in one suite run,
    and two of its accounts failed: tests/test_local_cloud.py shows the 30 s)."""
    _sh(f"ip link add {bridge} type bridge")
    try:
        _sh(f"ip link set {bridge} address {mac} && ip addr add {gateway}/24 dev {bridge} && ip link set {bridge} up")
    except Exception:
        _sh(f"ip link del {bridge}", check=False)
        raise


def plug(ns: str, veth: str, bridge: str, ip: str, gateway: str) -> None:
    """An instance's network: namespace `ns`, its eth0 at `ip` on the router's bridge (`veth` is
    the host's end), routed through the gateway. `ip netns del` ends it, veth and all."""
    _sh(f"ip netns add {ns} && ip link add {veth} type veth peer name eth0 netns {ns} "
        f"&& ip link set {veth} master {bridge} up && ip -n {ns} addr add {ip}/24 dev eth0 "
        f"&& ip -n {ns} link set eth0 up && ip -n {ns} link set lo up && ip -n {ns} route add default via {gateway}")


# ----------------------------------------------------------------------------- Ray's side

def _call(api: str, method: str, path: str, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(api + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=3600) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raise CloudError(json.loads(e.read()).get("error", str(e))) from None


try:
    from ray.autoscaler._private.command_runner import _with_environment_variables
    from ray.autoscaler.command_runner import CommandRunnerInterface
    from ray.autoscaler.node_provider import NodeProvider
except ImportError:  # the shims run without Ray
    CommandRunnerInterface = NodeProvider = object


class LocalCloudProvider(NodeProvider):
    def __init__(self, provider_config: dict, cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.api = provider_config["api"]

    def _nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in _call(self.api, "GET", "/instances")}

    def non_terminated_nodes(self, tag_filters: dict) -> list[str]:
        return [i for i, n in self._nodes().items() if n["state"] == "running"
                and n["tags"].get("ray-cluster-name") == self.cluster_name
                and all(n["tags"].get(k) == v for k, v in tag_filters.items())]

    def is_running(self, node_id: str) -> bool:
        return self._nodes().get(node_id, {}).get("state") == "running"

    def is_terminated(self, node_id: str) -> bool:
        return not self.is_running(node_id)

    def node_tags(self, node_id: str) -> dict:
        return self._nodes()[node_id]["tags"]

    def external_ip(self, node_id: str) -> str:
        return self._nodes()[node_id]["ip"]

    internal_ip = external_ip

    def create_node(self, node_config: dict, tags: dict, count: int):
        ids = _call(self.api, "POST", "/instances", {"node_config": node_config,
                                                     "tags": {**tags, "ray-cluster-name": self.cluster_name},
                                                     "count": count})
        return {i: {} for i in ids}

    def set_node_tags(self, node_id: str, tags: dict) -> None:
        _call(self.api, "POST", f"/instances/{node_id}/tags", tags)

    def terminate_node(self, node_id: str):
        _call(self.api, "DELETE", f"/instances/{node_id}")

    def get_command_runner(self, log_prefix, node_id, auth_config, cluster_name, process_runner, use_internal_ip,
                           docker_config=None):
        return LocalCloudCommandRunner(self.api, node_id, log_prefix)


class LocalCloudCommandRunner(CommandRunnerInterface):
    """SSH's part, through the cloud's API."""

    def __init__(self, api: str, node_id: str, log_prefix: str = ""):
        self.api, self.node_id, self.log_prefix = api, node_id, log_prefix

    def run(self, cmd=None, timeout=120, exit_on_fail=False, port_forward=None, with_output=False,
            environment_variables=None, run_env="auto", ssh_options_override_ssh_key="", shutdown_after_run=False,
            silent=False):
        if shutdown_after_run:
            cmd += "; sudo shutdown -h now"
        if port_forward:
            for local, remote in port_forward if isinstance(port_forward, list) else [port_forward]:
                _forward(self.api, self.node_id, local, remote)
            if not cmd:
                while True:  # like `ssh -N -L`: hold the tunnel until interrupted
                    time.sleep(3600)
        if environment_variables:
            cmd = _with_environment_variables(cmd, environment_variables)
        login = ["bash", "--login", "-c", "-i",
                 f"source ~/.bashrc; export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore && ({cmd})"]
        result = _call(self.api, "POST", f"/instances/{self.node_id}/run", {"argv": login})
        if (not silent and not with_output) or result["code"]:
            sys.stdout.write(result["output"])
            sys.stdout.flush()
        if result["code"]:
            import click

            raise click.ClickException(f"Command failed (exit {result['code']}):\n\n  {cmd}\n")
        return result["output"].encode() if with_output else None

    def run_rsync_up(self, source, target, options=None):
        excludes = (options or {}).get("rsync_exclude") or []
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            if os.path.isdir(source):
                for path in sorted(Path(source).rglob("*")):
                    rel = path.relative_to(source).as_posix()
                    if not any(fnmatch.fnmatch(part, x.removeprefix("**/")) for x in excludes for part in rel.split("/")):
                        t.add(path, rel, recursive=False)
                dest = target
            else:
                t.add(source, os.path.basename(target.rstrip("/")))
                dest = os.path.dirname(target.rstrip("/")) or "~"
        dest = "~" + dest[len(NODE_HOME):] if dest.startswith(NODE_HOME) else dest
        _call(self.api, "PUT", f"/instances/{self.node_id}/files?to={urllib.parse.quote(dest.rstrip('/') or '~')}",
              raw=buf.getvalue())

    def run_rsync_down(self, source, target, options=None):
        raise NotImplementedError("the local cloud copies files up only")

    def remote_shell_command_str(self):
        return f"# the local cloud has no SSH: use its API (instance {self.node_id})\n"

    def run_init(self, *, as_head, file_mounts, sync_run_yet):
        return None


def _forward(api: str, node_id: str, local: int, remote: int) -> None:
    """Listens on 127.0.0.1:local; each connection is CONNECTed to the instance's port."""
    host, port = api.split("//", 1)[1].rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", int(local)))

    def accept():
        while True:
            client, _ = listener.accept()
            upstream = socket.create_connection((host, int(port)))
            upstream.sendall(f"CONNECT {node_id}:{remote} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = upstream.recv(1)
                if not chunk:
                    break
                head += chunk
            if b" 200 " not in head.split(b"\r\n", 1)[0]:
                client.close()
                upstream.close()
                continue
            threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    def one_way(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    t = threading.Thread(target=one_way, args=(b, a), daemon=True)
    t.start()
    one_way(a, b)
    t.join()


def _setns(fd: int) -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "setns")


def _child(pid: int) -> int:
    import psutil

    deadline = time.time() + 10
    while time.time() < deadline:
        kids = psutil.Process(pid).children()
        if kids:
            return kids[0].pid
        time.sleep(0.05)
    raise CloudError(f"no init process under {pid}")


def _sh(cmd: str, check: bool = True) -> None:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if check and p.returncode:
        raise CloudError(f"{cmd}: {p.stderr.strip()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["variant"] and len(sys.argv) == 4:
        sys.stdout.write(variant(Path(sys.argv[2]).read_text(), sys.argv[3]))
    else:
        sys.exit("usage: local_cloud.py variant CLUSTER_YAML API_URL")
