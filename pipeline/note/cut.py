"""Notes cut out of a compile by copying its objects' bytes.

Typst writes a compile as plain objects under one cross-reference table: every page a /Page
of one /Pages, the fonts and resources shared. A note's file is its pages and what they
reference (but /Parent, back up the tree), copied as they are under the compile's object
numbers; a /Pages of its own pages under the old /Pages number, so each page's /Parent holds;
the compile's catalog; the note's metadata under the numbers the compile's had. Cut with
pikepdf, which parses, copies and writes every object again, a typical note took 0.45 ms (a
fifth of a render task's CPU under Ray); copied, 0.12.

A huge note's page ranges, each compiled apart, are joined the same way (join): each
compile's objects copied under numbers of the file's own. Joined by pikepdf, a 1,961-page
note's 40 ranges took 0.28 s of CPU, and 0.09 s more to cut each range first; copied, 0.14.

Whatever is not of that shape raises NotCut, and assemble.py cuts or merges with pikepdf: a
structure tree (a tagged note), a page that reaches a page that is not its note's, an object
the table does not place where it says, a reference of a generation other than 0 (join), more
objects than one object stream holds (a note of some 30,000 pages).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from pipeline.seal.packing import HEADER, MAX_PACKED, object_stream, page_list, xref_stream

# Strings first (what they hold is not read), then dictionaries, references, the stream keyword
# right after the top dictionary, the object's end; a parenthesis or comment left over is not followed.
_TOKENS = re.compile(rb"\((?:[^()\\]|\\.)*\)|[()%]|<<|>>|<[0-9A-Fa-f\s]*>|(\d+)\s+(\d+)\s+R\b"
                     rb"|(?<=>>)\s*(stream)\r?\n|(?<![\w/])(endobj)\b")
_ENTRY = re.compile(rb"(\d{10}) \d{5} ([nf])")
_LITERAL = re.compile(rb"/(\w+)\s*\(((?:[^()\\]|\\.)*)\)")


MADE = ("/Creator", "/CreationDate", "/ModDate")  # what a note's Info keeps of its compile's


class NotCut(ValueError):
    """The compile is not of the shape cut() copies from."""


class Compile:
    """A compile's objects, where each lies and what it references, read once for all its notes."""

    def __init__(self, pdf: bytes) -> None:
        self.pdf = pdf
        self._refs: dict[int, list[int]] = {}
        self._streams: set[int] = set()  # of the objects read so far
        self._reach: dict[int, frozenset[int] | None] = {}
        self._objects: dict[int, bytes] = {}
        self._bodies: dict[int, bytes] = {}
        try:
            at = int(pdf[pdf.rindex(b"startxref") + 9:].split(maxsplit=1)[0])
        except (ValueError, IndexError):
            raise NotCut("no startxref") from None
        head, _, rest = pdf[at:].partition(b"trailer")
        section = re.match(rb"xref\s+0 (\d+)\s+", head)
        entries = _ENTRY.findall(head, section.end()) if section else []
        if not section or len(entries) != int(section.group(1)):
            raise NotCut("not one cross-reference table from object 0")
        placed = sorted((int(off), n) for n, (off, kind) in enumerate(entries) if kind == b"n")
        self.spans = {n: (off, end) for (off, n), (end, _) in zip(placed, [*placed[1:], (at, 0)])}
        trailer = rest.split(b"startxref", 1)[0]
        if b"/Prev" in trailer or b"/Encrypt" in trailer:
            raise NotCut("an updated or encrypted compile")
        self.size = len(entries)
        self.root, self.info = _ref(trailer, b"Root"), _ref(trailer, b"Info")
        catalog = self.dict(self.root)
        if b"/StructTreeRoot" in catalog:
            raise NotCut("a tagged compile")
        self.pages_at, self.metadata = _ref(catalog, b"Pages"), _ref(catalog, b"Metadata")
        if set(self.refs(self.root)) != {self.pages_at, self.metadata}:
            raise NotCut("the catalog references more than its pages and metadata")
        self.pages = page_list(self.body(self.pages_at), self.dict)
        if not self.pages:
            raise NotCut("not one /Pages of /Page objects, nothing inherited")
        found = {"/" + k.decode(): _unescape(v) for k, v in _LITERAL.findall(self.dict(self.info))}
        try:
            self.made = {name: found[name] for name in MADE}
        except KeyError as e:
            raise NotCut(f"no {e} in the compile's Info") from None

    def object(self, n: int) -> bytes:
        """Object n as written, read once a compile: the fonts and resources go in every note."""
        if n not in self._objects:
            if n not in self.spans:
                raise NotCut(f"object {n} is not in the table")
            start, end = self.spans[n]
            obj = self.pdf[start:end]
            if not obj.startswith(b"%d 0 obj" % n) or not obj.rstrip().endswith(b"endobj"):
                raise NotCut(f"object {n} is not where the table says, or more than it lies there")
            self._objects[n] = obj
        return self._objects[n]

    def body(self, n: int) -> bytes:
        """Object n's value, without its number and keywords (as an object stream holds it)."""
        if n not in self._bodies:
            obj = self.object(n)
            self._bodies[n] = obj[len(b"%d 0 obj" % n):obj.rindex(b"endobj")].strip()
        return self._bodies[n]

    def dict(self, n: int) -> bytes:
        """Object n up to its stream or its end: what can reference other objects."""
        body = self.object(n)
        kept = re.search(rb">>\s*stream\r?\n", body)
        return body[:kept.start() + 2] if kept else body

    def refs(self, n: int) -> list[int]:
        """The objects n references, read token by token: a string or a stream that happens
        to hold "3 0 R" is not a reference."""
        if n not in self._refs:
            found, depth = [], 0
            for m in _TOKENS.finditer(self.object(n), len(b"%d 0 obj" % n)):
                token = m.group()
                if token in (b"(", b")", b"%"):
                    raise NotCut(f"object {n} has a string or comment this reader does not follow")
                if m.group(1):
                    found.append(int(m.group(1)))
                depth += (token == b"<<") - (token == b">>")
                if m.group(3) and depth == 0:
                    self._streams.add(n)
                    break
                if m.group(4):
                    break
            self._refs[n] = found
        return self._refs[n]

    def cut(self, first: int, count: int, info: dict[str, str], xmp: bytes) -> bytes:
        """Pages [first, first + count) as a file of their own, with its own Info and XMP."""
        own = self.pages[first:first + count]
        keep = frozenset().union(*map(self.reach, own))
        if keep & (set(self.pages).difference(own) | {self.root, self.info, self.metadata}):
            raise NotCut("a page of the note references another page or the document's own objects")
        return self._write(keep, own, info, xmp)

    def reach(self, n: int) -> frozenset[int]:
        """n and every object it leads to, but up the page tree: once a compile for what the
        pages share (their resources, the fonts)."""
        if n not in self._reach:
            self._reach[n] = None
            self._reach[n] = frozenset([n]).union(*(self.reach(r) for r in self.refs(n) if r != self.pages_at))
        if self._reach[n] is None:
            raise NotCut(f"object {n} leads back to itself")
        return self._reach[n]

    def _write(self, keep: frozenset[int], own: list[int], info: dict[str, str], xmp: bytes) -> bytes:
        """The streams as they were; every other object packed into one object stream, left
        uncompressed (pipeline/seal/packing.py), the shape the signer writes again encrypted."""
        out = bytearray(HEADER)
        rows: dict[int, tuple[int, int, int]] = {0: (0, 0, 65535)}  # the cross-reference stream's (type, field, field)

        def put(n: int, body: bytes) -> None:
            rows[n] = (1, len(out), 0)
            out.extend(body if body.endswith(b"\n") else body + b"\n")

        packed = {}
        for n in sorted(keep):
            if n in self._streams:
                put(n, self.object(n))
            else:
                packed[n] = self.body(n)
        put(self.metadata, b"%d 0 obj\n<</Type/Metadata/Subtype/XML/Length %d>>\nstream\n%s\nendstream\nendobj\n"
            % (self.metadata, len(xmp), xmp))
        packed[self.pages_at] = b"<</Type/Pages/Count %d/Kids[%s]>>" % (len(own), b" ".join(b"%d 0 R" % n for n in own))
        packed[self.root] = self.body(self.root)
        packed[self.info] = b"<<%s>>" % b"".join(k.encode() + _string(v) for k, v in info.items())
        objstm, xref = self.size, self.size + 1
        put(objstm, object_stream(objstm, packed, rows))
        ident = os.urandom(16).hex().encode()
        out += xref_stream(xref, len(out), rows, b"/Root %d 0 R/Info %d 0 R/ID[<%s><%s>]" % (self.root, self.info, ident, ident))
        return bytes(out)


