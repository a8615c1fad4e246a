"""Signing cost per note, ours against naive pyhanko, in one run on the same notes.

  naive_ms        pyhanko as documented: SimpleSigner.load + sign_pdf per note (the baseline)
  sign_ms         ours, signature only
  sign_aes256_ms  ours, AES-256 (R6) encryption + signature (the default)
  sign_aes128_ms  ours, AES-128 (R4) encryption + signature
  floor_ms        SHA-256 over the file + one RSA-2048 signature: nothing can go below this
All are CPU milliseconds per note (process time). Prints one JSON object as its last line.

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
    result["naive_over_ours"] = round(result["naive_ms"] / result["sign_ms"], 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
