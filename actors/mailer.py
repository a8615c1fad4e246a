"""MailerActor: an async actor holding a pool of SMTP connections, mailing batches.

Ray re-runs in-flight calls after a crash (at least once, out of order); the per-account
guard in Redis (RunState.claim_mail) makes the e-mail itself at most once.
"""

from __future__ import annotations

import ray

from pipeline.mail import SmtpPool
from pipeline.settings import Settings
from pipeline.stages import Batch, MailContext, mail_stage
from pipeline.state import RunState
from pipeline.storage import open_store


@ray.remote(max_restarts=-1, max_task_retries=3, num_cpus=0, resources={"smtp": 1})
class MailerActor:
    def __init__(self, settings: Settings, run_id: str, force: bool = False):
        self.settings = settings
        self.ctx_args = dict(state=RunState(settings.redis_url, run_id, settings.state_ttl_s),
                             store=open_store(settings.store_url), sender=settings.mail_from, force=force)
        self.pool = None

    async def send(self, batch: Batch) -> dict:
        if self.pool is None:  # created on the actor's event loop
            self.pool = SmtpPool(self.settings.smtp(), self.settings.smtp_connections)
        return await mail_stage(batch, MailContext(pool=self.pool, **self.ctx_args))
