"""Signing cost per note, ours against naive pyhanko, in one run on the same notes.

  naive_ms        pyhanko as documented: SimpleSigner.load + sign_pdf per note (the baseline)
  sign_ms         ours, signature only
  sign_aes256_ms  ours, AES-256 (R6) encryption + signature (the default), the whole of it: all four
                  R6 password hashes are counted here, the user's two included, which production
                  makes at render (`user_halves`) and hands to the signer
  sign_aes256_batch_ms  the same as the stages do it, a chunk's notes a call: the render stage's
                  `user_halves`, then the signer's `protect_all` (their R6 hashes eight at once)
  sign_aes128_ms  ours, AES-128 (R4) encryption + signature
  floor_ms        SHA-256 over the file + one RSA-2048 signature: nothing can go below this
  r6_hash_ms      one R6 password hash (ISO 32000-2 algorithm 2.B; four a note) in C over OpenSSL,
  r6_hash_python_ms  and in Python (pdfcrypt.hash_2b_reference, what it replaced)
  naive_over_aes256  naive_ms / sign_aes256_ms (issue 43's target: at least 22; issue 73's: 35)
  naive_over_aes256_batch  naive_ms / sign_aes256_batch_ms
All are CPU milliseconds per note (process time). Then the key on an HSM (issue 41), each row a
signer actor's work (sign + AES-256, `protect_all`: signatures in flight while the next notes are prepared):
  hsm.file          the key file (the baseline of the rows below)
                    Each signs as a signer actor does: a shard's notes (100) a call, two calls
                    together where a signature takes a round trip (Signer.batches_at_once)
  hsm.softhsm       SoftHSM2 in this process (CPU ratio to the file key: the target is <= 1.10)
  hsm.p11kit        SoftHSM2 behind `p11-kit server`, through p11-kit-client.so: a network HSM
  hsm.p11kit_5ms    the same with 5 ms added to every round trip by a delaying proxy (notes/s
                    ratio to the file key: the target is >= 0.95)
each in a process of its own pinned to one core (the HSM's server and the delaying link, which
stand for a machine across the network, work on the other), the three in turn, `--runs` rounds:
the medians of notes/s (wall), CPU ms a note (that process; the server's is the HSM's), the
round trip of one signature and the sessions; each row's ratios to the key file are the median
of its turns' (`--turns` of 200 notes each way, both signers meeting the same moments of this
VM), and their spread over the rounds.

    python bench/sign.py [--notes 400] [--runs 3] [--turns 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import measured  # noqa: E402

from pyhanko.pdf_utils.incremental_writer import IncrementalPdfFileWriter  # noqa: E402
from pyhanko.sign import fields, signers  # noqa: E402

from pipeline.note.render import render  # noqa: E402
from pipeline.seal.pdfcrypt import hash_2b, hash_2b_reference  # noqa: E402
from pipeline.seal.sign import SignatureInfo, make_test_certificate, protect, protect_all, user_halves  # noqa: E402
from pipeline.seal.signer import load_signer  # noqa: E402
from tests.test_render import sample_note  # noqa: E402

OWNER = "broker-owner-secret"


def cpu_ms(fn, items) -> float:
    fn(items[0])
    started = time.process_time()
    for item in items:
        fn(item)
    return (time.process_time() - started) * 1000 / len(items)


def interleaved_ms(rows: dict, items: list, chunk: int = 50, sparse: tuple = ("naive_ms",),
                   batched: tuple = ("sign_aes256_batch_ms",)) -> dict[str, float]:
    """CPU ms a note of each row, the rows taking turns `chunk` notes at a time (a `sparse` row,
    a hundred times dearer, a tenth of them; a `batched` row given the chunk in one call): this
    VM's speed drifts by tens of percent within a minute, and a ratio of rows measured minutes
    apart drifted with it. Not note by note: each row's first notes after another row's run
    slower (its caches are cold)."""
    spent, done = dict.fromkeys(rows, 0.0), dict.fromkeys(rows, 0)
    for name, fn in rows.items():
        fn(items[:1] if name in batched else items[0])
    for k in range(0, len(items), chunk):
        for name, fn in rows.items():
            part = items[k:k + chunk // 10] if name in sparse else items[k:k + chunk]
            started = time.process_time()
            if name in batched:
                fn(part)
            else:
                for item in part:
                    fn(item)
            spent[name] += time.process_time() - started
            done[name] += len(part)
    return {name: spent[name] * 1000 / done[name] for name in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notes", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3, help="rounds of the HSM rows, each row in turn (0: none)")
    for hidden in ("--row", "--key", "--cert", "--root", "--token", "--core"):  # one HSM row, in a process of its own
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--turns", type=int, default=8, help="turns of each HSM row (CHUNK notes each, both ways)")
    args = measured.with_smoke(parser, {"notes": 10, "runs": 1, "turns": 1})
    if args.row:
        return one_row(args)
    notes = [render(sample_note(trades=5 + i % 15)) for i in range(args.notes)]
    pans = [f"ABCPD{i % 10000:04d}E" for i in range(args.notes)]
    items = list(zip(notes, pans))
    with tempfile.TemporaryDirectory() as tmp:
        key, cert, root = make_test_certificate(Path(tmp))
        signer = load_signer(str(key), str(cert), None, str(root))
        info = SignatureInfo()

        def naive(item):
            s = signers.SimpleSigner.load(str(key), str(cert), ca_chain_files=(str(root),))
            meta = signers.PdfSignatureMetadata(field_name="Sig", md_algorithm="sha256",
                                                subfilter=fields.SigSeedSubFilter.PADES)
            signers.sign_pdf(IncrementalPdfFileWriter(BytesIO(item[0])), meta, signer=s)

        def floor(item):
            signer.sign(hashlib.sha256(item[0]).digest())

        def as_the_stages(part):  # all four hashes counted, the user's two as the render stage makes them
            pdfs, pans = zip(*part)
            done = protect_all(list(zip(pdfs, pans, user_halves(list(pans), "aes256"))), OWNER, signer, info)
            assert all(isinstance(d, bytes) for d in done), [d for d in done if not isinstance(d, bytes)][:1]

        rows = interleaved_ms({
            "naive_ms": naive,
            "sign_ms": lambda i: protect(i[0], i[1], OWNER, signer, info, "none"),
            "sign_aes256_ms": lambda i: protect(i[0], i[1], OWNER, signer, info, "aes256"),
            "sign_aes256_batch_ms": as_the_stages,
            "sign_aes128_ms": lambda i: protect(i[0], i[1], OWNER, signer, info, "aes128"),
            "floor_ms": floor,
            "r6_hash_ms": lambda i: hash_2b(i[1].encode(), i[0][:8], i[0][8:56]),
            "r6_hash_python_ms": lambda i: hash_2b_reference(i[1].encode(), i[0][:8], i[0][8:56]),
        }, items)
        result = {"notes": args.notes, "typical_pdf_kb": round(sum(map(len, notes)) / len(notes) / 1024, 1),
                  **{name: round(ms, 3) for name, ms in rows.items()}}
        if args.runs:
            result["hsm"] = hsm_rows(Path(tmp), key, cert, root, args.notes, args.runs, args.turns)
    result["naive_over_ours"] = round(result["naive_ms"] / result["sign_ms"], 1)
    result["naive_over_aes256"] = round(result["naive_ms"] / result["sign_aes256_ms"], 1)
    result["naive_over_aes256_batch"] = round(result["naive_ms"] / result["sign_aes256_batch_ms"], 1)
    if args.runs:
        rows = result["hsm"]
        result["softhsm_cpu_over_file"] = rows["softhsm"]["cpu_over_file"]
        result["p11kit_5ms_notes_per_s_over_file"] = rows["p11kit_5ms"]["notes_per_s_over_file"]
    print(json.dumps(result))


ROWS = ("softhsm", "p11kit", "p11kit_5ms")
BATCH = 100  # a shard's accounts (CN_SHARD_SIZE): what one call of a signer actor signs
CHUNK = 2 * BATCH  # notes signed one way, then the other: both see the same moments of this noisy VM


def as_the_actor(items: list, signer, info) -> list:
    """protect_all over batches of BATCH as a signer actor's calls come: `batches_at_once` of them
    under way together (actors/signer.py)."""
    with ThreadPoolExecutor(signer.batches_at_once) as calls:
        signed = calls.map(lambda i: protect_all(items[i:i + BATCH], OWNER, signer, info), range(0, len(items), BATCH))
        return [note for batch in signed for note in batch]


def hsm_rows(tmp: Path, key: Path, cert: Path, root: Path, notes: int, runs: int, turns: int) -> dict:
    """Each HSM row in a process of its own (a PKCS#11 client module reads its server's address
    once), there interleaved with the key file, CHUNK notes at a time: the row's ratios to the
    file key come from the same moments. `runs` rounds; medians and spreads."""
    import statistics
    import subprocess

    from pipeline.seal.token import SOFTHSM, make_test_token
    from tests.servers import DelayingProxy, start_p11kit_server

    token = make_test_token(tmp / "hsm")
    cores = sorted(os.sched_getaffinity(0))
    elsewhere = set(cores[1:]) or set(cores)  # the "machine across the network": all but the signer's core
    server = start_p11kit_server(tmp / "p11-kit.sock", SOFTHSM, token.label)
    os.sched_setaffinity(server.process.pid, elsewhere)  # its children, one a connection, inherit it
    os.sched_setaffinity(0, elsewhere)  # the delaying link's threads are this process's
    proxy = DelayingProxy(tmp / "slow.sock", tmp / "p11-kit.sock", 0.005)
    address = {"p11kit": server.url, "p11kit_5ms": proxy.address}
    rounds: dict[str, list[dict]] = {r: [] for r in ROWS}
    try:
        for _ in range(runs):
            for row in ROWS:
                out = subprocess.run([sys.executable, __file__, "--row", row, "--notes", str(notes), "--turns", str(turns), "--key", str(key),
                                      "--cert", str(cert), "--root", str(root), "--token", str(tmp / "hsm"), "--core", str(cores[0])],
                                     env={**os.environ, "P11_KIT_SERVER_ADDRESS": address.get(row, "")},
                                     capture_output=True, text=True, check=True)
                rounds[row].append(json.loads(out.stdout.splitlines()[-1]))
    finally:
        proxy.stop()
        server.stop()
        os.sched_setaffinity(0, cores)
    files = [r["file"] for row in ROWS for r in rounds[row]]
    result = {"file": {k: statistics.median(f[k] for f in files) for k in ("notes_per_s", "cpu_ms")}}
    for row in ROWS:
        measured = [r[row] for r in rounds[row]]
        cpu = [r[row]["cpu_over_file"] for r in rounds[row]]
        speed = [r[row]["notes_per_s_over_file"] for r in rounds[row]]
        result[row] = {**{k: statistics.median(m[k] for m in measured) for k in ("notes_per_s", "cpu_ms",
                                                                                 "round_trip_ms")},
                       "sessions": measured[-1]["sessions"],
                       "cpu_over_file": round(statistics.median(cpu), 3), "cpu_spread": [round(min(cpu), 3),
                                                                                         round(max(cpu), 3)],
                       "notes_per_s_over_file": round(statistics.median(speed), 3),
                       "notes_per_s_spread": [round(min(speed), 3), round(max(speed), 3)],
                       **{k: statistics.median(m[k] for m in measured) for k in ("module_sign_ms", "wrapped_sign_ms",
                                                                                 "file_sign_ms") if k in measured[0]}}
    return result


def one_row(args) -> None:
    """One row against the key file, in this process pinned to one core, as a signer actor on a
    busy node has (the HSM's server and the delaying link work on the other: they stand for a
    machine across the network): `--turns` turns of CHUNK notes one way, then the other,
    alternating which goes first. Each turn's ratio to the key file; the turns' median."""
    import statistics

    import pkcs11
    from cryptography import x509

    from pipeline.seal.signer import Signer
    from pipeline.seal.token import P11_KIT_CLIENT, SOFTHSM, TokenConfig, TokenKey, make_test_token

    os.sched_setaffinity(0, {int(args.core)})
    notes = [render(sample_note(trades=5 + i % 15)) for i in range(args.notes)]
    items = [(note, f"ABCPD{i % 10000:04d}E", None) for i, note in enumerate(notes)]  # all four hashes here
    token = make_test_token(Path(args.token))
    key = TokenKey(TokenConfig(SOFTHSM if args.row == "softhsm" else P11_KIT_CLIENT, token.label, token.key_label,
                               pin=token.pin_file.read_text()))
    signers = {"file": load_signer(args.key, args.cert, None, args.root),
               args.row: Signer(key.sign, key.algorithm, x509.load_pem_x509_certificate(token.cert.read_bytes()), [],
                                key.sessions, submit=key.signing)}  # as credentials.read makes it
    info, turns = SignatureInfo(), []
    for signer in signers.values():
        protect_all(items[:4], OWNER, signer, info)  # warm
    for turn in range(args.turns):
        chunk = [items[(turn * CHUNK + k) % len(items)] for k in range(CHUNK)]
        spent = {}
        for name in (list(signers) if turn % 2 else list(signers)[::-1]):
            wall, cpu = time.perf_counter(), time.process_time()
            done = as_the_actor(chunk, signers[name], info)
            spent[name] = (time.perf_counter() - wall, time.process_time() - cpu)
            assert all(isinstance(d, bytes) for d in done), [d for d in done if not isinstance(d, bytes)][:1]
        turns.append(spent)
    total = {name: [sum(t[name][i] for t in turns) for i in (0, 1)] for name in signers}
    notes_signed = CHUNK * args.turns
    rows = {name: {"notes_per_s": round(notes_signed / w, 1), "cpu_ms": round(c * 1000 / notes_signed, 2),
                   "sessions": signers[name].workers,
                   "round_trip_ms": round(key.round_trip_s * 1000, 2) if name != "file" else 0.0}
            for name, (w, c) in total.items()}
    rows[args.row].update(  # a turn's own ratio: both signers met the same moments of this VM
        notes_per_s_over_file=round(statistics.median(t["file"][0] / t[args.row][0] for t in turns), 3),
        cpu_over_file=round(statistics.median(t[args.row][1] / t["file"][1] for t in turns), 3))
    if args.row == "softhsm":  # where a signature's CPU goes: the module's own work, against the key file's
        attrs = signers["file"].signed_attributes(b"\0" * 32)
        held = key._free.get()  # (session, key, its generation): the module's own key object
        module = cpu_ms(lambda _: held[1].sign(attrs, mechanism=pkcs11.Mechanism.SHA256_RSA_PKCS), range(300))
        key._free.put(held)
        rows[args.row].update(module_sign_ms=round(module, 3),
                              wrapped_sign_ms=round(cpu_ms(key.sign, [attrs] * 300), 3),
                              file_sign_ms=round(cpu_ms(signers["file"].sign, [attrs] * 300), 3))
    print(json.dumps(rows))

if __name__ == "__main__":
    main()
