"""Mailing speed and client CPU, ours against the obvious smtplib loop, in one run.

Both mail the same N signed contract notes to the same local SMTP server, which waits 1 ms
before every reply (a relay on the LAN; on bare loopback, round trips cost nothing and
pooling would look useless):
  (a) baseline: smtplib, a new connection per message, built with email.message.EmailMessage;
  (b) ours: a MailerActor on local Ray (pooled aiosmtplib connections, prepared MIME
      template, the Redis exactly-once guard and delivery log), message building included,
      each call a shard's batch, as most of a large day's are (CN_SHARD_SIZE's, 100 by
      default; `--batch`): what a call costs beside its mails (Ray's part ~0.65 ms of CPU; the
      batch's delivery-log writes, thread hand-offs and metrics) is shared by that many.
The server offers PIPELINING and CHUNKING, as Postfix does, so (b) sends a mail's envelope and
message as one BDAT group (one round trip); with --no-chunking it offers PIPELINING alone, and
(b) sends DATA's two groups, as to a relay that does not offer BDAT.
Client CPU is the sending thread's (a) or process's (b) CPU time per mail. The relay sink (aiosmtpd, in
Python) and Redis run on the same two cores: their CPU a mail while (b) mails is printed beside it
(`relay_sink_cpu_ms_per_mail`, `redis_cpu_ms_per_mail`), since with (b)'s own it bounds (b)'s mails/s here. The two take turns
(`--turns`): in each, (a) mails `--mails / turns`, then (b) `--mails` on the same actor, and the
speedup (b's mails/s over a's) is taken within the turn; the median and the spread of the turns
are printed. Run once each, 15 s apart, the VM's speed moved between them by more than the code
did (the same code gave 11.9x to 19.4x); a turn's two rows see the same VM. The first turn
also opens the pool's connections but one. Then (b) runs once more with the relay given a rate
(?rate=, above what one mailer sends, so the figures compare like with like). The limiter
alone (pipeline/mail/pacing.py against the real Redis: two mailers' pacers on one bucket, 4
sends each at a time, at 200 a second: SES's rate in docs/operations.md, a batch of 40 send
times) gives its CPU and Redis calls per mail. Its CPU is mostly the event loop's timer
wake-ups (20 a second at most, ~0.2 ms each on this VM), so per mail it falls as the rate rises.
With `--dkim`, (b) runs once more with a DKIM key (CN_DKIM_*: every message signed, RSA-2048),
and the signing alone is timed in this process over the same messages (`dkim_sign_cpu_ms_per_mail`:
no Ray, no relay, so the VM's noise is smaller than the mailer's difference).
Prints one JSON object a run; with --save (and --runs 3 or more) the runs' medians and spread go to pipeline/cluster/measured.json
(`plan` reads the mail rate there; bench/measured.py).

    python bench/mail.py [--mails 600] [--turns 3] [--batch 100] [--dkim] [--runs 3 --save]
"""

from __future__ import annotations

import argparse
import json
import os
import smtplib
import statistics
import sys
import tempfile
import time
from email.message import EmailMessage
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import measured  # noqa: E402
from pipeline.embedded import start_redis, start_smtp_sink  # noqa: E402
from pipeline.note.render import render  # noqa: E402
from pipeline.record.state import RunState  # noqa: E402
from pipeline.seal.sign import SignatureInfo, make_test_certificate, protect  # noqa: E402
from pipeline.seal.signer import load_signer  # noqa: E402
from pipeline.settings import Settings  # noqa: E402
from pipeline.stages import Batch  # noqa: E402
from tests.test_render import sample_note  # noqa: E402

TRADE_DATE = "2026-11-20"
LIMITER_RATE = 200.0


def notes(n: int, keys: Path) -> list[bytes]:
    key, cert, root = make_test_certificate(keys)
    signer = load_signer(str(key), str(cert), None, str(root))
    distinct = [protect(render(sample_note(5 + i)), "ABCPD1234E", "owner-secret", signer, SignatureInfo())
                for i in range(20)]
    return [distinct[i % len(distinct)] for i in range(n)]


def baseline(host: str, port: int, pdfs: list[bytes]) -> tuple[float, float]:
    """Wall and CPU seconds; the CPU of this thread alone, not of Ray's threads in this process."""
    started, cpu = time.perf_counter(), time.thread_time()
    for i, pdf in enumerate(pdfs):
        msg = EmailMessage()
        msg["From"], msg["To"] = "Contract Notes <notes@broker.example.com>", f"Client <b{i}@example.com>"
        msg["Subject"], msg["Message-ID"] = f"Contract note for {TRADE_DATE}", f"<base-{i}@bench.invalid>"
        msg.set_content("Please find attached your contract note.")
        msg.add_attachment(pdf, maintype="application", subtype="pdf", filename=f"ContractNote_B{i}.pdf")
        with smtplib.SMTP(host, port) as smtp:
            smtp.send_message(msg)
    return time.perf_counter() - started, time.thread_time() - cpu


