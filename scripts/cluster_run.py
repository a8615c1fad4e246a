"""What `ray submit --tmux cluster.yaml scripts/cluster_run.py DATE INPUT_URL` (or `ray job
submit ... -- python scripts/cluster_run.py DATE INPUT_URL`) runs on the head.

The settings are scripts/cluster.env's (every node sources it); the secrets are read from
CN_SECRET by the actors. Anything missing stops here, with one line and exit status 2,
before a worker is asked for. The driver sizes the cluster for the day, runs it, writes the
report to the bucket and ends the cluster. The exit status is the run's (0, 1 or 2), so a
failed day is a FAILED Ray job.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.__main__ import main  # noqa: E402

REDIS_PORT = 6380  # the head's redis-server (cluster.yaml); Ray's GCS has 6379


def missing_settings(env: dict[str, str]) -> str | None:
    """Why this cluster could not run the day, or None."""
    store = env.get("CN_STORE", "")
    if not store.startswith("s3://") or "YOUR-BUCKET" in store:
        return (f"CN_STORE={store!r}: set it to the day's bucket (s3://...) in scripts/cluster.env; a folder on "
                "the head is not reachable from the workers")
    if not env.get("CN_SECRET"):
        return "CN_SECRET is not set (scripts/cluster.env): the signer nodes read the key and passwords from it"
    from pipeline.credentials import fetch, resolve
    from pipeline.settings import ConfigError, Settings, tls_files

    try:
        settings = resolve(Settings.from_env(env))
    except ConfigError as e:
        return str(e)
    if settings.smtp_url == Settings.smtp_url:
        return f"no relay: put smtp_url in the secret {env['CN_SECRET']} (or set SMTP_URL)"
    if not fetch(env["CN_SECRET"]).get("redis_password"):
        return (f"no redis_password in the secret {env['CN_SECRET']}: the head's Redis takes no client without "
                "one (python -m pipeline secret-json makes it; then `ray up` again)")
    tls = env.get("CN_TLS_DIR", "")
    if not tls or not all(os.path.exists(f) for f in tls_files(tls)):
        return (f"CN_TLS_DIR={tls!r} has no certificate from the cluster's CA (scripts/cluster.env; `ray up` makes "
                "it): the head's Redis and Ray take nothing in the clear")
    return None


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: cluster_run.py DATE INPUT_URL [run options]")
    problem = missing_settings(os.environ)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        from pipeline.cluster.plan import end_cluster, on_cluster

        if on_cluster():  # `ray up` again once the settings are right
            end_cluster()
        sys.exit(2)
    date, input_url, *rest = sys.argv[1:]
    from ray.util import get_node_ip_address  # the head's private IP: where the workers reach its Redis

    # user cn: its password is the secret's (pipeline/record/redis_acl.py), laid over by the driver; over
    # TLS with this node's certificate (CN_TLS_DIR), which every node has at the same path
    os.environ.setdefault("REDIS_URL", f"rediss://cn@{get_node_ip_address()}:{REDIS_PORT}/0")
    os.environ.setdefault("RAY_ADDRESS", "auto")
    sys.exit(main(["run", "--date", date, "--input", input_url, "--deadline-min", "25", *rest]))
