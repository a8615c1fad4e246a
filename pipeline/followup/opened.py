"""A run opened for a follow-up that changes it (`rerun`, `reconcile`, `bounces`, `close`): found
where it recorded its record (located.py), under its lease, brought back from storage when its
Redis lost it. Apart from located.py, so that `verify` and `status`, which only read, load no
renderer or mailer (restore.py brings a run back through the stages).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

from pipeline.errors import RunNotFound
from pipeline.followup.located import locate
from pipeline.followup.seal_state import OPEN, SEALED, seal_state
from pipeline.record.lease import Lease, held
from pipeline.record.manifest import SplitResult, load_manifest
from pipeline.record.state import RunClosed, RunState
from pipeline.record.storage import Store
from pipeline.settings import Settings


@dataclass(frozen=True)
class OpenRun:
    """A run opened for a follow-up: its record located, its manifest read, its Redis state."""

    settings: Settings  # with the run's store and key locations
    store: Store
    source: str  # why this store, as the command says it
    state: RunState
    split: SplitResult
    lease: Lease | None  # the run's lease, while the command holds it

    def where(self) -> dict[str, str]:
        return {"store": self.store.url, "store_from": self.source}

    def meta(self) -> dict:
        """The run's meta, brought back from storage first when its Redis lost it (a cluster's
        Redis ends with the cluster; the record has the run). Only a run brought back loads the
        stages it is restored through: a `close` whose Redis has its run stays within 200 MB."""
        if meta := self.state.meta():
            return meta
        from pipeline.followup import restore

        return restore.from_storage(self.store, self.state, self.state.run_id)


@contextmanager
def open_run(settings: Settings, run_id: str, store_url: str | None = None, command: str = "", hold: bool = True,
             restored: bool = True, sealed_ok: bool = False) -> Iterator[OpenRun]:
    """The one way a follow-up (rerun, reconcile, bounces, close) opens a run: on its own store
    and keys (`locate`), under its lease while the block runs (`hold`; a bounce reader holds it
    only to bring the run back), brought back from storage if Redis lost it (`restored`; close
    looks at its seal first), and refused once its close began unless `sealed_ok`."""
    found = locate(settings, run_id, store_url, writes=True, command=command)
    settings, store = found.settings, found.store
    state = RunState(settings.redis_url, run_id, settings.state_ttl_s)
    split = load_manifest(store, run_id)
    if split is None:
        raise RunNotFound(f"no run {run_id!r} in {store.url}: its report is there, its manifest is not")
    with held(state, settings.lease_s) if hold else nullcontext() as lease:
        run = OpenRun(settings, store, found.source, state, split, lease)
        if restored:
            with nullcontext() if hold or state.exists() else held(state, settings.lease_s):
                meta = run.meta()
            if not sealed_ok:
                refuse_closed(store, run_id, meta)
        yield run


def refuse_closed(store: Store, run_id: str, meta: dict) -> None:
    """Raises RunClosed once the run's close began: Redis says so (`meta`), or storage does. The
    close's warrant is written before Redis hears of it, so a close stopped between the two is
    refused too: a mail after it would leave a record the next close refuses to seal."""
    sealing = seal_state(store, run_id).state
    if not meta.get("closed_at") and sealing == OPEN:
        return
    if sealing != SEALED:
        raise RunClosed(f"run {run_id}: its close began and stopped before the seal: run `close {run_id}` "
                        "again to finish it; nothing more is mailed or settled under it")
    raise RunClosed(f"run {run_id} was closed and its record sealed: nothing more is mailed or settled "
                    "under it (its failed and bounced accounts are on the paper list)")
