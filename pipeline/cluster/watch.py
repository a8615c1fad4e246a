"""Follow a day's Ray job from the laptop, and say in one line when the head is gone.

`ray job logs -f` ends a lost head's day with a traceback, or with nothing at all while an SSH
tunnel waits on an instance that no longer answers. The head holds the driver, so only the
laptop can tell: when the job API has not answered for `silence_s`, this says so once, with the
run id it saw and the command that resumes it (docs/operations.md, "When the head is lost").
"""

from __future__ import annotations

import re
import sys
import time

import requests

LOST = 3  # the exit status of a lost head: neither the day's 0/1 nor a refused start's 2
RUN_LINE = re.compile(r"\brun (\d{4}-\d{2}-\d{2}-[\w-]+):")  # the driver's log lines name their run
TERMINAL = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}


class NoSuchJob(Exception):
    """The head answered, and has no such job: a typo, not a lost head."""


def watch(address: str, job_id: str, silence_s: float = 30.0, poll_s: float = 2.0, out=sys.stdout) -> int:
    """Print the job's log as it grows; its end as the job's exit (0 succeeded, 1 otherwise), or
    LOST once the head has been silent for `silence_s`."""
    from pipeline.cluster.ray_private import job_api_headers

    headers = job_api_headers()  # the token `ray job` itself sends (RAY_AUTH_MODE=token)
    printed, run_id, heard = 0, "", time.monotonic()
    while True:
        try:
            job = _get(f"{address}/api/jobs/{job_id}", headers)
            logs = _get(f"{address}/api/jobs/{job_id}/logs", headers)["logs"]
        except NoSuchJob:
            print(f"error: no job {job_id!r} at {address}", file=sys.stderr)
            return 2
        except (requests.RequestException, ValueError, KeyError):
            silent = time.monotonic() - heard
            if silent >= silence_s:
                print(lost_line(address, job_id, run_id, silent), file=sys.stderr)
                return LOST
            time.sleep(poll_s)
            continue
        heard = time.monotonic()
        new = logs[printed:]
        out.write(new)
        out.flush()
        printed = len(logs)
        found = RUN_LINE.findall(new)  # the new lines only: a day's log is megabytes by its end
        run_id = found[-1] if found else run_id
        if job.get("status") in TERMINAL:
            print(f"job {job_id}: {job['status']}", file=sys.stderr)
            return TERMINAL[job["status"]]
        time.sleep(poll_s)


def lost_line(address: str, job_id: str, run_id: str, silent_s: float) -> str:
    resume = (f"ray down, ray up, then submit the day again with --run-id {run_id}" if run_id else
              "ray down, ray up, then submit the day again with the run id its report names")
    return (f"error: the head ({address}) has not answered for {silent_s:.0f} s: it is lost, and job {job_id} "
            f"with it. The record in storage is not: {resume} (docs/operations.md, 'When the head is lost')")


def _get(url: str, headers: dict) -> dict:
    reply = requests.get(url, headers=headers, timeout=5)
    if reply.status_code == 404:
        raise NoSuchJob(url)
    reply.raise_for_status()
    return reply.json()