def join(compiles: Iterable[Compile], info: dict[str, str], xmp: bytes) -> bytes:
    """The pages of `compiles` (a note's page ranges, in order) as one file, with its own Info
    and XMP, written as cut() writes a note: each compile's pages and what they reference, every
    reference in them renumbered (outside strings and streams' data); one /Pages of them all;
    the first compile's catalog."""
    out = bytearray(HEADER)
    rows: dict[int, tuple[int, int, int]] = {0: (0, 0, 65535)}
    pages, root, info_at, metadata = 1, 2, 3, 4
    size = 5  # the next number free
    packed: dict[int, bytes] = {}
    kids: list[int] = []
    first = None
    for whole in compiles:
        first = first or whole
        keep = sorted(frozenset().union(*map(whole.reach, whole.pages)))
        if {whole.root, whole.info, whole.metadata}.intersection(keep):
            raise NotCut("a page of the note references the document's own objects")
        numbers = {whole.pages_at: pages, **{n: size + i for i, n in enumerate(keep)}}
        size += len(keep)
        for n in keep:
            if n in whole._streams:  # its dictionary renumbered, its data as it is
                head, obj = whole.dict(n), whole.object(n)
                rows[numbers[n]] = (1, len(out), 0)
                out += b"%d 0 obj" % numbers[n] + _renumbered(head[len(b"%d 0 obj" % n):], numbers) + obj[len(head):]
                if not obj.endswith(b"\n"):
                    out += b"\n"
            else:
                packed[numbers[n]] = _renumbered(whole.body(n), numbers)
        kids += [numbers[n] for n in whole.pages]
    if first is None:
        raise NotCut("no compile to join")
    if len(packed) + 4 > MAX_PACKED:  # its pages, catalog and Info, and the signer's widget (encrypt.py)
        raise NotCut(f"{len(packed):,} objects to pack: more than one object stream holds")
    rows[metadata] = (1, len(out), 0)
    out += b"%d 0 obj\n<</Type/Metadata/Subtype/XML/Length %d>>\nstream\n%s\nendstream\nendobj\n" % (
        metadata, len(xmp), xmp)
    packed[pages] = b"<</Type/Pages/Count %d/Kids[%s]>>" % (len(kids), b" ".join(b"%d 0 R" % n for n in kids))
    packed[root] = _renumbered(first.body(first.root), {first.pages_at: pages, first.metadata: metadata})
    packed[info_at] = b"<<%s>>" % b"".join(k.encode() + _string(v) for k, v in info.items())
    rows[size] = (1, len(out), 0)
    out += object_stream(size, packed, rows)
    ident = os.urandom(16).hex().encode()
    out += xref_stream(size + 1, len(out), rows, b"/Root %d 0 R/Info %d 0 R/ID[<%s><%s>]" % (root, info_at, ident, ident))
    return bytes(out)


