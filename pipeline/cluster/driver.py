"""The Ray fan-out: split, then per shard render -> sign+archive -> mail, through object refs.

The driver holds shard ids and a bounded window of refs, never the day's data: a batch of
PDFs goes from the render task to a signer actor to a mailer actor without coming here.
What comes back is each shard's small tally. A shard whose chain fails for good has its
unfinished accounts recorded as failed with the cause, so nothing is silently dropped. The
signer and mailer actors, and what happens when one dies, are the fleet's (fleet.py): this
module keeps the day's schedule.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import ray
import redis
from ray.job_config import JobConfig
from tqdm import tqdm

from actors import metrics
from pipeline import credentials
from pipeline.cluster import capacity, first_notes, fleet
from pipeline.cluster.fleet import why
from pipeline.cluster.waits import DayWaits
from pipeline.followup import located, opened
from pipeline.cluster.page_ranges import render_notes
from pipeline.cluster.plan import on_cluster
from pipeline.cluster.split_tasks import Split, cancel_tasks
from pipeline.day import trading_calendar
from pipeline.day.split import check_inputs
from pipeline.mail.message import message_id
from pipeline.errors import NotInRun
from pipeline.cluster.memory import peak_rss_mb
from pipeline.record import day_claim, delivery_log, keys, made_with, report, run_log
from pipeline.record.guard import StateLostError
from pipeline.record.lease import Lease, LeaseLostError, held
from pipeline.record.manifest import SplitResult, load_first_notes, load_manifest, record_made_with, save_manifest
from pipeline.record.records import Outcome, rejected_at_validation
from pipeline.record.rates import RedisBuckets
from pipeline.record.state import RunState, redis_client
from pipeline.record.statuses import final_status
from pipeline.record.storage import NoObject, StorageError, Store, check_create_only, open_store, tell
from pipeline.seal.signer import Signer
from pipeline.settings import ROOT, ConfigError, Settings, parse_smtp_url
from pipeline.stages import (Batch, broker, forced_again, forced_unanswered, load_shard, render_stage,
                             restore_from_log)

log = logging.getLogger("pipeline.cluster.driver")
FIRST_NOTES = 4  # a fresh run's first chain carries a few notes of a light shard, not a whole one:
# the first mail leaves a render, a sign and a send of 4 notes after the split, not of 100
SPLIT_HOLD_S = 3.0  # joining a one-machine Ray, how long the split waits for the first notes to reach the relay (_run_day)
TAIL_PARTS = 4  # the day's last shards go in quarters: the chains still at the signer when the renders end
# are its work alone (one signer, 4 of 6 chains queued: 3.4 s at 1.2 cores of 2 in a 2,000-account run)
MALLOC_ARENAS = 2  # glibc malloc arenas per process, driver and workers (see _few_malloc_arenas)
WORKER_MALLOC = "libjemalloc.so.2"  # the allocator Ray's processes run with, where installed (see workers_environment)
COMPILE_THREADS = 1  # threads of the pool Typst compiles on, a Ray process's (see workers_environment)
# A task's name says its kind, never its shard: Ray 2.60 keeps about 4 KB in the driver for each distinct
# task name, for the driver's life (8,000 named chains: +32 MB; the same chains under 10 names: +2 MB), and a
# day of 1.5M accounts has 15,360 shards.


@dataclass(frozen=True)
class RunRequest:
    trade_date: str
    input_url: str
    run_id: str = ""
    only: frozenset[str] | None = None  # a targeted rerun: just these accounts
    force: bool = False  # mail again even if the account was delivered
    resend_unconfirmed: bool = False  # mail unconfirmed accounts again, with the same Message-ID
    relays: str = ""  # mail through these (URLs without credentials; a rerun: its run's), not SMTP_URL's
    bounce_window_h: float | None = None  # the demo's own window, 0 included; a real run's is CN_BOUNCE_WINDOW_H


def new_run_id(trade_date: str) -> str:
    return f"{trade_date}-{uuid.uuid4().hex[:8]}"


GENERATED_RUN_ID = re.compile(r"(\d{4}-\d{2}-\d{2})-[0-9a-f]{8}\Z")  # new_run_id's: its trade date first


def init_ray(settings: Settings, address: str | None = None) -> None:
    """Join a running cluster if one is named (RAY_ADDRESS) or this is a `ray up` head (the
    notebook there), else start Ray on this machine, declaring the same role resources a
    cluster's node types advertise."""
    if ray.is_initialized():
        return
    address = _ray_address(address)
    _few_malloc_arenas()
    if address and address.startswith("ray://"):  # Ray client's connection cannot carry a JobConfig
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": ROOT}}, log_to_driver=False)
        return
    if address:  # the nodes' environment is theirs (a `ray up` cluster's: scripts/cluster.env)
        ray.init(address=address, job_config=job_config(), log_to_driver=False)
        return
    # A local Ray's workers inherit this process's environment: set here, the workers Ray
    # starts with it take the first tasks. Given as a runtime_env instead, the first tasks
    # waited for new workers with that environment (two empty tasks: 2.1 s, not 0.4 s).
    os.environ.setdefault("MALLOC_ARENA_MAX", str(MALLOC_ARENAS))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    # One signer slot, not one per core: a second signer's start delayed the first note by
    # 0.5-1.6 s and cost 4-7 CPU-s a run, as much as the idle end it saved (2,000 accounts).
    cores = os.cpu_count() or 1
    with _secrets_kept_from_children():
        with workers_environment():
            # "local": a new Ray whatever /tmp/ray/ray_current_cluster says (a `ray start` once run on this machine
            # left it; Ray then joined that address, or refused num_cpus, and the command ended in a traceback)
            ray.init(address="local", num_cpus=cores,
                     resources={"render": cores, "signer": settings.signers or 1, "smtp": settings.mailers or 1},
                     include_dashboard=False, log_to_driver=False, object_store_memory=512 * 1024 * 1024)
        _start_reaper()


def job_config() -> JobConfig:
    """A job whose workers find pipeline/ on the path it hands them (Ray puts a job's
    `py_driver_sys_path` on each of its workers' sys.path), not through a runtime_env: a job
    with one has each of its workers started through Ray's setup_worker.py, a second Python
    start (~0.7 CPU-s a worker), and cannot take the workers `ray start` had waiting (four
    empty tasks on a running Ray: 0.4-1.2 s, not 1.9-2.0; the first note on a running Ray at
    20,000 accounts, six runs alternating on one hour: median 4.2 s, not 5.8). Ray adds the
    driver's folder itself; this names pipeline/'s wherever the command was typed."""
    return JobConfig(_py_driver_sys_path=[ROOT])


