"""Rendering: what the template prints, read back from the PDF with poppler's pdftotext."""

from __future__ import annotations

import datetime as dt
import io
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.day import synth
from pipeline.day.dumps import Client, effective_trades, parse_trade
from pipeline.note.charges import compute
from pipeline.note.content import build_note, money
from pipeline.note import fonts
from pipeline.note.assemble import _split_by_qpdf, merge, split
from pipeline.note.cut import Compile, NotCut
from pipeline.note.render import RenderError, _Compiler, compiled, compiler, render, render_all
from pipeline.stages import broker

TRADE_DATE = "2026-11-20"


def sample_trades(n: int, ucc: str = "C0000042", seed: int = 5, mixed: bool = False):
    """`mixed`: a client who also trades currency, commodities and BSE's index options."""
    rng = random.Random(seed)
    mix = random.Random(seed + 1) if mixed else None
    rows = list(synth._trades(rng, dt.date.fromisoformat(TRADE_DATE), ucc, n, synth._Numbers(rng), mix))
    closes = synth.closing_prices(dt.date.fromisoformat(TRADE_DATE), rows)
    return effective_trades([parse_trade("trades.csv", i, r, TRADE_DATE, closes) for i, r in enumerate(rows, 1)])


def sample_client(name: str = "Aarav Iyer", state: str = "Maharashtra", code: str = "27") -> Client:
    return Client("C0000042", name, "ABCPD1234E", "c42@example.com", "12, MG Road, Mumbai", state, code, True)


def sample_note(trades: int = 12, client: Client | None = None, symbol: str | None = None) -> dict:
    client = client or sample_client()
    ts = sample_trades(trades)
    if symbol:
        ts = [t.__class__(**{**t.__dict__, "symbol": symbol}) for t in ts]
    b = broker()
    charges = compute(ts, TRADE_DATE, client.gst_state_code == b["gst_state_code"], b["tariff"])
    return build_note(client, ts, charges, b, TRADE_DATE, "CNT-26/27-0000042")


def pdf_text(pdf: bytes, tmp_path: Path) -> str:
    path = tmp_path / "note.pdf"
    path.write_bytes(pdf)
    return subprocess.run(["pdftotext", "-layout", str(path), "-"], capture_output=True, text=True, check=True).stdout


def page_count(pdf: bytes, tmp_path: Path) -> int:
    path = tmp_path / "count.pdf"
    path.write_bytes(pdf)
    info = subprocess.run(["pdfinfo", str(path)], capture_output=True, text=True, check=True).stdout
    return int(next(line.split()[-1] for line in info.splitlines() if line.startswith("Pages:")))


@pytest.mark.parametrize("name", [
    'A*B [Traders] #1 $x$ \\"Q" _under_ <tag> @ref',
    "#set text(red)",
    "राहुल वर्मा",
    "கார்த்திக் சுப்ரமணியன்",
    "Ελένη Παπαδοπούλου Łukasz Żółć",  # Greek outside the lean faces, Latin Extended-A inside
])
def test_names_and_symbols_with_typst_syntax_or_other_scripts_render_literally(tmp_path, name):
    note = sample_note(5, sample_client(name=name), symbol="A#B*[C]")
    text = pdf_text(render(note), tmp_path)
    assert name in text
    assert "A#B*[C]" in text


@pytest.mark.parametrize("trades", [1, 20, 60, 400])
def test_the_page_count_is_what_pagination_promised(tmp_path, trades):
    note = sample_note(trades)
    pdf = render(note)
    assert page_count(pdf, tmp_path) == note["total_pages"]
    assert f"Page {note['total_pages']} of {note['total_pages']}" in pdf_text(pdf, tmp_path)


def test_no_trade_count_overflows_a_page_or_pushes_the_levies_off(tmp_path):
    for trades in range(1, 170, 4):
        note = sample_note(trades)
        assert page_count(render(note), tmp_path) == note["total_pages"], f"{trades} trades"


def test_a_note_across_every_segment_never_overflows_a_page_either(tmp_path):
    """Up to eight sections and their headings, and the CTT line in the levies."""
    from pipeline.note.charges import compute
    from pipeline.note.content import build_note
    from pipeline.stages import broker

    b = broker()
    for n in range(1, 170, 3):
        trades = sample_trades(n, seed=n, mixed=True)
        note = build_note(sample_client(), trades, compute(trades, TRADE_DATE, False, b["tariff"]), b, TRADE_DATE,
                          "CNT-26/27-0000042")
        assert page_count(render(note), tmp_path) == note["total_pages"], f"{n} trades"


