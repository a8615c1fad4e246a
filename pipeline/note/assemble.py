"""PDFs of notes: cut out of one compile, or put together from page ranges rendered apart.

The template leaves the document's metadata to this module: a compile holds several
clients' notes, so Title, Subject and Keywords are each note's own only once it is cut out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from io import BytesIO
from itertools import chain
from xml.sax.saxutils import escape

import pikepdf

from pipeline.note.cut import MADE, Compile, NotCut, join


class PaginationError(RuntimeError):
    """A compile's pages are not what its notes' pagination promised: cut by those counts, a
    page would land in another client's note, so nothing of that compile is kept."""


def split(pdf: bytes, notes: list[dict]) -> list[bytes]:
    """One file a note, with its own metadata, out of a compile of `notes` in order. Each
    note's pages are its `pages`; pagination can only add pages (a page that overflows),
    so a total that matches means each note has exactly its own. Cut by copying the compile's
    objects (cut.py), or with pikepdf where the compile is not of the shape that copies."""
    promised = sum(len(n["pages"]) for n in notes)
    try:
        whole = Compile(pdf)
        if len(notes) == 1:  # all its pages, as many as it printed
            return [_cut(whole, 0, len(whole.pages), notes[0])]
        if len(whole.pages) != promised:
            raise PaginationError(f"{len(notes)} notes compiled to {len(whole.pages)} pages, {promised} promised")
        out, at = [], 0
        for note in notes:
            out.append(_cut(whole, at, len(note["pages"]), note))
            at += len(note["pages"])
        return out
    except NotCut:
        return _split_by_qpdf(pdf, notes, promised)


def _cut(whole: Compile, first: int, count: int, note: dict) -> bytes:
    return whole.cut(first, count, *_metadata(note, whole.made))


def _metadata(note: dict, made: dict[str, str]) -> tuple[dict[str, str], bytes]:
    """The note's Info and XMP, for a file copied from a compile whose Creator and dates are `made`."""
    meta = _meta(note)
    return {**made, **meta}, _xmp(meta, made)


def _split_by_qpdf(pdf: bytes, notes: list[dict], promised: int) -> list[bytes]:
    """A lone note keeps the whole compile (a tagged PDF keeps its structure tree, which
    cutting pages out would drop)."""
    with pikepdf.open(BytesIO(pdf)) as whole:
        made = {name: str(whole.docinfo[name]) for name in MADE}
        if len(notes) == 1:
            describe(whole, notes[0], made)
            return [_saved(whole)]
        if len(whole.pages) != promised:
            raise PaginationError(f"{len(notes)} notes compiled to {len(whole.pages)} pages, {promised} promised")
        out, at = [], 0
        for note in notes:
            with pikepdf.new() as one:
                one.pages.extend(whole.pages[at:at + len(note["pages"])])
                at += len(note["pages"])
                _as_compiled(one, whole, note)
                out.append(_saved(one))
        return out


def describe(doc: pikepdf.Pdf, note: dict, made: dict[str, str]) -> None:
    """The note's metadata, in the document information and in XMP (the fields Typst wrote when a
    compile was one note): what a reader's Properties dialog and a search index show. `made`:
    the compile's Creator, CreationDate and ModDate."""
    meta = _meta(note)
    doc.trailer.Info = doc.make_indirect(pikepdf.Dictionary({**made, **meta}))
    doc.Root.Metadata = doc.make_stream(_xmp(meta, made), Type=pikepdf.Name.Metadata, Subtype=pikepdf.Name.XML)


def _meta(note: dict) -> dict[str, str]:
    number, ucc, date = note["note"]["number"], note["client"]["ucc"], note["note"]["trade_date"]
    broker = note["broker"]
    return {
        "/Title": f"Contract Note {number}",
        "/Author": broker["name"],
        "/Subject": f"Contract note cum tax invoice for trade date {date}, client {ucc}",
        "/Keywords": ", ".join(("contract note", "tax invoice", f"SAC {broker['sac_code']}", number)),
    }


