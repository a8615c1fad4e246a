"""Checks the tests share: independent verification of PDFs and of what the SMTP server got."""

from __future__ import annotations

import csv
import email
import subprocess
import sys
from email import policy
from io import BytesIO
from pathlib import Path

from pyhanko.keys import load_cert_from_pemder
from pyhanko.pdf_utils.reader import PdfFileReader
from pyhanko.sign.validation import validate_pdf_signature
from pyhanko_certvalidator import ValidationContext


def client_rows(day: Path) -> dict[str, dict]:
    with (day / "clients.csv").open(newline="") as f:
        return {r["ucc"]: r for r in csv.DictReader(f)}


def assert_signed_and_encrypted(pdf: Path, pan: str) -> None:
    """pdfsig (poppler) and qpdf, not our own code, say the file is signed whole and locked."""
    out = subprocess.run(["pdfsig", "-upw", pan, str(pdf)], capture_output=True, text=True)
    assert "Signature Validation: Signature is Valid." in out.stdout, out.stdout + out.stderr
    assert "Total document signed" in out.stdout, out.stdout
    assert subprocess.run(["qpdf", "--requires-password", str(pdf)]).returncode == 0, f"{pdf} is not encrypted"


def pyhanko_accepts(pdf: bytes, pan: str, root: Path) -> None:
    """pyHanko's validator, with `root` the only trust anchor, opens the note with its PAN."""
    reader = PdfFileReader(BytesIO(pdf))
    assert reader.decrypt(pan).status.name == "USER"
    status = validate_pdf_signature(reader.embedded_signatures[0], ValidationContext(
        trust_roots=[load_cert_from_pemder(str(root))]))
    assert status.bottom_line and status.intact and status.trusted and status.coverage.name == "ENTIRE_FILE"


def outbox_messages(outbox: Path) -> list[email.message.EmailMessage]:
    return [email.message_from_bytes(p.read_bytes(), policy=policy.default) for p in sorted(outbox.glob("*.eml"))]


def attachment(msg) -> tuple[str, bytes]:
    parts = [p for p in msg.iter_attachments() if p.get_content_type() == "application/pdf"]
    assert len(parts) == 1, f"{msg['Message-ID']} has {len(parts)} PDF attachments"
    return parts[0].get_filename(), parts[0].get_content()


def pipeline_counting(instrument: str, argv: list[str], **run) -> tuple[subprocess.CompletedProcess, list]:
    """`python -m pipeline ARGV` in a process of its own, after `instrument`: code that makes a
    list `counted` and patches what appends to it. Returns the process and that list, as it was
    when `main` returned or raised."""
    code = (f"import sys\nfrom pipeline.__main__ import main\ncounted = []\n{instrument}\n"
            "try:\n    code = main(sys.argv[1:])\nfinally:\n    print('COUNTED', counted, file=sys.stderr)\n"
            "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, **run)
    assert "COUNTED " in done.stderr, done.stderr[-3000:]
    return done, eval(done.stderr.rsplit("COUNTED ", 1)[1].splitlines()[0])  # noqa: S307 (our own print)