def dkim_key(folder: Path) -> Path:
    """An RSA-2048 DKIM key, as a broker publishes (2048 bits: what Gmail and Yahoo ask for)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    path = folder / "dkim.key.pem"
    path.write_bytes(rsa.generate_private_key(65537, 2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return path


def dkim_signing(pdfs: list[bytes], key: Path) -> float:
    """CPU ms a mail of DKIM signing alone: the messages built first, then signed, in this thread."""
    from pipeline.mail.dkim_signer import dkim_from_pem
    from pipeline.mail.message import Letter, build_message

    letter = Letter("Contract Notes <notes@broker.example.com>", "Desk <desk@broker.example.com>")
    messages = [build_message(letter, "Client", f"d{i}@example.com", TRADE_DATE, f"D{i}", f"<d{i}@bench.invalid>",
                              pdf) for i, pdf in enumerate(pdfs)]
    signer = dkim_from_pem(key.read_bytes(), "bench", "broker.example.com", str(key))
    cpu = time.thread_time()
    for message in messages:
        signer.sign(message)
    return (time.thread_time() - cpu) * 1000 / len(messages)


def with_dkim(settings: Settings, work: Path, pdfs: list[bytes], batch: int) -> dict:
    """(b) again with every message DKIM-signed, and the signing alone."""
    import dataclasses

    key = dkim_key(work)
    signed = dataclasses.replace(settings, dkim_key=str(key), dkim_selector="bench", dkim_domain="broker.example.com",
                                 mail_from="Contract Notes <notes@broker.example.com>")
    mailer, lease = warm_mailer(signed, "bench-dkim", pdfs[0])
    seconds, cpu = ours(mailer, "bench-dkim", lease, pdfs, "D", batch)
    return {"dkim_mails_per_s": round(len(pdfs) / seconds, 1),
            "dkim_client_cpu_ms_per_mail": round(cpu * 1000 / len(pdfs), 2),
            "dkim_sign_cpu_ms_per_mail": round(dkim_signing(pdfs, key), 3)}


def limiter(redis_url: str, mails: int = 2000, rate: float = LIMITER_RATE) -> tuple[float, float]:
    """CPU ms and Redis calls per mail of the limiter alone, paced at `rate`."""
    import asyncio

    from pipeline.mail.pacing import Pacer
    from pipeline.record.rates import RedisBuckets

    async def paced() -> tuple[float, int]:
        pacers = [Pacer("relay:bench:25", rate, RedisBuckets(redis_url)) for _ in range(2)]

        async def send(pacer: Pacer, n: int) -> None:
            for _ in range(n):
                await pacer.slot(asyncio.sleep)

        cpu = time.thread_time()  # the loop's thread: Ray's threads, ended or not, are not the limiter
        await asyncio.gather(*(send(p, mails // 8) for p in pacers for _ in range(4)))
        return time.thread_time() - cpu, sum(p.calls for p in pacers)

    cpu, calls = asyncio.run(paced())
    return cpu * 1000 / mails, calls / mails


def ours(mailer, run_id: str, lease: str, pdfs: list[bytes], prefix: str, batch_size: int) -> tuple[float, float]:
    """Wall and CPU seconds of one MailerActor mailing `pdfs` to new accounts, `batch_size` a call."""
    import ray

    items = [{"ucc": f"{prefix}{i:06d}", "name": "Client", "email": f"{prefix.lower()}{i}@example.com",
              "pan": "ABCPD1234E", "ecn": True, "pdf": pdf} for i, pdf in enumerate(pdfs)]
    batches = [ray.put(Batch(run_id, TRADE_DATE, k, items[k:k + batch_size], lease=lease))
               for k in range(0, len(items), batch_size)]
    cpu0 = ray.get(mailer.cpu_seconds.remote())
    started = time.perf_counter()
    results = ray.get([mailer.send.remote(b) for b in batches])
    elapsed = time.perf_counter() - started
    cpu = ray.get(mailer.cpu_seconds.remote()) - cpu0
    assert sum(r["tally"].get("ok", 0) for r in results) == len(pdfs), results
    return elapsed, cpu


def _cpu_s(*services) -> list[float]:
    """Each service process's CPU seconds so far (user and system)."""
    import psutil

    return [sum(psutil.Process(s.process.pid).cpu_times()[:2]) for s in services]


def warm_mailer(settings: Settings, run_id: str, pdf: bytes):
    """A MailerActor of a started run, its pool open: (the actor, the run's lease)."""
    import ray

    from actors.mailer import MailerActor

    RunState(settings.redis_url, run_id).start({})
    lease = RunState(settings.redis_url, run_id).take_lease(3600).token
    mailer = MailerActor.remote(settings, run_id)
    warm = [{"ucc": "W0", "name": "Warm", "email": "w0@example.com", "pan": "ABCPD1234E", "ecn": True, "pdf": pdf}]
    ray.get(mailer.send.remote(Batch(run_id, TRADE_DATE, 0, warm, lease=lease)))
    return mailer, lease


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mails", type=int, default=600)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--batch", type=int, default=Settings.from_env().shard_size,
                        help="mails a call of the mailer: a shard's, as in a run (CN_SHARD_SIZE)")
    parser.add_argument("--turns", type=int, default=3, help="turns of the baseline and ours, side by side")
    parser.add_argument("--rate", type=float, default=1000.0, help="the relay's rate in the limited run (messages/s)")
    parser.add_argument("--dkim", action="store_true", help="also mail with every message DKIM-signed (CN_DKIM_*)")
    parser.add_argument("--no-chunking", action="store_true", help="the relay does not offer CHUNKING (BDAT)")
    measured.run("mail", parser, once, {"mails": 40, "turns": 1})