def _xmp(meta: dict[str, str], made: dict[str, str]) -> bytes:
    """What a reader or an index uses: title, description, keywords, author, tool and dates
    (not Typst's page count, rendition class and document ids: the note's number says which;
    nor its language, which the catalog's /Lang holds)."""
    e = {k: escape(v) for k, v in {**made, **meta}.items()}
    created = _iso(made["/CreationDate"])
    alt = '<rdf:Alt><rdf:li xml:lang="x-default">{}</rdf:li></rdf:Alt>'
    return (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?><x:xmpmeta xmlns:x="adobe:ns:meta/">'
        '<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description rdf:about="" '
        'xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:xmp="http://ns.adobe.com/xap/1.0/" '
        'xmlns:pdf="http://ns.adobe.com/pdf/1.3/">'
        f'<dc:title>{alt.format(e["/Title"])}</dc:title>'
        f'<dc:description>{alt.format(e["/Subject"])}</dc:description>'
        f'<pdf:Keywords>{e["/Keywords"]}</pdf:Keywords>'
        f'<dc:creator><rdf:Seq><rdf:li>{e["/Author"]}</rdf:li></rdf:Seq></dc:creator>'
        f'<xmp:CreatorTool>{e["/Creator"]}</xmp:CreatorTool>'
        f'<xmp:ModifyDate>{created}</xmp:ModifyDate><xmp:CreateDate>{created}</xmp:CreateDate>'
        '</rdf:Description></rdf:RDF></x:xmpmeta><?xpacket end="r"?>'
    ).encode()


def _iso(pdf_date: str) -> str:
    """D:20261126165941Z -> 2026-11-26T16:59:41+00:00 (Typst writes UTC)."""
    d = pdf_date.removeprefix("D:")
    return f"{d[0:4]}-{d[4:6]}-{d[6:8]}T{d[8:10]}:{d[10:12]}:{d[12:14]}+00:00" if len(d) >= 14 else ""


def _saved(doc: pikepdf.Pdf) -> bytes:
    buf = BytesIO()
    doc.save(buf, stream_decode_level=pikepdf.StreamDecodeLevel.none, fix_metadata_version=False,
             object_stream_mode=pikepdf.ObjectStreamMode.generate)
    return buf.getvalue()


def merge(parts: Iterable[bytes], note: dict) -> bytes:
    """Join a note's page ranges, each Typst's own compile (render.compiled), into the note's
    one PDF, pages in order, with the note's metadata. `parts` may be a generator that waits
    for each range: each is read as it comes, while the later ranges still render, so what is
    left after the last is that range and the writing. Joined by copying the compiles' objects
    (cut.join), or with pikepdf where a compile is not of the shape that copies."""
    parts, seen = iter(parts), []  # once each: pikepdf takes those seen, then the rest

    def read() -> Iterator[Compile]:
        for pdf in parts:
            seen.append(pdf)
            yield Compile(pdf)

    compiles = read()
    try:
        first = next(compiles, None)
        if first is None:
            raise ValueError(f"note {note['note']['number']}: no page range to merge")
        return join(chain([first], compiles), *_metadata(note, first.made))
    except NotCut:
        return _merge_by_qpdf(chain(seen, parts), note)


def _merge_by_qpdf(parts: Iterable[bytes], note: dict) -> bytes:
    with ExitStack() as opened:
        out = opened.enter_context(pikepdf.Pdf.new())
        first = None
        for part in parts:
            src = opened.enter_context(pikepdf.Pdf.open(BytesIO(part)))
            out.pages.extend(src.pages)
            first = first or src
        _as_compiled(out, first, note)
        return _saved(out)


def _as_compiled(doc: pikepdf.Pdf, whole: pikepdf.Pdf, note: dict) -> None:
    """A note's file made of pages of `whole` (a compile): its catalog's language and viewer
    preferences, and the note's metadata."""
    doc.Root.Lang = whole.Root.Lang
    doc.Root.ViewerPreferences = pikepdf.Dictionary(whole.Root.ViewerPreferences)
    describe(doc, note, {name: str(whole.docinfo[name]) for name in MADE})