def test_page_ranges_rendered_apart_merge_into_one_continuous_note(tmp_path):
    """Joined by copying each range's objects: the pages in order, the note's metadata, the
    catalog's language, and nothing qpdf finds wrong."""
    import pikepdf

    from pipeline.note.content import page_range

    note = sample_note(400)
    total = note["total_pages"]
    parts = [compiled(page_range(note, a, min(a + 3, total))) for a in range(0, total, 3)]
    merged = merge(iter(parts), note)
    assert merged.count(b"/Type/ObjStm") == 1  # joined by the copy, not by pikepdf
    assert_one_continuous_note(merged, note, tmp_path)
    with pikepdf.open(io.BytesIO(merged)) as opened:
        assert str(opened.Root.Lang) == "en"


def test_page_ranges_of_a_shape_the_copy_does_not_join_are_merged_by_qpdf(tmp_path):
    """A tagged range (its structure tree) is not joined by the copy, though the ranges before
    it were read for the copy already: pikepdf merges them all, in order."""
    from pipeline.note.content import page_range
    from pipeline.note.cut import Compile

    note = sample_note(400)
    total = note["total_pages"]
    parts = [compiled(page_range(note, a, min(a + 3, total)), tagged=a == 3) for a in range(0, total, 3)]
    with pytest.raises(NotCut, match="tagged"):
        Compile(parts[1])
    for given in (iter(parts), parts):  # a list too: the range read for the copy is not merged twice
        merged = merge(given, note)
        assert b"/Type/ObjStm" not in merged  # pikepdf writes "/Type /ObjStm"
        assert_one_continuous_note(merged, note, tmp_path)


def test_page_ranges_too_many_objects_for_one_object_stream_are_merged_by_qpdf(tmp_path, monkeypatch):
    """Every range read and copied before the count is known (a note of some 30,000 pages
    packs more objects than a cross-reference row can index): pikepdf merges them instead."""
    from pipeline.note import cut
    from pipeline.note.content import page_range

    note = sample_note(400)
    total = note["total_pages"]
    parts = [compiled(page_range(note, a, min(a + 3, total))) for a in range(0, total, 3)]
    monkeypatch.setattr(cut, "MAX_PACKED", 8)  # the limit, not the code: 65,536 objects need ~30,000 pages
    merged = merge(parts, note)
    assert b"/Type/ObjStm" not in merged
    assert_one_continuous_note(merged, note, tmp_path)


def assert_one_continuous_note(merged: bytes, note: dict, tmp_path: Path) -> None:
    total = note["total_pages"]
    assert page_count(merged, tmp_path) == total
    text = pdf_text(merged, tmp_path)
    pages = text.split("\f")[:-1]
    assert [f"Page {k} of {total}" in page for k, page in enumerate(pages, 1)] == [True] * total
    assert text.count("CONTRACT NOTE CUM TAX INVOICE") == 1
    assert text.count("Levies and charges") == 1
    info = pdf_info(merged, tmp_path)
    assert info["Title"] == "Contract Note CNT-26/27-0000042"
    assert info["Author"] == broker()["name"]
    assert info["Subject"] == "Contract note cum tax invoice for trade date 20-11-2026, client C0000042"
    assert "SAC 997152" in info["Keywords"] and "CNT-26/27-0000042" in info["Keywords"]
    assert info["Creator"].startswith("Typst")
    (tmp_path / "merged.pdf").write_bytes(merged)
    check = subprocess.run(["qpdf", "--check", str(tmp_path / "merged.pdf")], capture_output=True, text=True)
    assert check.returncode == 0 and "No syntax or stream encoding errors" in check.stdout, check.stdout


def client_note(i: int, trades: int) -> dict:
    client = Client(f"C00001{i:02d}", f"Client Number{i}", f"ABCPD{i:04d}E", f"c{i}@example.com", f"{i}, MG Road",
                    "Maharashtra", "27", True)
    ts = sample_trades(trades, client.ucc, seed=i)
    charges = compute(ts, TRADE_DATE, False, broker()["tariff"])
    return build_note(client, ts, charges, broker(), TRADE_DATE, f"CNT-26/27-00001{i:02d}")


