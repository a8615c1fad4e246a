"""Where a run's seal stands: open, began or sealed, from which of its objects storage holds.
The one answer `close`, `verify`, `status`, `runs` and a follow-up refused on a closed run ask.

close writes, in this order: its warrant (reports/RUN.closing.json, then .closing.p7s), the
report and each chain's closing object, then the seal: the proof (.proof.json), its signature
(.proof.p7s) and, when the proof names a time-stamping authority, its timestamp (.proof.tsr).
Everything the seal holds is had before the proof is written, so whatever prefix of those writes
a failure leaves is a close that began: the next close completes it (from its warrant, or from
the proof's bytes as stored). Sealed is every object there; open is none of them. Nothing here
judges the objects: `verify` does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pipeline.record.keys import closing_keys, proof_keys, timestamp_key
from pipeline.record.statuses import phase
from pipeline.record.storage import Store

OPEN, BEGAN, SEALED = "open", "began", "sealed"
TSA_LAST = re.compile(rb'"tsa": ("(?:[^"\\]|\\.)*"|null)\s*}\s*\Z')  # the proof's last key (closing.as_json)
TAIL = 2048  # bytes of a proof read for its TSA


@dataclass(frozen=True)
class SealState:
    warrant: bool  # reports/RUN.closing.json, looked for while there is no proof: a close began
    proof: bool  # .proof.json
    signed: bool  # .proof.p7s
    stamped: bool  # .proof.tsr
    tsa: str  # the TSA the proof names ("" none): its timestamp is owed

    @property
    def state(self) -> str:
        if self.proof and self.signed and (self.stamped or not self.tsa):
            return SEALED
        return BEGAN if self.warrant or self.proof else OPEN

    def missing(self) -> list[str]:
        """What the seal still lacks, after its proof, as the next close makes it."""
        return [what for what, there in (("signature", self.signed), ("timestamp", self.stamped or not self.tsa))
                if not there]


def seal_state(store: Store, run_id: str) -> SealState:
    """Existence checks, and for a signed proof without a timestamp the proof's last bytes."""
    proof_key, sig_key = proof_keys(run_id)
    proof = store.exists(proof_key)
    signed = proof and store.exists(sig_key)
    stamped = proof and store.exists(timestamp_key(run_id))
    tsa = named_tsa(store, proof_key) if proof and not stamped else ""
    warrant = not proof and store.exists(closing_keys(run_id)[0])
    return SealState(warrant, proof, signed, stamped, tsa)


def run_phase(finished: bool, closed: bool, seal: str) -> str:
    """statuses.phase with the seal's objects counted, as `status`, `runs` and the page say it: a
    close whose warrant storage holds began (closing), whether or not Redis or the report has
    its `closed_at` (`closed`)."""
    return phase(finished, closed or seal != OPEN, seal == SEALED)


def named_tsa(store: Store, proof_key: str) -> str:
    """The TSA a proof names, "" for none or for a proof that is no JSON (verify names it
    changed). close writes its keys sorted, and "tsa" sorts last: the proof's last bytes say it,
    not its whole 3 MB at 1.5M accounts (`runs` asks this of every run); else it is read whole."""
    size = store.size(proof_key)
    found = TSA_LAST.search(store.read_range(proof_key, max(0, size - TAIL), size))
    try:
        tsa = json.loads(found[1]) if found else json.loads(store.get(proof_key)).get("tsa")
    except (ValueError, AttributeError):
        return ""
    return tsa if isinstance(tsa, str) else ""
