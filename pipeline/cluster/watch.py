"""Follow a day's Ray job from the laptop, and say in one line when the head is gone.

`ray job logs -f` ends a lost head's day with a traceback, or with nothing at all while an SSH
tunnel waits on an instance that no longer answers. The head holds the driver, so only the
laptop can tell, and a silent address is not yet a lost head: the tunnel (`ray dashboard
cluster.yaml`) may have dropped, or the address may be mistyped, and the lost head's advice
(`ray down`) would end a healthy day. So when the job API has not answered for `silence_s`:
- an address that never answered is said as such (exit NEVER), nothing about the head;
- otherwise the cloud is asked for the head instance's state, through Ray's node provider for
  the cluster's config (as `ray up` and `ray down` ask it): a running head means the tunnel
  dropped (said once, and the watch goes on, so a tunnel opened again resumes it); a head the
  cloud no longer runs is lost, said once with the run id that resumes the day (exit LOST;
  docs/operations.md, "When the head is lost").
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Callable

import requests

LOST = 3  # the exit status of a lost head: neither the day's 0/1 nor a refused start's 2
NEVER = 4  # nothing ever answered at the address: a typo or no tunnel, not a lost head
RUN_LINE = re.compile(r"\brun (\d{4}-\d{2}-\d{2}-[\w-]+):")  # the driver's log lines name their run
TERMINAL = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}
RUNNING, GONE = "running", "gone"  # the head instance's state as the cloud says it; else why it could not say


class NoSuchJob(Exception):
    """The head answered, and has no such job: a typo, not a lost head."""


def head_state(config: str) -> str:
    """RUNNING or GONE by the cloud's own account of the cluster's head instance, or why the
    cloud could not be asked (no config, no credentials, the API unreachable)."""
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

    from pipeline.cluster.plan import node_provider

    logging.getLogger("ray.autoscaler").setLevel(logging.ERROR)  # its bootstrap's notes are not the watch's
    try:
        provider = node_provider(config)
        heads = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD})
        return RUNNING if any(provider.is_running(h) for h in heads) else GONE
    except Exception as e:  # whatever the provider raises (boto's, a missing file): not an answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class Silence:
    """What the watch has heard: whether the address ever answered, since when it is silent,
    and whether the dropped tunnel was already said."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.answered, self.heard, self.said_tunnel = clock, False, clock(), False
        self.asked = float("-inf")

    def heard_now(self) -> None:
        if self.said_tunnel:
            print("watch: the head answers again", file=sys.stderr)
        self.answered, self.heard, self.said_tunnel = True, self.clock(), False

    def silent_s(self) -> float:
        return self.clock() - self.heard


def watch(address: str, job_id: str, silence_s: float = 30.0, poll_s: float = 2.0, out=sys.stdout,
          cloud: Callable[[], str] = lambda: "no cluster config given") -> int:
    """Print the job's log as it grows; its end as the job's exit (0 succeeded, 1 otherwise),
    NEVER if the address never answered within `silence_s`, or LOST once the address has been
    silent for `silence_s` and `cloud()` does not say the head runs."""
    from pipeline.cluster.ray_private import job_api_headers

    headers = job_api_headers()  # the token `ray job` itself sends (RAY_AUTH_MODE=token)
    printed, run_id, silence = 0, "", Silence()
    while True:
        try:
            job = _get(f"{address}/api/jobs/{job_id}", headers)
            logs = _get(f"{address}/api/jobs/{job_id}/logs", headers)["logs"]
        except NoSuchJob:
            print(f"error: no job {job_id!r} at {address}", file=sys.stderr)
            return 2
        except (requests.RequestException, ValueError, KeyError):
            ended = _on_silence(silence, silence_s, address, job_id, run_id, cloud)
            if ended is not None:
                return ended
            time.sleep(poll_s)
            continue
        silence.heard_now()
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


def _on_silence(silence: Silence, silence_s: float, address: str, job_id: str, run_id: str,
                cloud: Callable[[], str]) -> int | None:
    """The watch's exit status once a silence means something, else None (keep watching). The
    cloud is asked at most once every `silence_s`: an EC2 call a poll would be a storm."""
    silent = silence.silent_s()
    if silent < silence_s:
        return None
    if not silence.answered:
        print(never_line(address), file=sys.stderr)
        return NEVER
    if silence.clock() - silence.asked < silence_s:
        return None
    silence.asked = silence.clock()
    state = cloud()
    if state == RUNNING:
        if not silence.said_tunnel:
            print(tunnel_line(address, silent), file=sys.stderr)
            silence.said_tunnel = True
        return None
    print(lost_line(address, job_id, run_id, silent, "" if state == GONE else state), file=sys.stderr)
    return LOST


def never_line(address: str) -> str:
    return f"error: nothing ever answered at {address}: is the address right? `ray dashboard cluster.yaml` opens it"


def tunnel_line(address: str, silent_s: float) -> str:
    return (f"warning: the head is running but its address does not answer ({address}, {silent_s:.0f} s): your "
            "tunnel (`ray dashboard cluster.yaml`) may have dropped; open it again and this watch goes on")


def lost_line(address: str, job_id: str, run_id: str, silent_s: float, unasked: str = "") -> str:
    """The lost head's one line; `unasked`: why the cloud could not say, so the tunnel is
    checked before anything is torn down."""
    resume = (f"ray down, ray up, then submit the day again with --run-id {run_id}" if run_id else
              "ray down, ray up, then submit the day again with the run id its report names")
    if unasked:
        return (f"error: the head ({address}) has not answered for {silent_s:.0f} s and the cloud could not say "
                f"whether it runs ({unasked}): if `ray dashboard cluster.yaml`'s tunnel is up, the head is lost, "
                f"and job {job_id} with it. The record in storage is not: {resume} "
                "(docs/operations.md, 'When the head is lost')")
    return (f"error: the head ({address}) has not answered for {silent_s:.0f} s and the cloud no longer runs it: "
            f"it is lost, and job {job_id} with it. The record in storage is not: {resume} "
            "(docs/operations.md, 'When the head is lost')")


def _get(url: str, headers: dict) -> dict:
    reply = requests.get(url, headers=headers, timeout=5)
    if reply.status_code == 404:
        raise NoSuchJob(url)
    reply.raise_for_status()
    return reply.json()