@contextmanager
def workers_environment():
    """Ray's processes, and so every worker, start with jemalloc preloaded where it is installed,
    and with a pool of COMPILE_THREADS for Typst.
    - jemalloc: Typst, qpdf and OpenSSL allocate and free millions of small blocks a day: perf
      put 11% of the stages' CPU in glibc's malloc and free, most in its bin searches and
      consolidations. The stages one after another in one process, 2,000 accounts: 6.9-7.0 ms
      a note, not 7.4-7.7 (render 4.26-4.33 against 4.61-4.86, sign 1.90-2.08 against 2.12-2.32).
    - Typst lays out and writes a compile's pages on rayon's pool, one thread a core unless
      RAYON_NUM_THREADS says otherwise, whose idle threads spin before they sleep. A render
      worker holds one of Ray's CPUs: on one thread a typical note's compile took 2.30-2.32 ms
      of CPU, not 2.44-2.46 (three runs each, alternating), and a c6a.8xlarge's 32 workers do
      not start 32 threads each.
    A `ray up` cluster's nodes get both through scripts/cluster.env. Only Ray's processes: this
    one has started, and what it starts later (the embedded services, the reaper) keeps its own."""
    before = {name: os.environ.get(name) for name in ("LD_PRELOAD", "RAYON_NUM_THREADS")}
    if ctypes.util.find_library("jemalloc") == WORKER_MALLOC and WORKER_MALLOC not in (before["LD_PRELOAD"] or ""):
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [WORKER_MALLOC, before["LD_PRELOAD"]]))
    os.environ.setdefault("RAYON_NUM_THREADS", str(COMPILE_THREADS))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _secrets_kept_from_children():
    """Ray's processes (and every worker they start) inherit the environment they start with:
    the secret settings (the PIN, the owner password, the Redis URL's password...) are taken out
    of it meanwhile. What a worker needs of them comes as its task's settings, read once here."""
    names = [f.metadata["env"] for f in dataclasses.fields(Settings) if not f.repr]
    kept = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(kept)


def _ray_address(address: str | None) -> str | None:
    """The cluster to join; None: Ray is started on this machine."""
    return address or os.environ.get("RAY_ADDRESS") or ("auto" if on_cluster() else None)


def _few_malloc_arenas() -> None:
    """glibc gives each thread Ray starts in the driver a malloc arena of its own (up to 8 per
    core); what the day's tasks free fragments across them, so the driver's RSS crept up with
    the day (151 -> 159 MB from 2,000 to 10,000 accounts; with 2 arenas 150 -> 152 MB). A
    local Ray's processes get the same through MALLOC_ARENA_MAX (init_ray), a `ray up`
    cluster's through scripts/cluster.env; this process has started, so mallopt."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, MALLOC_ARENAS)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc (musl has no arenas to limit)
        pass


_reaper: subprocess.Popen | None = None


def _start_reaper() -> None:
    """A watcher that ends this local Ray's processes if the driver is killed (see reaper.py);
    it holds the read end of a pipe only this process writes to, so it sees the death."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        _reaper = subprocess.Popen([sys.executable, "-m", "pipeline.cluster.reaper", str(os.getpid())], cwd=ROOT,
                                   stdin=subprocess.PIPE, start_new_session=True)


RENDER_SLOT = {"num_cpus": 1, "resources": {"render": 1}}  # a render task's: one of a render node's slots


@ray.remote(**RENDER_SLOT, max_retries=3)
def render_task(settings: Settings, run_id: str, trade_date: str, shard: int,
                only: frozenset[str] | None, force: bool = False, resume: bool = False, assembled=None,
                part: tuple[int, int | None] | None = None, lease: str = "", skip: frozenset[str] = frozenset(),
                rows: bytes | None = None, log_end: delivery_log.Link | None = None) -> Batch:
    """`assembled`: the ref of the split task writing this shard; Ray starts this task once it is
    done, with what it wrote. `part`: just these of the shard's accounts (start, stop), as a slice. `lease`: the
    token of the run's lease, which the batch carries to the signer and the mailer. `skip`: accounts
    the driver mails itself (its first notes). `rows`: the shard file's bytes, read once for all the
    parts of a shard (shard_rows_task); else this task reads it. `log_end`: where the driver saw the
    shard's delivery log end, carried to the mailer."""
    started = time.perf_counter()
    if assembled is not None and shard not in assembled["shards"]:  # its every account was rejected: no file
        return Batch(run_id, trade_date, shard, lease=lease)
    state = RunState.of(settings, run_id)
    store = open_store(settings.store_url, run=settings)
    accounts = load_shard(store, run_id, shard, rows)
    if resume:  # what the delivery log knows goes back into Redis before the shard is mailed
        restore_from_log(store, state, run_id, shard, {a["ucc"] for a in accounts})
    if part is not None:
        accounts = accounts[part[0]:part[1]]
    if skip:
        accounts = [a for a in accounts if a["ucc"] not in skip]
    settles = trading_calendar.settlement_dates(trade_date, settings.holidays_file)
    batch = render_stage(Batch(run_id, trade_date, shard, settles=settles, lease=lease, broker_file=settings.broker_file,
                               log_end=log_end),
                         accounts, state,
                         set(only) if only else None, partial(render_notes, tagged=settings.pdf_tags), force,
                         lambda ucc: store.exists(keys.signed_pdf_key(trade_date, ucc)), settings.encryption)
    metrics.observe("render", {"ok": len(batch.items), **batch.dropped}, time.perf_counter() - started)
    return batch


@ray.remote(num_cpus=0, resources={"render": 0.001}, max_retries=3)  # a GET: on a render node, no slot held
def shard_rows_task(settings: Settings, run_id: str, shard: int, assembled=None) -> bytes | None:
    """A shard file, read once for the shard's parts (the day's tail, cut in TAIL_PARTS): each
    part's render task takes these bytes from Ray's object store, where each read the file
    (on S3, a 2,000-account day's shard GETs went from 38 to 20). The file stays the record. This task does
    nothing else, so an object lost with its node is read again by Ray running it again."""
    if assembled is not None and shard not in assembled["shards"]:  # no file: the render task says so
        return None
    return open_store(settings.store_url, run=settings).get(keys.shard_key(run_id, shard))


def run_day(settings: Settings, req: RunRequest, on_accounts: Callable[[int], None] | None = None,
            watch: Callable[[], None] = lambda: None, lease: Lease | None = None, address: str | None = None,
            checked: tuple[Settings, Signer] | None = None) -> dict:
    """One run, end to end. `on_accounts` hears the day's account count once the split has
    counted it (on a cluster: to ask the autoscaler for the capacity the day needs); `watch` is
    called about once a second while the driver waits (on a cluster: that capacity arrives).
    The run's lease is taken first (LeaseHeldError if a live driver has it), unless `lease`
    is one this process already holds (a rerun that brought the run back from storage).
    Ray is started (or `address` joined, as init_ray does) unless it is already: a fresh run's
    first notes are made meanwhile. `checked`: what `preflight` returned for these settings
    (anchored, and a resumed run's made with its own: made_with.resumed) and this run, when the
    caller ran it already."""
    run_id = keys.check_run_id(req.run_id or new_run_id(req.trade_date))
    settings = settings.anchored()  # the store and keys as absolute locations: recorded, and the same on every worker
    if req.run_id and checked is None:  # a resumed run's: as it made them
        settings = made_with.resumed(settings, run_id)
    state = RunState.of(settings, run_id)
    with nullcontext(lease) if lease else held(state, settings.lease_s) as lease:
        meta = state.meta()
        finished = meta.get("finished")  # Redis holds the whole run, finished: a rerun's stop can end it again
        if req.run_id:  # `run --run-id` as much as `rerun`: nothing is mailed under a run whose close began
            opened.refuse_closed(open_store(settings.store_url), run_id, meta)
        checked = checked or preflight(settings, req, run_id)
        with run_log.shipped(open_store(settings.store_url), run_id):  # a run that starts: its log kept with it
            try:
                return _run_day(settings, req, run_id, state, lease, on_accounts, watch, address, checked)
            except BaseException as e:
                if finished and not lease.lost and not isinstance(e, (LeaseLostError, StateLostError)):
                    _stopped_again(settings, state, run_id, req.only, e)
                raise