def _renumbered(text: bytes, numbers: dict[int, int]) -> bytes:
    """`text` (an object's value, up to its stream) with each reference to object n made one to numbers[n]."""
    def one(token: re.Match) -> bytes:
        if not token.group(1):
            return token.group()
        if token.group(2) != b"0" or int(token.group(1)) not in numbers:
            raise NotCut(f"a reference to {token.group(1).decode()} {token.group(2).decode()} outside the note's pages")
        return b"%d 0 R" % numbers[int(token.group(1))]
    return _TOKENS.sub(one, text)


def _ref(text: bytes, key: bytes) -> int:
    found = re.search(rb"/%s\s*(\d+) 0 R" % key, text)
    if not found:
        raise NotCut(f"no /{key.decode()}")
    return int(found.group(1))


def _unescape(literal: bytes) -> str:
    if re.search(rb"\\[^()\\]", literal):
        raise NotCut("an Info string with an escape other than of ( ) and \\")
    return re.sub(rb"\\(.)", rb"\1", literal).decode("latin-1")


def _string(value: str) -> bytes:
    """A PDF text string: printable ASCII as a literal, anything else UTF-16BE with its mark."""
    if value.isascii() and value.isprintable():
        return b"(" + re.sub(rb"([()\\])", rb"\\\1", value.encode()) + b")"
    return b"<FEFF" + value.encode("utf-16-be").hex().upper().encode() + b">"
