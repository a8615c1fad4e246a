"""MailerActor: an async actor holding a pool of SMTP connections, mailing batches.

Ray neither restarts a crashed mailer nor re-runs its calls: the fleet (pipeline/cluster/fleet.py)
resends its batches to a living one. The per-account guard in Redis (RunState.claim_mail) makes
the e-mail itself at most once, and a mail the dead attempt had claimed without an answer
becomes `unconfirmed`, never resent blindly.
"""

from __future__ import annotations

import asyncio
import gc
import time

import ray

from actors import metrics
from pipeline import credentials
from pipeline.record.state import RunState
from pipeline.record.storage import open_store, tell
from pipeline.settings import Settings
from pipeline.stages import Batch, mail_context, mail_stage


@ray.remote(num_cpus=0, resources={"smtp": 1})
class MailerActor:
    def __init__(self, settings: Settings, run_id: str, force: bool = False, resend_unconfirmed: bool = False,
                 relays: str = ""):
        # the relays' credentials and the DKIM key may be in the secret: read once, the key loaded once
        self.settings, self.dkim = credentials.for_mailer(settings)
        if relays:  # a rerun mails through its run's relays, with the credentials held here
            self.settings = self.settings.pinned_to(relays)
        self.run_id, self.force, self.resend = run_id, force, resend_unconfirmed
        self.ctx, self.ready = None, asyncio.Lock()

    async def send(self, batch: Batch) -> dict:
        async with self.ready:  # the pool belongs to the actor's event loop, which __init__ does not run on
            if self.ctx is None:
                state = RunState.of(self.settings, self.run_id)
                epoch = await asyncio.to_thread(state.epoch)  # Redis may be away: the loop is not held
                self.ctx = mail_context(self.settings, state, open_store(self.settings.store_url, run=self.settings), self.force,
                                        self.resend, self.dkim, epoch)
                notes = RunState.of(self.settings, self.run_id, patience_retries=0)  # said now or not at all
                self.ctx.pool.told = lambda since: notes.note_wait("relay", since)  # the page: waiting for the relays
                tell(self.settings.store_url, lambda since: notes.note_wait("store", since))
                # Once ready, what lives as long as the actor (Ray's, the pipeline's, the pool's
                # objects) goes to the collector's permanent generation: the oldest generation's
                # collections, which a mailer's churn of small objects sets off every few thousand
                # mails, then scan only what came since. In the mailer's code in one process, one
                # such collection cost 42 us a mail over its 1,200-mail round; frozen, none.
                gc.freeze()
        started = time.perf_counter()
        result = await mail_stage(batch, self.ctx)
        metrics.observe("mail", result["tally"], time.perf_counter() - started)
        metrics.relays(self.ctx.pool.rates())
        return result

    async def node(self) -> str:
        """The node it runs on: the pool chooses it once it has answered, and drops it with its node."""
        return ray.get_runtime_context().get_node_id()

    async def cpu_seconds(self) -> float:
        """This process's CPU time so far: what mailing costs, measured where it is spent."""
        return time.process_time()