def assert_only_its_own(pdf: bytes, note: dict, others: list[dict], tmp_path: Path) -> None:
    """Every page of the note, and nothing of another client's: read back by poppler."""
    total, ucc, number = note["total_pages"], note["client"]["ucc"], note["note"]["number"]
    text = pdf_text(pdf, tmp_path)
    assert page_count(pdf, tmp_path) == total
    assert all(f"Page {p} of {total}" in text for p in range(1, total + 1))
    assert text.count(f"{number} · {ucc}") == total and note["client"]["pan"] in text  # each page's footer
    for other in others:
        assert other["client"]["ucc"] not in text and other["client"]["pan"] not in text
    info = pdf_info(pdf, tmp_path)
    assert info["Title"] == f"Contract Note {number}"
    assert info["Subject"] == f"Contract note cum tax invoice for trade date 20-11-2026, client {ucc}"


def test_a_shard_compiled_together_is_cut_into_each_client_own_note(tmp_path):
    notes = [client_note(i, trades) for i, trades in enumerate([3, 70, 12, 1, 130, 20])]
    pdfs = render_all(notes)
    assert all(isinstance(p, bytes) for p in pdfs)
    for note, pdf in zip(notes, pdfs):
        assert_only_its_own(pdf, note, [n for n in notes if n is not note], tmp_path)
        assert set(embedded_faces(pdf)) == {"NotoSans-Regular", "NotoSans-Bold", "NotoSansMono-Regular"}


def test_a_note_that_outgrows_its_pages_in_a_compile_leaves_no_page_in_another_note(tmp_path):
    """Cut by the promised page counts, an extra page would shift every later note's pages
    into its neighbour's file: the compile's page count is checked, and the notes compiled alone."""
    notes = [client_note(i, 20) for i in range(3)]
    group = notes[1]["pages"][0]["groups"][0]
    group["lines"] = group["lines"] * 40  # more than a page holds
    pdfs = render_all(notes)
    for i in (0, 2):
        assert_only_its_own(pdfs[i], notes[i], [n for n in notes if n is not notes[i]], tmp_path)
    assert page_count(pdfs[1], tmp_path) > notes[1]["total_pages"]  # as a lone compile printed it before
    assert notes[0]["client"]["ucc"] not in pdf_text(pdfs[1], tmp_path)


def test_a_note_typst_cannot_compile_fails_alone_and_its_compile_mates_render(tmp_path):
    notes = [client_note(i, 5) for i in range(3)]
    notes[1]["pages"][0]["groups"][0]["lines"] = 7  # not lines: the template cannot join them
    pdfs = render_all(notes)
    assert isinstance(pdfs[1], RenderError) and notes[1]["note"]["number"] in str(pdfs[1])
    for i in (0, 2):
        assert_only_its_own(pdfs[i], notes[i], [n for n in notes if n is not notes[i]], tmp_path)
    notes[1]["pages"][0]["groups"][0]["lines"] = "a  line"  # a text, not lines: not spaced into a list of letters
    assert isinstance(render_all(notes)[1], RenderError)


def test_notes_cut_by_copying_the_compile_s_objects_read_as_qpdf_cuts_them(tmp_path):
    """cut.py copies a note's objects as Typst wrote them; qpdf parses and writes them again.
    Poppler reads the same pages and metadata from both, and qpdf finds nothing wrong."""
    notes = [client_note(i, trades) for i, trades in enumerate([3, 70, 12, 1, 130, 20])]
    pdf = compiler().compile(notes, False)
    copied, by_qpdf = split(pdf, notes), _split_by_qpdf(pdf, notes, sum(len(n["pages"]) for n in notes))
    for one, other in zip(copied, by_qpdf):
        assert b"/Type/ObjStm" in one  # copied (what pikepdf writes says /Type /ObjStm)
        assert pdf_text(one, tmp_path) == pdf_text(other, tmp_path)
        kept = pdf_info(one, tmp_path)
        assert kept.pop("PDF version") == "1.7"  # Typst's, where pikepdf's new file said 1.5
        differ = ("File size", "Optimized", "PDF version")
        assert {k: v for k, v in kept.items() if k not in differ} == {
            k: v for k, v in pdf_info(other, tmp_path).items() if k not in differ}
        (tmp_path / "one.pdf").write_bytes(one)
        check = subprocess.run(["qpdf", "--check", str(tmp_path / "one.pdf")], capture_output=True, text=True)
        assert check.returncode == 0 and "No syntax or stream encoding errors" in check.stdout, check.stdout