def _stopped_again(settings: Settings, state: RunState, run_id: str, only: frozenset[str] | None,
                   e: BaseException) -> None:
    """A finished run's rerun (or resume) that stopped, where Redis held the whole run (not one
    it is rebuilding: its records are whole only at its end). The run is finished again, now,
    rather than left "running" by the start that cleared its end (status, the page and close go by it;
    `runs` by the report, written again from Redis so that the two agree), and its bounce
    window runs from now, after the last mail this driver could have sent. An account a rerun
    took and left without an outcome is failed, with why (unconfirmed if its mail was claimed).
    Whatever fails here is logged: the stop's own error is the one raised."""
    stopped = f"{type(e).__name__}: {e}"[:300]
    try:
        if state.meta().get("finished") != "":
            return  # stopped before its start cleared the run's end: as it stands
        store = open_store(settings.store_url, run=settings)
        if only:
            _fail_accounts(settings, run_id, sorted(only), f"the rerun stopped: {stopped}")
        finished = time.time()
        state.update_meta(finished=finished, notes_per_s="")
        report.rewrite(store, state, run_id, settings.paper_due_days,
                       {"finished_at": finished, "last_started_at": float(state.meta().get("last_started") or finished),
                        "last_stopped": stopped})
    except Exception as failed:
        log.warning("run %s: its rerun stopped, and its end was not recorded (%s): `status` says running until a "
                    "rerun or `run --run-id` ends", run_id, failed)


