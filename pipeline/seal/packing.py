"""The file shape of a cut note: the render's cut (pipeline/note/cut.py) writes it plain, the
signer (encrypt.py) writes it again encrypted. Streams stand as objects of their own; every
other object is packed into one uncompressed object stream (the signer's qpdf read a note so
faster than as plain objects); a cross-reference stream of 7-byte rows ends the file. One
writer for both, so that what encrypt.py reads is what cut.py wrote."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

HEADER = b"%PDF-1.7\n%\x80\x80\x80\x80\n"
ROW = struct.Struct(">BIH")  # a cross-reference stream's row under /W[1 4 2]: type, offset or object stream, index
MAX_PACKED = 1 << 16  # objects an object stream holds at most: an index is a row's 2 bytes
_TREE = re.compile(rb"<<\s*(?:/Type\s*/Pages|/Count\s*(\d+)|/Kids\s*\[([\d\sR]*)\]|\s)*>>")


def page_list(tree: bytes, value: Callable[[int], bytes]) -> list[int]:
    """The pages of the /Pages dictionary `tree`, each a /Page by `value(n)` (object n's
    dictionary); [] unless it is of the cut's shape: one level of kids, each an indirect
    reference of generation 0 (an R that is not one is no page of it), nothing they inherit."""
    found = _TREE.fullmatch(tree)
    array = (found.group(2) or b"") if found else b""
    kids = re.findall(rb"(\d+)\s+(\d+)\s+R", array)
    if not kids or len(kids) != int(found.group(1) or -1) or len(kids) != array.count(b"R") or \
            any(gen != b"0" for _, gen in kids) or not all(re.search(rb"/Type\s*/Page\b", value(int(n))) for n, _ in kids):
        return []
    return [int(n) for n, _ in kids]


def object_stream(number: int, packed: dict[int, bytes], rows: dict[int, tuple[int, int, int]],
                  encrypted: Callable[[bytes], bytes] = bytes) -> bytes:
    """Object `number`: an object stream of `packed` (number: value), in order; each one's row
    put in `rows`."""
    heads, body = [], bytearray()
    for i, (n, value) in enumerate(packed.items()):
        heads.append(b"%d %d" % (n, len(body)))
        body += value + b"\n"
        rows[n] = (2, number, i)
    first = b" ".join(heads) + b"\n"
    data = encrypted(first + body)
    return (b"%d 0 obj\n<</Type/ObjStm/N %d/First %d/Length %d>>\nstream\n%s\nendstream\nendobj\n"
            % (number, len(packed), len(first), len(data), data))


def xref_stream(number: int, at: int, rows: dict[int, tuple[int, int, int]], trailer: bytes) -> bytes:
    """Object `number`, written at `at`: the cross-reference stream of `rows` (any number not
    in them free), with the trailer's entries after /W, and the file's end."""
    rows[number] = (1, at, 0)
    table = bytearray(ROW.size * (number + 1))
    for n, row in rows.items():
        ROW.pack_into(table, ROW.size * n, *row)
    return (b"%d 0 obj\n<</Type/XRef/Size %d/W[1 4 2]%s/Length %d>>\nstream\n%s\nendstream\nendobj\n"
            b"startxref\n%d\n%%%%EOF\n" % (number, number + 1, trailer, len(table), table, at))
