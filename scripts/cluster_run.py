"""What `ray submit --tmux cluster.yaml scripts/cluster_run.py DATE INPUT_URL` runs on the head.

The head's redis-server holds the state; storage is the bucket in CN_STORE (set it, with
SMTP_URL, CN_OWNER_PASSWORD and the signing key, in the head's environment). The driver
sizes the cluster for the day, runs it, writes the report and tears the cluster down.
"""

import os
import sys

sys.path.insert(0, os.path.expanduser("~/contract_notes"))

from pipeline.__main__ import main  # noqa: E402

if __name__ == "__main__":
    date, input_url, *rest = sys.argv[1:]
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    os.environ.setdefault("RAY_ADDRESS", "auto")
    sys.exit(main(["run", "--date", date, "--input", input_url, "--deadline-min", "25", *rest]))