def _run_day(settings: Settings, req: RunRequest, run_id: str, state: RunState, lease: Lease,
             on_accounts: Callable[[int], None] | None, watch: Callable[[], None], address: str | None,
             checked: tuple[Settings, Signer]) -> dict:
    started = time.time()
    store = open_store(settings.store_url, run=settings)
    resolved, signer = checked
    notes = RunState.of(settings, run_id, patience_retries=0)  # said now or not at all: never waited on
    signer.tell(partial(notes.note_wait, "hsm"))  # its first notes'
    tell(settings.store_url, partial(notes.note_wait, "store"))  # the page: waiting for the store since ...
    warnings = trading_calendar.trade_date_warnings(req.trade_date, settings.holidays_file)
    for warning in warnings:
        log.warning("run %s: %s", run_id, warning)
    manifest, made = load_manifest(store, run_id), load_first_notes(store, run_id)
    resume = manifest is not None or made is not None  # mail may have gone out: each shard restores its delivery log first
    # What a resumed run recorded is kept: its relays (a rerun's --smtp mails through others without
    # replacing them), its bounce window, and its first start: from Redis, else from its report
    kept, began = state.meta() if resume else {}, {}
    if resume and not kept:
        log.warning("run %s: Redis has no state for it; rebuilding from the delivery log before mailing", run_id)
        stored = report.of_run(store, run_id) or {}
        kept = {"relays": stored.get("relays", ""), "bounce_window_h": stored.get("bounce_window", {}).get("hours")}
        if first := report.started_at(stored):
            began = {"started": first}
    relays = req.relays or kept.get("relays") or resolved.relays()
    if resume and req.only is None:  # a rerun says it in its own words
        log.info("run %s: mailing through %s (%s)", run_id, relays,
                 "--smtp" if req.relays else "the run's own" if kept.get("relays") else "SMTP_URL or the secret's")
    window = report.window_h(kept) if req.bounce_window_h is None else req.bounce_window_h
    record = located.recorded(settings, resolved, signer.cert)
    if signer.about.get("extractable"):
        log.warning("run %s: the signing key on token %r is marked extractable (CKA_EXTRACTABLE): it can leave the HSM",
                    run_id, signer.about["token"])
    made_record, begun = _made_with_record(settings, state, manifest, made)
    if manifest is not None and manifest.complete and made_with.strengthened(made_record, manifest.made_with):
        record_made_with(store, run_id, made_record)  # the run keeps it from now on, after Redis too
    if begun and (told := made_with.taken(settings, made_record)):  # said in the run's own log, which storage keeps
        log.warning("run %s: made with this shell's %s, as CN_SHELL_SETTINGS asks; the run's record keeps its own",
                    run_id, ", ".join(f"{made_with.ENV[f]}={v!r}" for f, v in told.items()))
    epoch = state.start({"date": req.trade_date, "input": req.input_url, "config": json.dumps(settings.summary()),
                         "bounce_window_h": settings.bounce_window_h if window is None else window,
                         "relays": kept.get("relays") or relays, **record, "finished": "", "notes_per_s": "",
                         "message_ids": "keyed",  # by the run's HMAC key (a run from before: unkeyed)
                         **made_record,
                         "signing_key": json.dumps(signer.about), **began})  # a file's, or a token's (never the key, the PIN)
    state.clear_waits()  # an earlier run's note (its actors ended while they waited) is not this one's
    early = None  # on one machine, a fresh run's first notes: on a cluster the head neither signs nor mails
    if not resume and req.only is None and _ray_address(address) is None:
        early = first_notes.start(settings, resolved, signer, run_id, req.trade_date, open_store(req.input_url, run=settings), store,
                                  state, lease.token, _render_cpus() if ray.is_initialized() else os.cpu_count() or 1)
    # A local Ray starts meanwhile, in this thread: Ray's processes get SIGKILL when the thread
    # that started them ends (PR_SET_PDEATHSIG), so it is the first notes that take a thread.
    init_ray(settings, address)
    if not on_cluster():  # a Ray joined by its address may lack a role: said, waited for, then the run stops
        roles, then = capacity.by_hand(settings.capacity_wait_s), watch

        def watch() -> None:
            roles.check()
            then()
    actors = fleet.start(settings, run_id, req.force, req.resend_unconfirmed, req.relays)  # booting while the split runs
    splitting = None
    try:  # the pools' actors end with the run, whatever ends it (a CapacityError in the split too)
        if early is None and not resume and req.only is None:  # joined a running Ray: rendered here, mailed by the pools
            lead = Chain(-1, None)
            lead.signer, lead.mailer = actors.take(starting=True)  # the first actors, as they start
            early = lead.first = first_notes.start(settings, resolved, None, run_id, req.trade_date,
                                                   open_store(req.input_url, run=settings), store, state, lease.token, _render_cpus(),
                                                   partial(_handed, lead))
            early.chain = lead
            if split_beside_pools(ray.nodes()):
                # The split starts once they are mailed, or SPLIT_HOLD_S after they were handed
                # over. Started at once, its workers' boots took the cores the pools' first actors
                # started, signed and mailed on: the first note reached the relay 3.4-4.6 s into a
                # 20,000-account day, and 1.97-2.47 s when the split waited. On a cluster its
                # workers start on render nodes, apart: it does not wait there.
                early.join()
                if early.sent is not None:
                    ray.wait([early.sent], timeout=SPLIT_HOLD_S, fetch_local=False)
        split = manifest if manifest is not None and manifest.complete else None
        if split is None:  # a run splits its input once; a rerun reuses the shards and their note numbers
            numbered = early.numbered if early else lambda: (made or {}).get("numbers", {})
            splitting = Split.start(credentials.for_render(settings), run_id, req.trade_date, req.input_url,
                                    _render_cpus(), resume, watch, early.plan.result() if early else None, numbered,
                                    manifest.groups if manifest else 0,
                                    manifest.shard_count if manifest else (made or {}).get("shard_count", 0))
            splitting.recorded = made_record  # a resumed split's manifest keeps the run's record (or none, as before)
            save_manifest(store, run_id, splitting.partial())
            log.info("run %s: dumps read after %.1f s, %d shards being assembled", run_id, time.time() - started,
                     len(splitting.weights))
            shards, expected = splitting.shards(), splitting.clients()
        else:
            _split_done(store, state, run_id, split, on_accounts, started, save=False)
            shards, expected = split.heaviest_first(split.shards), split.accounts
        # a fresh split whose first notes the driver did not make: a light shard, among the first assembled, leads
        leads = splitting and not resume and req.only is None and not (early and early.numbered())
        first = splitting.lead(watch) if leads else None
        if req.only is not None:  # a targeted rerun visits only the shards holding its accounts
            wanted = {keys.shard_of(u, (split or splitting.partial()).shard_count) for u in req.only}
            shards, expected = [s for s in shards if s in wanted], len(req.only)

        def watching() -> None:
            nonlocal split
            if split is None and (done := splitting.done()) is not None:
                split = _split_done(store, state, run_id, done, on_accounts, started)
            watch()

        actors.started(watching)
        cut = _tail(_window(settings, fleet.look().slots)) if splitting and not resume and req.only is None else 0
        tally = _fan_out(settings, run_id, req, _units(shards, first, cut, settings.shard_size), expected, actors,
                         resume, epoch, lease, watching,
                         splitting.after if splitting else lambda shard: None, early, splitting.rows if splitting else {})
    except BaseException as e:
        if splitting is not None:  # its assemblies not left queued in a Ray that lives on (a notebook's)
            splitting.cancel()
        if isinstance(e, capacity.CapacityError):  # it says to run the same run id again: which one
            e.args = (f"run {run_id}: {e}; a mail the stop cut short is unconfirmed: `reconcile`, then "
                      f"`rerun {run_id} --unconfirmed`",)
        raise
    finally:
        actors.close()
    if split is None:
        split = _split_done(store, state, run_id, splitting.done(block=True), on_accounts, started)
    log.info("run %s: %d notes through the chain after %.1f s", run_id, tally["notes"], time.time() - started)
    finished = time.time()
    elapsed = finished - started
    worked = tally["notes"] - tally["statuses"].get("skipped", 0)  # a rerun skips delivered accounts
    rate = round(worked / elapsed, 2) if elapsed > 0 else 0.0
    state.update_meta(finished=finished, notes_per_s=rate)  # the run's rate: the page's and the report's one figure
    state.keep()
    meta = state.meta()
    summary = {
        "run_id": run_id,
        "trade_date": req.trade_date,
        "input": req.input_url,
        **state.final_counts(meta),  # accounts, delivered ... paper_owed: as every view of the run counts them
        "delivered_now": tally["statuses"].get("ok", 0),
        "physical_now": tally["statuses"].get("physical", 0),
        "unconfirmed_now": tally["statuses"].get("unconfirmed", 0),  # claimed under this driver, no answer recorded
        "failed_now": tally["statuses"].get("failed", 0),  # failed under this driver (a rerun's: _left_now)
        "nothing_due": split.nothing_due,  # clients whose every trade was cancelled or moved to another: no note is due
        "nothing_due_accounts": split.nothing_due_accounts,
        "left_to_other_entities": split.left_to_others,  # trades of segments another entity's run makes notes for
        "started_at": float(meta.get("started") or started),  # the run's first start, a rerun's too
        "last_started_at": float(meta.get("last_started") or started),  # this driver's: a rerun's own start
        "finished_at": finished,  # the bounce window runs from here
        "elapsed_s": round(elapsed, 3),  # this driver's time
        "notes_per_s": rate,
        "cpu_ms_per_note": {k: round(v * 1000 / max(1, worked), 2) for k, v in tally["cpu_s"].items()},
        "actors": {"signers": actors.signers.peak, "mailers": actors.mailers.peak},
        "nodes": tally.get("nodes", {}),  # lost and drained mid-run, and the actors lost with them
        "resent_chains": tally.get("resent", 0),  # batches sent again to living actors
        "waited_s": _waited(tally),  # how long batches were held waiting on a dependency (the HSM), by what
        "relays": meta.get("relays") or relays,  # the run's own, kept in the report for a later rerun
        "message_ids": meta.get("message_ids", ""),  # how its Message-IDs were made, for a run brought back
        **{k: v for k, v in meta.items() if k in made_with.KEYS},  # what a rerun's notes are made with
        **record,  # where its record and keys are: what a command after the day opens
        "driver_peak_rss_mb": peak_rss_mb(),
    }
    if warnings:
        summary["warnings"] = warnings
    if lease.taken_over_from:
        summary["lease_taken_over_from"] = lease.taken_over_from
    summary["report"] = report.write(store, state, run_id, summary, split.input_errors, settings.paper_due_days)
    return summary


def split_beside_pools(nodes: list[dict]) -> bool:
    """Whether a node of `nodes` (ray.nodes()) both renders and signs or mails (one machine: a
    laptop's Ray, the bench's): there the split's workers would start on the cores the pools'
    first actors start on."""
    return any(r.get("render") and (r.get("signer") or r.get("smtp"))
               for r in (node["Resources"] for node in nodes if node["Alive"]))


def _render_cpus() -> int:
    return int(ray.cluster_resources().get("render", 0))


