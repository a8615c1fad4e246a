"""Every Redis key and storage key the job uses, so the whole state model reads at once.

Redis (live state, with a TTL; the report in storage is the permanent record):
  cn:runs                    zset   run_id -> started (epoch s)
  cn:run:{run}:meta          hash   date, input, started, finished, config summary, and where the run's
                                    record and keys are (RECORD_FIELDS, also in the report)
  cn:run:{run}:counts        hash   per-stage counters, and st:{status} per final status (O(1) to read)
  cn:run:{run}:accounts      hash   ucc -> compact JSON account record (state.py says its fields)
  cn:run:{run}:failed        zset   ucc -> time of failure (the rerun registry)
  cn:run:{run}:unconfirmed   zset   ucc -> time: the mail may have reached the relay (reconcile)
  cn:run:{run}:mailguard     hash   ucc -> claim token; taken before an e-mail leaves
  cn:run:{run}:timeline      list   JSON snapshots of the counters, about one a second
  cn:run:{run}:lease         hash   the driver that holds the run: holder (JSON), token, renewed
  cn:run:{run}:bounce-reader string the one `bounces` reader of the run (JSON), while it renews
  cn:run:{run}:recording     string held by `close` throughout, or a bounce reader while it records (JSON)
  cn:run:{run}:recording:close string a close waits for it: bounce readers let it in first
  cn:noteseq:{store}:{fy}    int    contract note numbers a store (an issuing entity) issued in a financial year
  cn:noteseq:{store}:{fy}:lock string held while a split task reserves numbers and raises the mark
  cn:rate:relay:{host}:{port} hash  a relay's send rate, shared by every mailer of every run (rates.py)
  cn:rate:domain:{domain}    hash   a receiving domain's send rate (CN_DOMAIN_RATES), likewise
  cn:hsm:{token}:pin-refused string when the HSM refused the PIN: never offered again (credentials.py)

Storage (fixed partition prefixes p = stable_hash(ucc) % 10, so S3 spreads the load):
  {p}-contract-notes-data/{run}/shard-{k}.jsonl   accounts of shard k (k % 10 == p)
  {p}-signed-pdf/{date}/{ucc}.pdf                 the signed archive of record
  {p}-delivery-log/{run}/shard-{k}/{n:08d}.jsonl  object n of shard k's chained log: a mailing's intent or
                                                  outcomes, a bounce, a fetch (k % 10 == p; delivery_log.py)
  reports/{run}.json, reports/{run}.csv           the run report
  reports/{run}.paper.csv                         the physical dispatch list, with due dates
  reports/{run}.proof.json, .proof.p7s            the seal (every log object's SHA-256) and its CMS signature
  reports/{run}.proof.tsr                         an RFC 3161 timestamp of the proof (close, with CN_TSA_URL)
  reports/{run}.closing.json, .closing.p7s        close's first write, signed: its closed_at and each chain's
                                                  head as it began (a close that stopped reads as begun)
  reports/{run}.manifest.json                     the run's shards (a rerun reuses them)
  reports/{run}.first-notes.json                  the notes its driver mailed before the split, their numbers
  noteseq/{fy}/{high:012d}.json                   one reservation of a FY's note numbers, named by the highest
                                                  (create-only): no file holds a number above the highest mark
  reports/noteseq-{fy}.json                       the same in one object, overwritten, for versions before the marks
  logs/{run}/{n:06d}.log                          the driver's log, a chunk every 10 s (run_log.py)
  reports/.write-check                            written before a run starts: the store is writable
  reports/{run}.create-only-check                 written twice, create-only, before a run or a command
                                                  appends to its record: the second must be refused
"""

from __future__ import annotations

import hashlib
import re

from pipeline.record.macs import hmac_sha256

PARTITIONS = 10
# Where a run's record and keys are, absolute (locations and a key's fingerprint, never key
# material): in its meta and its report, so a command typed later, anywhere, finds them
RECORD_FIELDS = ("store_url", "key_dir", "secret", "signer_key", "signer_cert", "signer_chain", "token_key_file",
                 "token_key_id", "signer_cert_sha256", "pkcs11_module", "pkcs11_token", "pkcs11_key", "pkcs11_key_id",
                 "pkcs11_pin_file", "message_id_domain")
RUNS = "cn:runs"
# A run id goes into Redis keys, storage keys and the status page: nothing else gets through
RUN_ID = re.compile(r"^(?!\.{1,2}\Z)[A-Za-z0-9._-]{1,64}\Z")  # \Z: "$" would take a final newline
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9_.-]")  # what a Message-ID's local part may not hold of a ucc


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise ValueError(f"run id {run_id[:80]!r} is not 1-64 letters, digits, '.', '_' or '-' (nor . or ..)")
    return run_id


def run_meta(run_id: str) -> str:
    return f"cn:run:{run_id}:meta"


def run_counts(run_id: str) -> str:
    return f"cn:run:{run_id}:counts"


def run_accounts(run_id: str) -> str:
    return f"cn:run:{run_id}:accounts"


def run_failed(run_id: str) -> str:
    return f"cn:run:{run_id}:failed"


def run_unconfirmed(run_id: str) -> str:
    return f"cn:run:{run_id}:unconfirmed"


