"""PDFs of notes rendered apart, put together."""

from __future__ import annotations

from io import BytesIO

import pikepdf


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