def preflight(settings: Settings, req: RunRequest, run_id: str = "",
              require_persistence: bool = False) -> tuple[Settings, Signer]:
    """What would stop the run, found before anything starts: Redis unreachable (or keeping
    nothing on disk, when persistence is required), storage not writable, an input file
    missing or lacking a column (unless the run was already split), no calendar for the date,
    a signing key, DKIM key or secret that cannot be read, a store that takes a second create-only write.
    Before any actor asks for a node. Returns the settings with the secret laid over them, and
    the signing key they read (its certificate is recorded with the run)."""
    where = settings.summary()["redis_url"]
    try:
        r = redis_client(settings.redis_url, patience_retries=0)  # down at the start: say so at once
        r.ping()
        if require_persistence and not _persists(r):
            raise ConfigError(f"Redis at {where} keeps nothing on disk (appendonly no, no save points): a restart "
                              "would forget which clients were mailed; turn on AOF (appendonly yes), or pass "
                              "--accept-volatile-redis")
    except redis.RedisError as e:
        raise ConfigError(f"Redis at {where} cannot be reached: {e}") from None
    store = open_store(settings.store_url)
    try:
        store.put(keys.WRITE_CHECK, b"ok")  # one small PUT a run, overwritten each time
    except Exception as e:  # OSError, botocore: whatever the backend says, the run cannot keep its record
        raise StorageError(f"storage {settings.store_url} cannot be written: {e}") from None
    begun = bool(run_id) and started(store, run_id)
    if run_id:
        check_create_only(store, keys.create_only_check_key(run_id))
    if begun:
        _of_its_date(settings, store, run_id, req.trade_date)
    if not run_id or load_manifest(store, run_id) is None:
        if closed := trading_calendar.no_session(req.trade_date, settings.holidays_file):
            raise ConfigError(f"--date {req.trade_date}: no exchange traded that day ({closed})")
        seen = check_inputs(open_store(req.input_url), req.trade_date)
        if seen and (closed := trading_calendar.no_session(req.trade_date, settings.holidays_file, seen)):
            raise ConfigError(f"--date {req.trade_date}: no exchange of the day's trades traded that day (the first "
                              f"and last rows of trades.csv are on {', '.join(sorted(seen))}: {closed})")
    trading_calendar.settlement_dates(req.trade_date, settings.holidays_file)
    broker(settings.broker_file)  # the issuing entity's file: a bad one refused here, not at the first note
    credentials.dkim_signer(settings)  # loaded again by each mailer: here only to refuse a bad one at the start
    checked = credentials.read(settings)
    if run_id and not begun:  # last: a run refused above leaves the date to the next
        day_claim.claim(store, req.trade_date, run_id, partial(started, store))
    return checked


def started(store: Store, run_id: str) -> bool:
    """Whether a run got as far as its split or its first notes (it may have archived and mailed)."""
    return load_manifest(store, run_id) is not None or load_first_notes(store, run_id) is not None


def rerun(settings: Settings, run_id: str, accounts: list[str] | None = None, failed: bool = False,
          force: bool = False, unconfirmed: bool = False, relays: str | None = None, store: str | None = None,
          address: str | None = None) -> dict:
    """Targeted rerun of an existing run: the failed accounts, the unconfirmed ones (mailed
    again with the same Message-ID, marked "possible duplicate"), or the ones named. Each
    resumes from where it stopped (an archived note is mailed, not re-rendered); a delivered
    account is mailed again only with force. Accounts rejected at validation cannot be rerun:
    their input must be corrected and run again. A run its Redis has lost is brought back from
    its report and delivery log in storage first (pipeline/followup/restore.py). It mails through
    the run's own relays unless `relays` names others (--smtp), and its own store and keys
    unless `store` names a copy of its record (--store), and says which it uses. Ray is started
    (or `address` joined) only once there is something to rerun: a refusal comes first."""
    with opened.open_run(settings, run_id, store, command="rerun") as run:
        summary = _rerun(run, accounts, failed, force, unconfirmed, relays, address)
    return {**summary, "store": run.settings.store_url, "store_from": run.source}


def _rerun(run: opened.OpenRun, accounts: list[str] | None, failed: bool, force: bool, unconfirmed: bool,
           relays: str | None, address: str | None) -> dict:
    settings, state, lease, run_id, meta = run.settings, run.state, run.lease, run.state.run_id, run.meta()
    recorded = meta.get("relays") or ""
    source = "--smtp" if relays else "the run's own" if recorded else "SMTP_URL or the secret's: the run recorded none"
    relays = relays or recorded or credentials.resolve(settings).relays()
    log.info("rerun %s: mailing through %s (%s)", run_id, relays, source)
    chosen = set(state.failed() if failed else state.unconfirmed() if unconfirmed else accounts or [])
    records = state.accounts(sorted(chosen))
    rejected = rejected_at_validation(records)
    unknown = sorted(chosen - set(records))
    if accounts and unknown:  # named by hand: refused before Ray starts
        cased = sorted(set(state.accounts([u.upper() for u in unknown if u != u.upper()])))
        raise NotInRun(f"run {run_id} has no account {_named(unknown)}"
                       + (f" (client codes are upper-case: {_named(cased)})" if cased else ""))
    only = frozenset(chosen - set(rejected) - set(unknown))
    if not only:
        summary = {"run_id": run_id, **state.final_counts(meta), "delivered_now": 0, "physical_now": 0,
                   "unconfirmed_now": 0, "failed_now": 0, "elapsed_s": 0.0, "notes_per_s": 0.0}
    else:
        for name in RedisBuckets(settings.redis_url).resume([f"relay:{parse_smtp_url(u).name}"
                                                             for u in relays.split(",") if u.strip()]):
            log.warning("rerun %s: %s had spent its daily quota today; the rerun tries it again", run_id, name)
        summary = run_day(settings, RunRequest(meta["date"], meta["input"], run_id, only, force, unconfirmed, relays,
                                               report.window_h(meta)), lease=lease, address=address)
    ended, now = _ended(state, only), state.final_counts()
    if summary.get("report") and any(summary.get(k) != v for k, v in now.items()):  # _ended failed some: said again
        report.rewrite(run.store, state, run_id, settings.paper_due_days)
        summary.update(now)
    summary.update(rerun_accounts=sorted(only), rerun_outcomes=ended, relays=relays,
                   not_rerunnable={"rejected_at_validation": rejected, "not_in_run": unknown})
    if only:
        summary.update(_left_now(state, only, summary["last_started_at"]))
    return summary


def chosen(accounts: str | list[str]) -> dict:
    """The notebook's ACCOUNTS as `rerun`'s arguments: "failed", "unconfirmed", one client code,
    or a list of them (a code given alone was read as its letters)."""
    if accounts in ("failed", "unconfirmed"):
        return {accounts: True}
    return {"accounts": [accounts] if isinstance(accounts, str) else list(accounts)}


def undone(summary: dict) -> dict:
    """What a rerun left undone, from its summary; empty when each account it took ended delivered
    (a bounce standing: owed on paper, or the recipient's server retrying) or on paper and no new
    mail of its own failed or went unanswered. `rerun` exits 1 on it, and the notebook says it,
    then stops."""
    ended = {k: n for k, n in summary.get("rerun_outcomes", {}).items()
             if n and k not in ("delivered", "bounced", "deferred", "physical")}
    return ({"rerun_outcomes": ended} if ended else {}) | {
        k: summary[k] for k in ("failed_now", "unconfirmed_now") if summary.get(k)}


