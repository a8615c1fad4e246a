"""The cluster's CA (pipeline/tls/ca.py), the workers' enrollment (enroll.py) and the
head's Redis as cluster.yaml configures it, against a real redis-server, openssl and redis-cli:
whoever has no certificate from the cluster's CA is refused. tests/test_ray_up.py does the same
for Ray and Redis on a `ray up` cluster, with a packet capture between its nodes."""

from __future__ import annotations

import shlex
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import redis
import yaml

from pipeline.tls import ca as tls_ca, enroll
from pipeline.embedded import free_port, wait_for_port
from pipeline.settings import ROOT, Settings

TOKEN = b"the-cluster-ray-token"


def _redis_directives() -> list[str]:
    """The TLS and port lines cluster.yaml's head_setup_commands write into redis.conf."""
    setup = " ".join(yaml.safe_load((Path(ROOT) / "cluster.yaml").read_text())["head_setup_commands"])
    words = shlex.split(setup[setup.index("printf '%s\\n'"):].split("|")[0])[2:]
    return [w for w in words if w.startswith(("tls-", "port"))]


@pytest.fixture
def head(tmp_path):
    folder = tmp_path / "head"
    assert tls_ca.init_head(folder, "127.0.0.1")
    return folder


@pytest.fixture
def head_redis(tmp_path, head):
    """redis-server with cluster.yaml's TLS lines (its files put where the head has them)."""
    port = free_port()
    conf = ["port 0"]
    for line in _redis_directives():
        key, value = line.split(" ", 1)
        value = {"6380": str(port)}.get(value, value).replace("/etc/redis/tls", str(head))
        conf.append(f"{key} {value}")
    conf += ["bind 127.0.0.1", "save ''", f"dir {tmp_path}", "user default on nopass ~* &* +@all",
             "user cn on >pw ~* &* +@all"]
    (tmp_path / "redis.conf").write_text("\n".join(conf) + "\n")
    process = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process, "redis-server", own=True)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def test_cluster_yaml_makes_redis_tls_only_with_client_certificates():
    lines = _redis_directives()
    assert "port 0" in " ".join(yaml.safe_load((Path(ROOT) / "cluster.yaml").read_text())["head_setup_commands"])
    assert "tls-port 6380" in lines and "tls-auth-clients yes" in lines
    assert {line.split()[0] for line in lines} >= {"tls-cert-file", "tls-key-file", "tls-ca-cert-file"}


def test_the_head_s_ca_signs_its_certificate_keeps_its_keys_private_and_survives_a_second_ray_up(head):
    for name in ("ca.key", "node.key"):
        assert stat.S_IMODE((head / name).stat().st_mode) == 0o600
    verify = subprocess.run(["openssl", "verify", "-CAfile", head / "ca.crt", head / "node.crt"],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", head / "node.crt", "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True).stdout
    assert "IP Address:127.0.0.1" in text
    ca, cert = (head / "ca.crt").read_bytes(), (head / "node.crt").read_bytes()
    assert tls_ca.init_head(head, "127.0.0.1") is False
    assert (head / "ca.crt").read_bytes() == ca and (head / "node.crt").read_bytes() != cert


@pytest.fixture
def service(head):
    server = enroll.serve(head, TOKEN, host="127.0.0.1", port=free_port())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_a_worker_proved_with_the_token_gets_a_certificate_for_its_own_address_only(tmp_path, head, service):
    worker = tmp_path / "worker"
    enroll.enroll(worker, "127.0.0.1", TOKEN, port=service)

    assert (worker / "ca.crt").read_bytes() == (head / "ca.crt").read_bytes()
    assert not (worker / "ca.key").exists(), "the CA's key stays on the head"
    assert stat.S_IMODE((worker / "node.key").stat().st_mode) == 0o600
    assert subprocess.run(["openssl", "verify", "-CAfile", worker / "ca.crt", worker / "node.crt"]).returncode == 0
    sans = subprocess.run(["openssl", "x509", "-in", worker / "node.crt", "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True).stdout
    assert "IP Address:127.0.0.1" in sans and sans.count("IP Address") == 1  # where it asked from, and loopback


def test_a_machine_with_the_token_that_the_cloud_does_not_list_gets_nothing(tmp_path, head):
    def cloud_says(nodes):
        server = enroll.serve(head, TOKEN, host="127.0.0.1", port=free_port(), members=nodes)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def unreachable():
        raise ConnectionError("the cloud's API")

    for nodes, said in ((lambda: {"10.0.0.11", "10.0.0.12"}, "not a node of this cluster"),
                        (unreachable, "could not read the cluster's nodes")):
        server = cloud_says(nodes)
        try:
            with pytest.raises(tls_ca.TlsError, match=said):
                enroll.enroll(tmp_path / "outsider", "127.0.0.1", TOKEN, port=server.server_address[1])
        finally:
            server.shutdown()
    assert not (tmp_path / "outsider").exists()


def test_without_the_token_the_head_issues_nothing(tmp_path, service):
    with pytest.raises(tls_ca.TlsError, match="refused"):
        enroll.enroll(tmp_path / "stranger", "127.0.0.1", b"a-guess", port=service)
    assert not (tmp_path / "stranger").exists()


def test_a_worker_takes_no_ca_from_a_head_that_cannot_prove_the_token(tmp_path, service):
    """An impostor answering for the head (here, the real service keyed with another token)."""
    with pytest.raises(tls_ca.TlsError):
        enroll.enroll(tmp_path / "worker", "127.0.0.1", TOKEN + b"x", port=service)
    other = tmp_path / "other-head"
    tls_ca.init_head(other, "127.0.0.1")
    impostor = enroll.serve(other, b"not-the-cluster-token", host="127.0.0.1", port=free_port())
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    try:
        with pytest.raises(tls_ca.TlsError):
            enroll.enroll(tmp_path / "worker", "127.0.0.1", TOKEN, port=impostor.server_address[1])
    finally:
        impostor.shutdown()
    assert not (tmp_path / "worker" / "ca.crt").exists()


def test_the_head_s_redis_refuses_plain_clients_and_certificates_of_another_ca(tmp_path, head, head_redis):
    port = head_redis
    plain = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, timeout=20)
    assert "PONG" not in plain.stdout
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_timeout=5).ping()
    no_cert = subprocess.run(["redis-cli", "--tls", "--cacert", head / "ca.crt", "-p", str(port), "ping"],
                             capture_output=True, text=True, timeout=20)
    assert "PONG" not in no_cert.stdout
    stranger = tmp_path / "stranger"
    tls_ca.init_head(stranger, "127.0.0.1")  # a CA of its own, with a certificate for the right address
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(Settings.from_env({"REDIS_URL": f"rediss://cn:pw@127.0.0.1:{port}/0",
                                                "CN_TLS_DIR": str(stranger)}).redis_url, socket_timeout=5).ping()

    url = Settings.from_env({"REDIS_URL": f"rediss://cn:pw@127.0.0.1:{port}/0", "CN_TLS_DIR": str(head)}).redis_url
    assert redis.Redis.from_url(url, socket_timeout=5).ping()
    with pytest.raises(redis.AuthenticationError):  # the certificate lets a client talk; the ACL still decides
        redis.Redis.from_url(url.replace("cn:pw@", "cn:wrong@"), socket_timeout=5).ping()