def once(args) -> dict:
    import ray

    from pipeline.cluster.driver import job_config, workers_environment

    with tempfile.TemporaryDirectory(prefix="bench-mail-") as tmp:
        work = Path(tmp)
        pdfs = notes(args.mails, work / "keys")
        (work / "faults.json").write_text(json.dumps({"delay_ms": 1, "chunking": not args.no_chunking}))
        redis = start_redis(work / "redis")
        smtp = start_smtp_sink(work / "outbox", work / "smtp.log", ["--faults", str(work / "faults.json")])
        with workers_environment():  # the allocator and compile threads a run's Ray has
            ray.init(num_cpus=1, resources={"smtp": 2}, include_dashboard=False, log_to_driver=False,
                     job_config=job_config())
        try:
            host, port = smtp.url.removeprefix("smtp://").split(":")
            settings = Settings.from_env(redis_url=redis.url, smtp_url=smtp.url, store_url=str(work / "store"),
                                         smtp_connections=args.connections)
            mailer, lease = warm_mailer(settings, "bench-ours", pdfs[0])
            share = max(1, args.mails // args.turns)
            turns = []
            beside = []  # the relay sink's and Redis's CPU while ours mailed: on the same two cores
            for t in range(args.turns):
                base_s, base_cpu = baseline(host, int(port), pdfs[t * share:(t + 1) * share])
                others = _cpu_s(smtp, redis)
                ours_s, ours_cpu = ours(mailer, "bench-ours", lease, pdfs, f"O{t}", args.batch)
                beside.append([b - a for a, b in zip(others, _cpu_s(smtp, redis))])
                turns.append((share, base_s, base_cpu, args.mails, ours_s, ours_cpu))
            limited = Settings.from_env(redis_url=redis.url, smtp_url=f"{smtp.url}?rate={args.rate}",
                                        store_url=str(work / "store"), smtp_connections=args.connections)
            mailer, lease = warm_mailer(limited, "bench-limited", pdfs[0])
            limited_s, limited_cpu = ours(mailer, "bench-limited", lease, pdfs, "L", args.batch)
            signed = with_dkim(settings, work, pdfs, args.batch) if args.dkim else {}
            ray.shutdown()
            limiter_cpu_ms, limiter_calls = limiter(redis.url)
            received = len(os.listdir(work / "outbox"))
        finally:
            ray.shutdown()
            smtp.stop()
            redis.stop()
    n = args.mails
    speedups = [(o_n / o_s) / (b_n / b_s) for b_n, b_s, _, o_n, o_s, _ in turns]
    base_rate = statistics.median(b_n / b_s for b_n, b_s, *_ in turns)
    ours_rate = statistics.median(o_n / o_s for *_, o_n, o_s, _ in turns)
    result = {
        "mails": n,
        "turns": args.turns,
        "batch": args.batch,
        "received_at_server": received,
        "relay_offers_chunking": not args.no_chunking,
        "baseline_mails_per_s": round(base_rate, 1),
        "ours_mails_per_s": round(ours_rate, 1),
        "speedup": round(statistics.median(speedups), 2),
        "speedup_turns": [round(x, 2) for x in speedups],
        "baseline_client_cpu_ms_per_mail": round(statistics.median(c * 1000 / b_n for b_n, _, c, *_ in turns), 2),
        "ours_client_cpu_ms_per_mail": round(statistics.median(c * 1000 / o_n for *_, o_n, _, c in turns), 2),
        "ours_client_cpu_ms_per_mail_turns": [round(c * 1000 / o_n, 2) for *_, o_n, _, c in turns],
        "relay_sink_cpu_ms_per_mail": round(statistics.median(sink * 1000 / n for sink, _ in beside), 2),
        "redis_cpu_ms_per_mail": round(statistics.median(r * 1000 / n for _, r in beside), 3),
        "limited_rate": args.rate,
        "limited_mails_per_s": round(n / limited_s, 1),
        "limited_client_cpu_ms_per_mail": round(limited_cpu * 1000 / n, 2),
        "limiter_in_mailer_cpu_ms_per_mail": round((limited_cpu * 1000 / n) - statistics.median(
            c * 1000 / o_n for *_, o_n, _, c in turns), 3),  # noise: about ±0.05
        "limiter_rate": LIMITER_RATE,
        "limiter_cpu_ms_per_mail": round(limiter_cpu_ms, 4),
        "limiter_redis_calls_per_mail": round(limiter_calls, 4),
        "attachment_kb": round(sum(map(len, pdfs)) / n / 1024, 1),
        **signed,
    }
    return result


if __name__ == "__main__":
    main()