def _left_now(state: RunState, only: frozenset[str], since: float) -> dict[str, int]:
    """The accounts this rerun took whose outcome of it is failed or unconfirmed, from their
    records (a forced one's new mail too, its account still delivered): a chain that failed
    for good never returned its mailer's tally. Its outcomes are stamped on the mailers' and
    this driver's clocks, seconds after `since`, this driver's start."""
    records = state.accounts(sorted(only))
    now = [r["status"] for r in records.values() if r.get("updated", 0.0) >= since]
    return {"failed_now": now.count("failed"), "unconfirmed_now": now.count("unconfirmed")}


def _named(codes: list[str], shown: int = 10) -> str:
    more = len(codes) - shown
    return ", ".join(codes[:shown]) + (f" and {more:,} more" if more > 0 else "")


def _ended(state: RunState, only: frozenset[str]) -> dict[str, int]:
    """What each account the rerun took ended as. One still on its way (pending) is failed,
    with why: a rerun leaves no account without an outcome."""
    records = state.accounts(sorted(only))
    left = [u for u in sorted(only) if final_status(records.get(u, {})) == "pending"]
    state.record(Outcome(u, "delivered", "failed", reason="the rerun ended without an outcome for it (see the log)")
                 for u in left)
    ended: dict[str, int] = {}
    for u in only:
        status = "failed" if u in left else final_status(records.get(u, {}))
        ended[status] = ended.get(status, 0) + 1
    return ended


def _persists(r: redis.Redis) -> bool:
    """AOF on, or RDB save points set. A managed Redis that hides CONFIG counts on AOF alone."""
    if r.info("persistence").get("aof_enabled"):
        return True
    try:
        return bool(r.config_get("save").get("save"))
    except redis.ResponseError:  # CONFIG disabled (managed Redis): not provably persistent
        return False


def _of_its_date(settings: Settings, store: Store, run_id: str, trade_date: str) -> None:
    """A run that began, resumed with another --date than its own, would date, settle and archive
    its notes for a day whose trades they are not (and Redis's date made the other): refused,
    naming its date as Redis, else its report, else its id (a generated one starts with it) says."""
    date = RunState.of(settings, run_id).meta().get("date") or _reported_date(store, run_id) or \
        (made.group(1) if (made := GENERATED_RUN_ID.match(run_id)) else None)
    if date and date != trade_date:
        raise ConfigError(f"run {run_id} is trade date {date}'s, not --date {trade_date}'s: resume it with its own date")


def _reported_date(store: Store, run_id: str) -> str | None:
    """The date its report says; None for a report that cannot be read (edited, cut short): the
    resume it would check does not need it, and writes it anew."""
    try:
        return (report.of_run(store, run_id) or {}).get("trade_date")
    except StorageError:
        return None


def _made_with_record(settings: Settings, state: RunState, manifest: SplitResult | None,
                      made: dict | None) -> tuple[dict, bool]:
    """What a run's start records of what its notes and mails are made with, and whether the run
    began before: a new run, its settings'; a run that began (Redis recorded it, though it died
    before its split wrote anything, or storage did), its own record (Redis's, else its
    manifest's, else its first notes'), never this command's settings, which may take some from
    the shell (CN_SHELL_SETTINGS), but for encryption made stronger (made_with.kept). A run from
    before they were recorded: nothing, so it is not given its first rerun's shell's settings."""
    meta = state.meta()
    if "made_with" in meta:
        return made_with.kept({k: meta[k] for k in made_with.KEYS if k in meta}, settings), True
    if manifest is None and made is None:
        return made_with.recorded(settings), False
    found = (manifest.made_with if manifest else {}) or (made or {}).get("made_with") or {}
    return (made_with.kept(found, settings) if found else {}), True


def _split_done(store, state: RunState, run_id: str, split: SplitResult, on_accounts, started: float,
                save: bool = True) -> SplitResult:
    """Once every shard is written: the manifest (from now on the run's shards are fixed), the
    account count for the status page and, on a cluster, for the capacity the day needs."""
    if save:
        save_manifest(store, run_id, split)
    state.update_meta(accounts=split.accounts + split.rejected, shards=len(split.shards))
    if on_accounts is not None:
        on_accounts(split.accounts)
    log.info("run %s: %d accounts (%d rejected) in %d shards, split after %.1f s", run_id,
             split.accounts + split.rejected, split.rejected, len(split.shards), time.time() - started)
    return split


def _window(settings: Settings, slots: dict) -> int:
    """The chains in flight: two per render CPU of the nodes that stay (`slots`), at least
    CN_WINDOW's default."""
    return settings.window or max(6, 2 * int(slots.get("render", 0)))