def _restated(pdf: bytes, change=None, **save) -> bytes:
    import io

    import pikepdf

    with pikepdf.open(io.BytesIO(pdf)) as doc:
        if change:
            change(doc)
        out = io.BytesIO()
        doc.save(out, **save)
        return out.getvalue()


def test_a_compile_not_of_the_copied_shape_is_cut_by_qpdf(tmp_path):
    import pikepdf

    notes = [client_note(i, 5) for i in range(3)]
    streams = _restated(compiler().compile(notes, False), object_stream_mode=pikepdf.ObjectStreamMode.generate)
    with pytest.raises(NotCut):
        Compile(streams)
    for note, pdf in zip(notes, split(streams, notes)):
        assert_only_its_own(pdf, note, [n for n in notes if n is not note], tmp_path)


def test_a_page_that_reaches_another_note_s_page_is_never_copied():
    """A link from one note's page to the next note's page would copy that page's text."""
    from pikepdf import Array, Dictionary, Name, ObjectStreamMode

    notes = [client_note(i, 5) for i in range(2)]

    def link(doc):
        doc.pages[0].obj.Annots = Array([doc.make_indirect(Dictionary(
            Type=Name.Annot, Subtype=Name.Link, Rect=Array([0, 0, 9, 9]), Dest=Array([doc.pages[1].obj, Name.Fit])))])

    plain = Compile(_restated(compiler().compile(notes, False), object_stream_mode=ObjectStreamMode.disable))
    assert plain.cut(0, 1, {}, b"")  # qpdf's plain objects are of the shape
    linked = Compile(_restated(compiler().compile(notes, False), link, object_stream_mode=ObjectStreamMode.disable))
    with pytest.raises(NotCut, match="another page"):
        linked.cut(0, 1, {}, b"")
    assert linked.cut(1, 1, {}, b"")


def test_what_the_copy_would_get_wrong_is_left_to_qpdf():
    """An Info string with an escape the copy does not decode; a page size inherited from the
    page tree, which a note's own /Pages would drop; a reference split over lines, which a
    reader of single spaces would miss."""
    from pikepdf import Array, ObjectStreamMode

    notes = [client_note(i, 5) for i in range(2)]
    pdf = compiler().compile(notes, False)
    plain = ObjectStreamMode.disable

    def creator(doc):
        doc.docinfo["/Creator"] = "Typst\n0.15"

    def inherited(doc):
        doc.Root.Pages.MediaBox = Array([0, 0, 100, 100])

    for change in (creator, inherited):
        with pytest.raises(NotCut):
            Compile(_restated(pdf, change, object_stream_mode=plain))
    page = Compile(pdf).pages[0]
    split_ref = re.sub(rb"(/Contents \d+) 0 R", rb"\1\n0 R", pdf, count=1)  # the same length: the table holds
    assert split_ref != pdf and Compile(split_ref).refs(page) == Compile(pdf).refs(page)


def pdf_info(pdf: bytes, tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "info.pdf"
    path.write_bytes(pdf)
    out = subprocess.run(["pdfinfo", str(path)], capture_output=True, text=True, check=True).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}


def test_money_uses_indian_grouping_and_brackets_what_the_client_pays():
    from decimal import Decimal

    assert money(Decimal("1234567.891")) == "12,34,567.89"
    assert money(Decimal("-999.5")) == "(999.50)"
    assert money(Decimal("0")) == "0.00"
    assert money(Decimal("12.5"), 4) == "12.5000"


def embedded_faces(pdf: bytes) -> dict[str, set[str]]:
    """Each embedded font's PostScript name (subset tag dropped) and the tables of its program."""
    import io

    import pikepdf
    from fontTools.ttLib import TTFont

    faces = {}
    with pikepdf.open(io.BytesIO(pdf)) as doc:
        for obj in doc.objects:
            if isinstance(obj, pikepdf.Dictionary) and "/FontFile2" in obj:
                program = TTFont(io.BytesIO(obj.FontFile2.read_bytes()))
                faces[str(obj.FontName).split("+")[-1]] = set(program.keys())
    return faces


