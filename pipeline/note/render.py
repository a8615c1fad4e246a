"""Note data -> PDF bytes with Typst; one compiler per process, reused for every note.

Creating a compiler scans the fonts (tens of ms); compiling a typical note is a few ms.
Tagged PDF is off by default: it doubled compile time and grew files ~8x here, and the
archive of record is the signed PDF, not an accessibility edition.
"""

from __future__ import annotations

import json
from functools import lru_cache
from io import BytesIO

import pikepdf
import typst

from pipeline.settings import TEMPLATES

TEMPLATE = TEMPLATES / "contract_note.typ"


class RenderError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def compiler() -> typst.Compiler:
    return typst.Compiler(str(TEMPLATE), root=str(TEMPLATES))


def render(note: dict, tagged: bool = False) -> bytes:
    try:
        return compiler().compile(format="pdf", sys_inputs={"note": json.dumps(note)}, pdf_tags=tagged)
    except typst.TypstError as e:
        raise RenderError(f"note {note['note']['number']}: {e.message}") from None


def merge(parts: list[bytes]) -> bytes:
    """Join page ranges rendered separately into one PDF, pages in order, keeping the
    document's metadata (Title, Author, Subject, Keywords; the XMP stream) from the first."""
    with pikepdf.Pdf.new() as out:
        sources = [pikepdf.Pdf.open(BytesIO(p)) for p in parts]
        for src in sources:
            out.pages.extend(src.pages)
        first = sources[0]
        for name, value in first.docinfo.items():
            out.docinfo[name] = value
        if "/Metadata" in first.Root:
            out.Root.Metadata = out.copy_foreign(first.Root.Metadata)
        buf = BytesIO()
        out.save(buf)
        for src in sources:
            src.close()
        return buf.getvalue()