def _tail(window: int) -> int:
    """The shards cut in parts at the day's end: enough that the last window of chains is parts,
    and one more. Each part is a mailing of its own, two delivery-log PUTs: cutting a window of
    shards (six quarters in a 2,000-account day) cost 36 of that day's 2,186 S3 requests."""
    return -(-window // TAIL_PARTS) + 1


def _units(shards: list[int], first: int | None, cut: int = 0, shard_size: int = 0) -> list[tuple[int, tuple | None]]:
    """The chains to run, in order: (shard, part). The `first` shard is cut in two, its first
    FIRST_NOTES accounts leading; the last `cut` shards in TAIL_PARTS parts of a shard's size.
    A resumed run never cuts a shard: each restores its delivery log before it mails, once."""
    head = [(first, (0, FIRST_NOTES)), (first, (FIRST_NOTES, None))] if first is not None else []
    rest = [s for s in shards if s != first]
    whole, last = rest[:max(0, len(rest) - cut)], rest[max(0, len(rest) - cut):]
    step = -(-shard_size // TAIL_PARTS)
    parts = [(i * step, (i + 1) * step if i < TAIL_PARTS - 1 else None) for i in range(TAIL_PARTS)]
    return head + [(s, None) for s in whole] + [(s, part) for s in last for part in parts]


class _SharedRows:
    """A shard file's bytes handed to its chains' render tasks through Ray's object store, where
    each would read the file: the day's first shards' as their assembly wrote them (`handed`,
    split_tasks.HANDED_TRADES), and a shard cut in parts at the day's tail read once by a task of
    its own. A ref is let go once the shard's last chain is asked for, so Ray frees the bytes
    when those renders end. A shard cut for the first notes and not handed is not waited on:
    its first part is rendered at once, and its other reads the file."""

    def __init__(self, units: list[tuple[int, tuple | None]], handed: dict[int, ray.ObjectRef]):
        self.left = Counter(shard for shard, _ in units)  # shard -> its chains not yet asked for
        self.cut = {shard for shard, n in Counter(s for s, part in units if part is not None).items()
                    if n == TAIL_PARTS}  # the first notes' shard: in two
        self.refs = handed

    def ref(self, chain: "Chain", settings: Settings, run_id: str,
            assembled: Callable[[int], ray.ObjectRef | None]) -> ray.ObjectRef | None:
        left, ref = self.left.pop(chain.shard, 0), self.refs.pop(chain.shard, None)
        if ref is None and chain.shard in self.cut and chain.first is None and left > 1:
            ref = shard_rows_task.options(name="read shard").remote(settings, run_id, chain.shard,
                                                                     assembled(chain.shard))
        if left > 1:
            self.left[chain.shard], self.refs[chain.shard] = left - 1, ref
        return ref


class Rerun(NamedTuple):
    """A rerun's: its lease's token (whose claims are its own), the accounts it takes, whether
    it mails delivered ones again (`--force`), and when its chains began (epoch seconds)."""
    lease: str
    only: frozenset[str]
    force: bool
    since: float


@dataclass(slots=True)  # one a unit: 15,360 queued at 1.5M accounts
class Chain:
    """One unit's render -> sign -> mail, as the driver tracks it until its tally is in."""
    shard: int
    part: tuple | None
    rendered: ray.ObjectRef | None = None  # the render's batch: a chain sent again is signed and mailed from it
    signer: object = None
    mailer: object = None
    resends: int = 0
    first: first_notes.FirstNotes | None = None  # the first notes' own chain (on a running Ray): theirs, not the shard's


def _fan_out(settings: Settings, run_id: str, req: RunRequest, units: list[tuple[int, tuple | None]], accounts: int,
             actors: fleet.Fleet, resume: bool, epoch: str, lease: Lease, watch: Callable[[], None],
             assembled: Callable[[int], ray.ObjectRef | None], early: first_notes.FirstNotes | None,
             handed: dict[int, ray.ObjectRef]) -> dict:
    totals = {"statuses": {}, "cpu_s": {}, "notes": 0, "waits": {}, "resent": 0}
    skipped = early.skipped if early else lambda shard: frozenset()
    rerun = Rerun(lease.token, req.only, req.force, time.time()) if req.only is not None else None
    pending: dict[ray.ObjectRef, Chain] = {}  # the chain's last ref -> the chain
    again: list[Chain] = []  # chains whose actor was lost: sent again before new ones
    view = fleet.look()
    actors.size(settings, view)
    window = _window(settings, view.slots)
    render_settings = credentials.for_render(settings)
    queue = [Chain(shard, part) for shard, part in reversed(units)]
    rows = _SharedRows(units, handed)
    store_url = settings.store_url
    progress = tqdm(total=accounts, unit="note", desc=f"run {run_id}", file=sys.stderr, smoothing=0.1)
    state, snapshot_at = RunState.of(settings, run_id), 0.0
    waiting = DayWaits(run_id, settings)
    try:
        while queue or again or pending or early:
            while (queue or again) and len(pending) < window and actors.ready():
                chain = again.pop() if again else queue.pop()
                if chain.rendered is None and chain.first is not None:  # lost from the object store: put again
                    chain.rendered = ray.put(chain.first.batch)
                elif chain.rendered is None:
                    chain.rendered = render_task.options(name="render part of a shard" if chain.part else
                                                         "render shard").remote(
                        render_settings, run_id, req.trade_date, chain.shard, req.only, req.force, resume,
                        assembled(chain.shard), chain.part, lease.token, skipped(chain.shard),
                        rows.ref(chain, render_settings, run_id, assembled),
                        delivery_log.known_end(store_url, run_id, chain.shard))
                chain.signer, chain.mailer = actors.take()
                pending[chain.mailer.send.remote(chain.signer.sign.remote(chain.rendered))] = chain
            done = ray.wait(list(pending), num_returns=1, timeout=1.0)[0] if pending else []
            if not pending:  # every chain waits for an actor: a lost node's replacement
                actors.place(timeout=1.0)
            watch()
            for ref in done:
                chain = pending.pop(ref)
                actors.give_back(chain.signer, chain.mailer)
                result = _result(ref, settings, run_id, chain, pending, skipped(chain.shard), actors, rerun)
                if result is None:
                    again.append(chain)
                    totals["resent"] += 1
                else:
                    _count(result, totals, progress)
            if early and not early.running():
                if early.sent is not None:  # handed to the pools: a chain of its own from here on
                    pending[early.sent] = early.chain
                elif early.chain is not None:  # nothing handed: the actors taken for it are free
                    actors.give_back(early.chain.signer, early.chain.mailer)
                _count(_first_notes_done(early, settings, run_id), totals, progress)
                early = None
            if lease.lost:
                raise LeaseLostError(f"run {run_id}: another driver took the run over (this one had not renewed "
                                     f"its lease for {settings.lease_s:.0f} s, CN_LEASE_S): this driver stops")
            if time.monotonic() - snapshot_at >= 1.0 or not (queue or again or pending):
                if state.epoch() != epoch:
                    _stop_mailing(pending, StateLostError(
                        f"Redis lost run {run_id} mid-run (flushed, or restarted without persistence): mailing "
                        "stopped; run the same run id again to rebuild its state from the delivery log"))
                state.snapshot()
                snapshot_at = time.monotonic()
                waiting.look(state.meta())
                if waiting.given_up() and not waiting.ended:
                    _stop_waiting(settings, run_id, queue + again, waiting, skipped, totals, progress, rerun)
                    queue, again = [], []
                view = fleet.look()
                actors.check(view)
                actors.size(settings, view)  # nodes come and go
                window = _window(settings, view.slots)
                actors.place()
        actors.tally(fleet.look())  # a node Ray has declared dead since the last look: counted too
    except BaseException:  # the run stops: its renders and their shard reads not left queued (a notebook's driver lives on)
        cancel_tasks([chain.rendered for chain in [*pending.values(), *again]] + list(rows.refs.values()))
        raise
    finally:
        progress.close()
    state.clear_waits()
    totals["nodes"] = actors.counts()
    return totals


def _count(result: dict, totals: dict, progress: tqdm) -> None:
    waited = _waited(totals)
    _add(totals, result)
    metrics.day(result["tally"])
    for what, seconds in _waited(totals).items():
        metrics.waited(what, seconds - waited.get(what, 0.0))
    progress.update(result["notes"])


def _stop_waiting(settings: Settings, run_id: str, chains: list[Chain], waiting: DayWaits,
                  skipped: Callable[[int], frozenset[str]], totals: dict, progress: tqdm,
                  rerun: Rerun | None = None) -> None:
    """Past the deadline (or, without one, the patience) with a dependency still gone: the
    chains not started are failed at once, for one rerun, and the day says so in one line
    (those in flight fail as they reach the dependency: its wait is spent)."""
    reason = waiting.reason()
    results = [_fail_chain(settings, run_id, c, reason, skipped(c.shard), rerun) for c in chains]
    log.error("%s", waiting.ending(sum(r["notes"] for r in results), rerun is not None and rerun.force))
    for result in results:
        _count(result, totals, progress)


def _stop_mailing(pending: dict, error: Exception) -> None:
    """Mailers refuse claims once Redis lost the run; the chains in flight are given time to
    log what they sent before the run stops, then the error ends it (exit status 2)."""
    log.error("%s", error)
    ray.wait(list(pending), num_returns=len(pending), timeout=120)
    raise error


def _first_notes_done(early: first_notes.FirstNotes, settings: Settings, run_id: str) -> dict:
    """What the driver's first notes came to, once they are done. If their thread failed, each
    of its accounts not finished is failed (or unconfirmed, if its mail was claimed), as a
    chain's are: no shard chain will take them."""
    early.join()
    if early.error is None:
        return early.result or _no_notes()
    if isinstance(early.error, (StateLostError, LeaseLostError)):
        raise early.error
    numbers = early.numbers.result()
    log.error("run %s: the driver's first notes failed: %s", run_id, early.error)
    if not numbers:
        return _no_notes()
    return _fail_accounts(settings, run_id, sorted(numbers), f"shard {early.shard}: first notes: {why(early.error)}")


def _result(ref, settings: Settings, run_id: str, chain: Chain, pending: dict, skip: frozenset[str],
            actors: fleet.Fleet, rerun: Rerun | None = None) -> dict | None:
    """The chain's tally; None when it is to be sent again: its signer or mailer was lost (with
    its node, mostly) and the chain has resends left."""
    try:
        return ray.get(ref)
    except Exception as e:  # a render past its task retries, or an actor lost (the fleet's to resend)
        lost = getattr(e, "cause", None) or e
        if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:  # a new node's actor
            _stop_mailing(pending, fleet.cannot_start(e))
        if isinstance(lost, StateLostError):
            _stop_mailing(pending, StateLostError(str(lost)))
        if isinstance(lost, LeaseLostError):
            raise LeaseLostError(str(lost)) from None
        if actors.take_back(e, chain):
            log.warning("shard %s: sent again to the living actors (%s)", chain.shard, why(e))
            return None
        log.error("shard %s failed: %s", chain.shard, e)
        return _fail_chain(settings, run_id, chain, why(e), skip, rerun)


def _handed(chain: Chain, batch: Batch) -> ray.ObjectRef:
    """The first notes' batch (rendered by the driver) to the actors taken for it; called from
    their thread, it returns the ref the chain ends with."""
    chain.shard, chain.rendered = batch.shard, ray.put(batch)
    return chain.mailer.send.remote(chain.signer.sign.remote(chain.rendered))


def _fail_chain(settings: Settings, run_id: str, chain: Chain, reason: str, skip: frozenset[str],
                rerun: Rerun | None = None) -> dict:
    if chain.first is not None:  # the first notes' own chain: its few accounts, not their shard
        return _fail_accounts(settings, run_id, sorted(chain.first.numbered()), f"shard {chain.shard}: first notes: {reason}")
    return _fail_shard(settings, run_id, chain.shard, reason, chain.part, skip, rerun)


def _fail_shard(settings: Settings, run_id: str, shard: int, reason: str, part: tuple | None = None,
                skip: frozenset[str] = frozenset(), rerun: Rerun | None = None) -> dict:
    try:
        uccs = [a["ucc"] for a in load_shard(open_store(settings.store_url, run=settings), run_id, shard)]
        uccs = uccs[part[0]:part[1]] if part else uccs
    except NoObject:  # never written: its split task failed, and the run stops with that error
        return _no_notes()
    return _fail_accounts(settings, run_id, [u for u in uccs if u not in skip], f"shard {shard}: {reason}", rerun)


def _no_notes() -> dict:
    return {"tally": {}, "cpu_s": {}, "notes": 0}


def _fail_accounts(settings: Settings, run_id: str, uccs: list[str], reason: str,
                   rerun: Rerun | None = None) -> dict:
    """Accounts whose mail was claimed may have reached the relay: unconfirmed, not failed. An
    account with an outcome (delivered, failed with the relay's answer, physical ...) keeps it;
    a rerun's chain answers for the accounts it took alone, and a forced one for their new mail
    (_forced_left)."""
    state = RunState.of(settings, run_id)
    uccs = [u for u in uccs if rerun is None or u in rerun.only]
    records = state.accounts(uccs)
    key = credentials.resolve(settings).hmac_key()
    unfinished = [u for u in uccs if final_status(records.get(u, {})) == "pending"]
    claimed = state.claimed(unfinished)
    outcomes = [Outcome(u, "delivered", "unconfirmed", message_id=message_id(run_id, u, key, settings.message_id_domain),
                        reason=f"{reason}; mail claimed, no answer recorded")
                if u in claimed else Outcome(u, "delivered", "failed", reason=reason)
                for u in unfinished]
    if rerun is not None and rerun.force:
        outcomes += _forced_left(state, records, uccs, rerun, reason)
    state.record(outcomes)
    tally: dict[str, int] = {}
    for o in outcomes:
        tally[o.status] = tally.get(o.status, 0) + 1
    return {"tally": tally, "cpu_s": {}, "notes": len(outcomes)}


def _forced_left(state: RunState, records: dict[str, dict], uccs: list[str], rerun: Rerun, why: str) -> list[Outcome]:
    """A forced rerun's chain that failed for good: each delivered account it took stays
    delivered, and its new mail is said where the rerun recorded nothing of it. Claimed under
    this rerun's lease: unconfirmed (it may have left). Otherwise failed (`rerun --failed
    --force` mails it): still under the mailing before's claim, it never left; its claim let
    go, the relay refused it and the answer was lost with its mailer. (The records' times are
    the mailers' clocks, `since` this driver's: seconds apart, far more than a clock's drift.)"""
    delivered = [u for u in uccs if records.get(u, {}).get("stage") == "delivered"
                 and records[u].get("updated", 0.0) < rerun.since]
    left = []
    for ucc, token in state.claim_tokens(delivered).items():
        if token[:8] == rerun.lease[:8]:
            left.append(Outcome(ucc, "delivered", "unconfirmed", message_id=records[ucc].get("message_id", ""),
                                reason=forced_unanswered(state.run_id, ucc, f"{why}; claimed, no answer recorded")))
        else:
            fate = "it never left" if token else "the relay refused it, and its answer was lost"
            left.append(Outcome(ucc, "delivered", "failed", reason=f"{why}; this forced mail was not delivered "
                                                                   f"({fate}): {forced_again(state.run_id, ucc)}"))
    return left


def _add(totals: dict, result: dict) -> None:
    totals["notes"] += result["notes"]
    for k, v in result["tally"].items():
        totals["statuses"][k] = totals["statuses"].get(k, 0) + v
    for k, v in result["cpu_s"].items():
        totals["cpu_s"][k] = totals["cpu_s"].get(k, 0.0) + v
    for what, start, end in result.get("waits", ()):
        totals["waits"][what] = _union(totals["waits"].get(what, []), start, end)


def _union(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """Disjoint time spans with one more merged in: several batches held by one outage count
    its length once. A day has a few outages, so the list stays short."""
    kept = []
    for s, e in spans:
        if e < start or s > end:
            kept.append((s, e))
        else:
            start, end = min(s, start), max(e, end)
    return sorted(kept + [(start, end)])


def _waited(totals: dict) -> dict[str, float]:
    return {what: round(sum(e - s for s, e in spans), 1) for what, spans in totals.get("waits", {}).items()}