def test_notes_embed_the_lean_faces_without_hinting_and_fall_back_for_other_scripts(tmp_path):
    faces = embedded_faces(render(sample_note(12)))
    assert {"NotoSans-Regular", "NotoSans-Bold", "NotoSansMono-Regular"} <= set(faces)
    assert all("fpgm" not in tables and "prep" not in tables for tables in faces.values()), faces
    note = sample_note(5, sample_client(name="राहुल Ελένη"))
    faces = embedded_faces(render(note))
    assert "NotoSansDevanagari-Regular" in faces and "NotoSans-Regular" in faces
    assert "राहुल Ελένη" in pdf_text(render(note), tmp_path)


def test_the_lean_faces_are_made_from_the_system_fonts_and_named_apart(tmp_path, monkeypatch):
    from fontTools.ttLib import TTFont

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fonts.lean_font_dir.cache_clear()
    try:
        made = fonts.lean_font_dir()
        assert made is not None and made.parent == tmp_path / "contract-notes"
        for face in fonts.FACES:
            font = TTFont(made / f"{face}.ttf")
            assert font["name"].getDebugName(1).startswith("CN Noto Sans")
            assert font["name"].getDebugName(6) == face  # the name a PDF shows
            assert "fpgm" not in font and 0x20B9 in font.getBestCmap()
            # the trade table's faces shape without layout tables; the text faces keep their kerning
            assert ("GSUB" in font, "GPOS" in font, "GDEF" in font) == (("Mono" not in face,) * 3), face
            if "Mono" in face:  # the padding's wide spaces (pipeline/note/spaced.py)
                cmap, advance = font.getBestCmap(), font["hmtx"]
                assert {c: advance[cmap[c]][0] / advance[cmap[0x20]][0] for c in fonts.WIDE_SPACES} == fonts.WIDE_SPACES
                assert font["hhea"].advanceWidthMax == max(a for a, _ in advance.metrics.values())
        assert fonts.wide_spaces(made) and _Compiler().spaced
    finally:
        fonts.lean_font_dir.cache_clear()


