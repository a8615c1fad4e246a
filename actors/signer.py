"""SignerActor: holds the signing key and certificate chain, signs and archives batches.

The key is read once, when the actor starts, from the cluster's secret store (CN_SECRET) or
the settings' files; a bad path, secret or password fails there, with the cause. While the
key's HSM is lost, the run's meta says since when (the live page, the driver's log). Ray neither
restarts a crashed actor nor re-runs its batch: the fleet (pipeline/cluster/fleet.py) drops it
and resends the batch to a living one. Archiving is create-only, so a resent batch keeps the
first attempt's notes and mails those bytes.
"""

from __future__ import annotations

import os
import threading
import time

import ray

from actors import metrics
from pipeline import credentials
from pipeline.record.state import RunState
from pipeline.record.storage import open_store, tell
from pipeline.seal.sign import SignatureInfo
from pipeline.seal.signer import BATCHES_AT_ONCE
from pipeline.settings import Settings
from pipeline.stages import Batch, sign_stage


# Out of order: a batch is signed once its render has ended, not after the batches submitted
# before it (in order, the signer waited on the first chain's render while others were ready).
# Threaded: two calls at most; as many sign at once as the key's Signer.batches_at_once (one for a key
# in this process), the other waiting its turn.
@ray.remote(num_cpus=0, resources={"signer": 1}, allow_out_of_order_execution=True, max_concurrency=BATCHES_AT_ONCE)
class SignerActor:
    def __init__(self, settings: Settings, run_id: str):
        self.settings, self.signer = credentials.read(settings)  # one read of the secret
        self.info = SignatureInfo(settings.sign_reason, settings.sign_location, settings.sign_contact)
        self.store = open_store(settings.store_url, run=settings)
        self.state = RunState.of(self.settings, run_id)
        notes = RunState.of(self.settings, run_id, patience_retries=0)  # said now or not at all: never waited on
        self.signer.tell(lambda since: notes.note_wait("hsm", since))  # the page: waiting for the HSM since ...
        tell(settings.store_url, lambda since: notes.note_wait("store", since))
        self.turns = threading.Semaphore(self.signer.batches_at_once)
        self.cpu = SharedCpu()

    def sign(self, batch: Batch) -> Batch:
        with self.turns:
            started, before = time.perf_counter(), len(batch.items)
            self.cpu.start()
            try:
                batch = sign_stage(batch, self.signer, self.settings.owner_password, self.settings.encryption,
                                   self.store, self.state, self.info)
            finally:
                spent = self.cpu.end()
            batch.cpu_s["sign"] = spent  # not the process's CPU while it ran, which holds the other batch's too
        metrics.observe("sign", {"ok": len(batch.items), "failed": before - len(batch.items)},
                        time.perf_counter() - started)
        return batch

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The node it runs on: the pool chooses it once it has answered, and drops it with its node."""
        return ray.get_runtime_context().get_node_id()


class SharedCpu:
    """The process's CPU shared out among calls that run together: each, as it ends, takes what
    the process spent since the last one ended, or since the process went from idle to busy. Their
    sum is the process's CPU while any ran, counted once (the report adds them up); a call alone
    takes its own; which of two overlapping calls takes what is arbitrary."""

    def __init__(self):
        self._lock, self._running, self._mark = threading.Lock(), 0, 0.0

    def start(self) -> None:
        with self._lock:
            if not self._running:
                self._mark = time.process_time()
            self._running += 1

    def end(self) -> float:
        with self._lock:
            now = time.process_time()
            spent, self._mark, self._running = now - self._mark, now, self._running - 1
            return spent