def run_mailguard(run_id: str) -> str:
    return f"cn:run:{run_id}:mailguard"


def run_lease(run_id: str) -> str:
    return f"cn:run:{run_id}:lease"


def run_bounce_reader(run_id: str) -> str:
    return f"cn:run:{run_id}:bounce-reader"


def run_recording(run_id: str) -> str:
    return f"cn:run:{run_id}:recording"


def run_close_waiting(run_id: str) -> str:
    return f"cn:run:{run_id}:recording:close"


def run_timeline(run_id: str) -> str:
    return f"cn:run:{run_id}:timeline"


def note_sequence(fy: str, store_url: str) -> str:
    """A store's year of note numbers: each issuing entity keeps its own store (its marks), so two
    entities on one Redis number each from its own last, without a gap the other's numbers made.
    Redis's counter only speeds it: the floor is always the store's marks."""
    return f"cn:noteseq:{hashlib.sha256(store_url.rstrip('/').encode()).hexdigest()[:16]}:{fy}"  # s3://b/p/ is s3://b/p


def note_sequence_lock(fy: str, store_url: str) -> str:
    return f"{note_sequence(fy, store_url)}:lock"


def note_block(fy: str, accounts_digest: str) -> str:
    """The first number of the block reserved for one run's accounts in one order (note_numbers.reserve_for)."""
    return f"cn:noteseq:{fy}:block:{accounts_digest}"


def hsm_pin_refused(token: str) -> str:
    return f"cn:hsm:{token}:pin-refused"


RATE_PREFIX = "cn:rate:"


def rate_bucket(name: str) -> str:
    """A rate bucket's hash: `name` is relay:HOST:PORT or domain:DOMAIN (pipeline/mail/relay.py)."""
    return RATE_PREFIX + name


def message_id(run_id: str, ucc: str, key: bytes = b"", domain: str = "contract-notes.invalid") -> str:
    """Derived, not random: the same account in the same run always has the same Message-ID,
    so a resend collapses in the client's mailbox. Keyed by the run's HMAC key (the secret's
    token_key): the run id is readable in a client's link, and an unkeyed digest let anyone
    write a DSN naming another client's Message-ID. Without a key: a run started before."""
    text = f"{run_id}/{ucc}".encode()
    digest = (hmac_sha256(key, b"message-id\0" + text) if key else hashlib.sha256(text).digest()).hex()[:24]
    return message_id_of(digest, ucc, domain)


def message_id_of(digest: str, ucc: str, domain: str = "contract-notes.invalid") -> str:
    """The Message-ID around its digest: all a record keeps of it (records.py)."""
    return f"<{digest}.{_NOT_IN_ID.sub('_', ucc)}@{domain}>"


def stable_hash(ucc: str) -> int:
    """Same number on every machine and Python process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(ucc.encode(), digest_size=8).digest(), "big")


def partition(ucc: str) -> int:
    return stable_hash(ucc) % PARTITIONS


def shard_of(ucc: str, shards: int) -> int:
    """Shard counts are multiples of PARTITIONS, so a shard's accounts share its partition."""
    return stable_hash(ucc) % shards


def shard_key(run_id: str, shard: int) -> str:
    return f"{shard % PARTITIONS}-contract-notes-data/{run_id}/shard-{shard:05d}.jsonl"


def signed_pdf_key(trade_date: str, ucc: str) -> str:
    return f"{signed_pdf_prefix(trade_date, partition(ucc))}{ucc}.pdf"


def signed_pdf_prefix(trade_date: str, part: int) -> str:
    return f"{part}-signed-pdf/{trade_date}/"


def delivery_log_prefix(run_id: str, shard: int) -> str:
    return f"{shard % PARTITIONS}-delivery-log/{run_id}/shard-{shard:05d}/"


def manifest_key(run_id: str) -> str:
    return f"reports/{run_id}.manifest.json"


def first_notes_key(run_id: str) -> str:
    return f"reports/{run_id}.first-notes.json"


def day_claim_key(trade_date: str) -> str:
    return f"reports/day-{trade_date}.json"


def note_sequence_key(fy: str) -> str:
    return f"reports/noteseq-{fy}.json"


def note_marks(fy: str) -> str:
    return f"noteseq/{fy}/"  # not under reports/, which `runs` lists


def note_mark_key(fy: str, high: int) -> str:
    return f"{note_marks(fy)}{high:012d}.json"  # zero-padded: in key order, in number order


WRITE_CHECK = "reports/.write-check"  # a run proves the store writable before it starts


def create_only_check_key(run_id: str) -> str:
    return f"reports/{run_id}.create-only-check"


def proof_keys(run_id: str) -> tuple[str, str]:
    return f"reports/{run_id}.proof.json", f"reports/{run_id}.proof.p7s"


def closing_keys(run_id: str) -> tuple[str, str]:
    return f"reports/{run_id}.closing.json", f"reports/{run_id}.closing.p7s"


def timestamp_key(run_id: str) -> str:
    return f"reports/{run_id}.proof.tsr"


def report_keys(run_id: str) -> tuple[str, str]:
    return f"reports/{run_id}.json", f"reports/{run_id}.csv"