def test_faces_without_wide_spaces_of_their_own_keep_the_padding_as_spaces(tmp_path, monkeypatch, caplog):
    """A face whose wide spaces are not blank glyphs of their own (here: "A" in their place) is
    not widened, and the padding goes to Typst as spaces: a wide space a cell wide would close
    up the columns."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(fonts, "WIDE_SPACES", {0x2002: 2, ord("A"): 4})
    fonts.lean_font_dir.cache_clear()
    try:
        made = fonts.lean_font_dir()
        assert made is not None and not fonts.wide_spaces(made)
        assert "no wide spaces of its own" in caplog.text
        assert not _Compiler().spaced
    finally:
        fonts.lean_font_dir.cache_clear()


def test_a_cached_directory_that_lost_a_face_is_not_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fonts.lean_font_dir.cache_clear()
    try:
        made = fonts.lean_font_dir()
        (made / "NotoSansMono-Regular.ttf").unlink()  # a cache cleaner's, file by file
        fonts.lean_font_dir.cache_clear()
        assert fonts.lean_font_dir() is None
        assert "lacks NotoSansMono-Regular" in caplog.text
        assert not _Compiler().spaced
    finally:
        fonts.lean_font_dir.cache_clear()


def test_without_the_system_faces_to_make_them_from_notes_render_with_the_system_fonts(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(fonts, "SYSTEM_FONTS", tmp_path / "nowhere")
    fonts.lean_font_dir.cache_clear()
    try:
        assert fonts.lean_font_dir() is None
        assert "render with the system's fonts" in caplog.text
        system = _Compiler()
        assert not system.spaced  # the system's wide spaces are a cell wide: the padding stays spaces
        faces = embedded_faces(system.compile([sample_note(3)], tagged=False))
        assert "fpgm" in faces["NotoSans-Regular"]  # the system's own, hinted
    finally:
        fonts.lean_font_dir.cache_clear()


def test_padding_set_as_wide_spaces_leaves_every_page_the_same_to_the_pixel(tmp_path):
    """The table's padding as the lean faces' wide spaces (pipeline/note/spaced.py) against the
    same note's spaces, one glyph a cell: the same pixels on every page, the same words in the
    same boxes."""
    ts = sample_trades(90, mixed=True)
    b = broker()
    note = build_note(sample_client(), ts, compute(ts, TRADE_DATE, True, b["tariff"]), b, TRADE_DATE, "CNT-26/27-0000042")
    spaced, plain = _Compiler(), _Compiler()
    plain.spaced = False
    assert spaced.spaced, "the lean faces: fontTools and the system's Noto faces"
    pdfs = {"spaced": spaced.compile([note], tagged=False), "plain": plain.compile([note], tagged=False)}
    assert len(pdfs["spaced"]) < len(pdfs["plain"])  # fewer glyphs written
    pixels, words = {}, {}
    for kind, pdf in pdfs.items():
        (tmp_path / f"{kind}.pdf").write_bytes(pdf)
        subprocess.run(["pdftoppm", "-r", "100", "-gray", str(tmp_path / f"{kind}.pdf"), str(tmp_path / kind)],
                       check=True)
        pixels[kind] = [p.read_bytes() for p in sorted(tmp_path.glob(f"{kind}-*.pgm"))]
        words[kind] = [line for line in subprocess.run(["pdftotext", "-bbox", str(tmp_path / f"{kind}.pdf"), "-"],
                                                       capture_output=True, text=True, check=True).stdout.splitlines()
                       if "<word " in line]  # each word with its box, as poppler finds them
    assert len(pixels["spaced"]) == note["total_pages"] > 2
    assert pixels["spaced"] == pixels["plain"]
    assert len(words["spaced"]) > 1000 and words["spaced"] == words["plain"]


def test_the_note_file_lives_only_for_its_compile_in_a_directory_of_the_process_own(tmp_path):
    render(sample_note(3))
    private = compiler().dir
    assert private.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in private.iterdir()) == [".held", "contract_note.typ"]


def test_a_render_process_clears_what_dead_ones_left_and_not_what_live_ones_hold(tmp_path):
    """Judged by the directory's lock, not by PID: in the ray up test, render workers in the
    simulated instances' PID namespaces removed the host's live directories (they share
    /dev/shm and cannot see its PIDs)."""
    dead = _Compiler(parent=tmp_path)  # its lock let go, as a dead process's is
    dead._held.close()
    (dead.dir / "notes.json").write_text('[{"client": {"pan": "ABCPD1234E"}}]')
    holder = subprocess.Popen(  # another process, alive, holding its own directory
        [sys.executable, "-c", "import sys; from pathlib import Path; from pipeline.note.render import _Compiler; "
         "c = _Compiler(parent=Path(sys.argv[1])); print(c.dir.name, flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        live = tmp_path / holder.stdout.readline().strip()
        assert live.is_dir() and not dead.dir.exists()  # the holder's sweep took the dead one
        being_made = tmp_path / "cn-render-new"  # made, its lock not yet taken
        being_made.mkdir()
        made = _Compiler(parent=tmp_path)
        assert live.is_dir() and being_made.is_dir() and made.dir.is_dir()
        assert b"%PDF" in made.compile([sample_note(3)], tagged=False)[:8]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_sweep_between_a_directory_s_making_and_its_lock_leaves_it_alone(tmp_path, monkeypatch):
    """Another render process's sweep, run at the worst moment: after this one made its lock
    file, before it took the lock (as a render worker in the clean clone's suite lost its
    directory: FileNotFoundError copying the template)."""
    import fcntl

    from pipeline.note import render as module

    real, swept = fcntl.flock, []

    def flock_after_a_sweep(fd, op):
        if not swept:
            swept.append(True)
            module._sweep(tmp_path)  # the other process's, between this one's open and flock
        return real(fd, op)

    monkeypatch.setattr(module.fcntl, "flock", flock_after_a_sweep)
    made = _Compiler(parent=tmp_path)
    assert swept and made.dir.is_dir() and made.dir.name.startswith("cn-render-")
    assert b"%PDF" in made.compile([sample_note(3)], tagged=False)[:8]
