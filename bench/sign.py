"""Signing cost per note, ours against naive pyhanko, in one run on the same notes.

  naive_ms        pyhanko as documented: SimpleSigner.load + sign_pdf per note (the baseline)
  sign_ms         ours, signature only
  sign_aes256_ms  ours, AES-256 (R6) encryption + signature (the default)
  sign_aes128_ms  ours, AES-128 (R4) encryption + signature
  floor_ms        SHA-256 over the file + one RSA-2048 signature: nothing can go below this
All are CPU milliseconds per note (process time). Then the key on an HSM (issue 41), each row a
signer actor's work (sign + AES-256, `Signer.each`, as many at once as the key has sessions):
  hsm.file          the key file (the baseline of the rows below)
  hsm.softhsm       SoftHSM2 in this process (CPU ratio to the file key: the target is <= 1.10)
  hsm.p11kit        SoftHSM2 behind `p11-kit server`, through p11-kit-client.so: a network HSM
  hsm.p11kit_5ms    the same with 5 ms added to every round trip by a delaying proxy (notes/s
                    ratio to the file key: the target is >= 0.95)
each with notes/s (wall), CPU ms a note (this process; the server's is the HSM's), sessions and
the measured round trip of one signature. Prints one JSON object as its last line.

    python bench/sign.py [--notes 200]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cryptography.hazmat.primitives import hashes  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import padding  # noqa: E402
from pyhanko.pdf_utils.incremental_writer import IncrementalPdfFileWriter  # noqa: E402
from pyhanko.sign import fields, signers  # noqa: E402

from pipeline.note.render import render  # noqa: E402
from pipeline.seal.sign import SignatureInfo, load_signer, make_test_certificate, protect  # noqa: E402
from tests.test_render import sample_note  # noqa: E402

OWNER = "broker-owner-secret"


def cpu_ms(fn, items) -> float:
    fn(items[0])
    started = time.process_time()
    for item in items:
        fn(item)
    return (time.process_time() - started) * 1000 / len(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notes", type=int, default=200)
    args = parser.parse_args()
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
            signer.key.sign(hashlib.sha256(item[0]).digest(), padding.PKCS1v15(), hashes.SHA256())

        result = {
            "notes": args.notes,
            "typical_pdf_kb": round(sum(map(len, notes)) / len(notes) / 1024, 1),
            "naive_ms": round(cpu_ms(naive, items[: max(20, args.notes // 5)]), 2),
            "sign_ms": round(cpu_ms(lambda i: protect(i[0], i[1], OWNER, signer, info, "none"), items), 2),
            "sign_aes256_ms": round(cpu_ms(lambda i: protect(i[0], i[1], OWNER, signer, info, "aes256"), items), 2),
            "sign_aes128_ms": round(cpu_ms(lambda i: protect(i[0], i[1], OWNER, signer, info, "aes128"), items), 2),
            "floor_ms": round(cpu_ms(floor, items), 3),
        }
        result["hsm"] = hsm_rows(items, signer, info, Path(tmp), args.notes)
    result["naive_over_ours"] = round(result["naive_ms"] / result["sign_ms"], 1)
    file_row, rows = result["hsm"]["file"], result["hsm"]
    result["softhsm_cpu_over_file"] = round(rows["softhsm"]["cpu_ms"] / file_row["cpu_ms"], 3)
    result["p11kit_5ms_notes_per_s_over_file"] = round(rows["p11kit_5ms"]["notes_per_s"] / file_row["notes_per_s"], 3)
    print(json.dumps(result))


def hsm_rows(items, file_signer, info, tmp: Path, notes: int) -> dict:
    """The same notes signed with the key file, then on a SoftHSM2 token three ways."""
    import os

    import pkcs11

    from pipeline.seal.sign import Signer
    from pipeline.seal.token import P11_KIT_CLIENT, SOFTHSM, TokenConfig, TokenKey, make_test_token
    from tests.servers import DelayingProxy, start_p11kit_server

    token = make_test_token(tmp / "hsm")
    server = start_p11kit_server(tmp / "p11-kit.sock", SOFTHSM, token.label)
    proxy = DelayingProxy(tmp / "slow.sock", tmp / "p11-kit.sock", 0.005)
    from cryptography import x509

    token_cert = x509.load_pem_x509_certificate(token.cert.read_bytes())
    rows = {"file": actor_row(file_signer, items, info, {"sessions": 1, "round_trip_ms": 0.0})}
    try:
        for name, module, address in (("softhsm", SOFTHSM, ""), ("p11kit", P11_KIT_CLIENT, server.url),
                                      ("p11kit_5ms", P11_KIT_CLIENT, proxy.address)):
            os.environ["P11_KIT_SERVER_ADDRESS"] = address
            if address:
                pkcs11.lib(module).reinitialize()  # the client module reads the address when it starts
            key = TokenKey(TokenConfig(module, token.label, token.key_label, pin=token.pin_file.read_text()))
            try:
                signer = Signer(key.sign, key.algorithm, token_cert, [], key.sessions)
                rows[name] = actor_row(signer, items, info, {"sessions": key.sessions,
                                                             "round_trip_ms": round(key.round_trip_s * 1000, 2)})
            finally:
                key.close()
    finally:
        proxy.stop()
        server.stop()
    return rows


def actor_row(signer, items, info, about: dict) -> dict:
    """What a signer actor does with a batch: sign + AES-256 `signer.workers` notes at a time."""
    work = lambda i: protect(i[0], i[1], OWNER, signer, info, "aes256")  # noqa: E731
    signer.each(work, items[:4])  # warm
    wall, cpu = time.perf_counter(), time.process_time()
    done = signer.each(work, items)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert all(isinstance(d, bytes) for d in done), [d for d in done if not isinstance(d, bytes)][:1]
    return {"notes_per_s": round(len(items) / wall, 1), "cpu_ms": round(cpu * 1000 / len(items), 2), **about}


if __name__ == "__main__":
    main()
