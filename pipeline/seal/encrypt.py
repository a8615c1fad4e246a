"""A note in the plain shape the render stage cuts, written again encrypted and with its
signature's place, without qpdf.

The signer's qpdf opened each note, added the signature field through pikepdf and wrote the
whole file again, encrypting it: ~0.65 ms of the signer's ~2 ms a note. A cut note
(pipeline/note/cut.py) is the streams Typst wrote, one uncompressed object stream of
everything else and a cross-reference stream. So each stream is encrypted as it lies
(AES-256-CBC under the file key, a fresh IV each: ISO 32000-2, 7.6.3), the object stream
written again with the field's widget in it, on the last page and in the catalog's form,
then encrypted whole (what it holds is not encrypted again, 7.6.2); the signature dictionary
(its /Contents left plain) and the encryption dictionary beside it, as top-level objects.
Anything not of that shape raises NotSealed, and qpdf writes the note as before: one cut by
pikepdf, a merged note whose ranges pikepdf joined, AES-128 or no encryption.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pipeline.seal.packing import HEADER, MAX_PACKED, ROW, object_stream, page_list, xref_stream
from pipeline.seal.pdfcrypt import R6Keys

_XREF = re.compile(rb"(\d+) 0 obj\n<</Type/XRef/Size (\d+)/W\[1 4 2\]/Root (\d+) 0 R/Info (\d+) 0 R"
                   rb"/ID\[(<[0-9a-fA-F]+><[0-9a-fA-F]+>)\]/Length (\d+)>>\nstream\n")
_OBJSTM = re.compile(rb"(\d+) 0 obj\n<</Type/ObjStm/N (\d+)/First (\d+)/Length (\d+)>>\nstream\n")
_STREAM = re.compile(rb"(\d+) 0 obj\n(<<.*?>>)\nstream\n", re.S)
_LENGTH = re.compile(rb"/Length\s+(\d+)(?!\s+\d+\s+R)(?=[/>\s])")
# what a stream's dictionary must not hold: a literal or hex string (not encrypted here), a crypt
# filter of its own, or another object's bounds (the lazy match ran past its own)
_STRANGE = re.compile(rb"\(|<[0-9A-Fa-f\s]*>|/Crypt\b|\bendobj\b|\d+\s+\d+\s+obj\b")
_TAIL = re.compile(rb"\r?\n?endstream\nendobj\n+")


class NotSealed(ValueError):
    """The note is not of the shape written here: qpdf writes it."""


def sealed(pdf: bytes, keys: R6Keys, field: dict[str, str], contents: int, name: str) -> bytes:
    """The note encrypted under `keys`, its last page holding a signature field named `name`
    whose dictionary has `field`'s strings and /Contents of `contents` zero bytes."""
    tops, packed, objstm, (size, root, info, ids) = _read(pdf)
    widget, sig, encrypt, xref = size, size + 1, size + 2, size + 3
    _in(packed, info)
    tree = _in(packed, int(_one(rb"/Pages\s+(\d+)\s+0\s+R", _in(packed, root), "the catalog's /Pages")))
    kids = page_list(tree, lambda n: _in(packed, n))
    if not kids:
        raise NotSealed("not one /Pages of /Page objects, nothing inherited")
    last = kids[-1]
    packed[last] = _added(packed[last], b"/Annots", b"/Annots[%d 0 R]" % widget)
    packed[root] = _added(_added(packed[root], b"/AcroForm", b"/AcroForm<</Fields[%d 0 R]/SigFlags 3>>" % widget),
                          b"/Extensions", b"/Extensions<</ADBE<</BaseVersion/1.7/ExtensionLevel 8>>>>")
    packed[widget] = (b"<</Type/Annot/Subtype/Widget/FT/Sig/T<%s>/V %d 0 R/Rect[0 0 0 0]/F 132/P %d 0 R>>"
                      % (_text(name).hex().encode(), sig, last))
    if len(packed) > MAX_PACKED:
        raise NotSealed(f"{len(packed):,} objects to pack: more than one object stream holds")

    aes = _chain(keys.file_key)
    out = bytearray(HEADER)
    rows: dict[int, tuple[int, int, int]] = {0: (0, 0, 65535)}

    def put(n: int, obj: bytes) -> None:
        rows[n] = (1, len(out), 0)
        out.extend(obj)

    for n, (head, data) in tops.items():
        data = aes(data)
        put(n, b"%d 0 obj\n%s\nstream\n%s\nendstream\nendobj\n" % (n, _LENGTH.sub(b"/Length %d" % len(data), head), data))
    put(objstm, object_stream(objstm, packed, rows, aes))
    strings = b"".join(b"/%s<%s>" % (k.encode(), aes(_text(v)).hex().encode()) for k, v in field.items())
    put(sig, b"%d 0 obj\n<</Type/Sig/Filter/Adobe.PPKLite/SubFilter/ETSI.CAdES.detached"
        b"/ByteRange[0 1111111111 2222222222 3333333333]/Contents <%s>%s>>\nendobj\n"
        % (sig, b"00" * contents, strings))
    put(encrypt, b"%d 0 obj\n<</Filter/Standard/V 5/R 6/Length 256/P %d/EncryptMetadata true"
        b"/CF<</StdCF<</AuthEvent/DocOpen/CFM/AESV3/Length 32>>>>/StmF/StdCF/StrF/StdCF"
        b"/O<%s>/U<%s>/OE<%s>/UE<%s>/Perms<%s>>>\nendobj\n"
        % (encrypt, keys.p, *(v.hex().encode() for v in (keys.o, keys.u, keys.oe, keys.ue, keys.perms))))
    out += xref_stream(xref, len(out), rows, b"/Root %d 0 R/Info %d 0 R/Encrypt %d 0 R/ID[%s]" % (root, info, encrypt, ids))
    return bytes(out)


def _read(pdf: bytes) -> tuple[dict[int, tuple[bytes, bytes]], dict[int, bytes], int, tuple[int, int, int, bytes]]:
    """The top-level streams (number: dictionary, data), the packed objects (number: value),
    the object stream's number, and the trailer's /Size, /Root, /Info and /ID."""
    if not pdf.startswith(HEADER):
        raise NotSealed("not the cut's header")
    try:
        at = int(pdf[pdf.rindex(b"startxref") + 9:].split(maxsplit=1)[0])
    except (ValueError, IndexError):
        raise NotSealed("no startxref") from None
    trailer = _XREF.match(pdf, at)
    if not trailer:
        raise NotSealed("not a cross-reference stream of the cut's")
    number, size, root, info = map(int, trailer.group(1, 2, 3, 4))
    table = pdf[trailer.end():trailer.end() + int(trailer.group(6))]
    if len(table) != ROW.size * size:
        raise NotSealed("a cross-reference stream of another size")
    rows = list(ROW.iter_unpack(table))
    placed = sorted((field, n) for n, (kind, field, _) in enumerate(rows) if kind == 1)
    spans = {n: (start, end) for (start, n), (end, _) in zip(placed, [*placed[1:], (len(pdf), 0)])}
    if spans.get(number, (0, 0))[0] != at:
        raise NotSealed("the cross-reference stream is not where it says")
    tops, packed, objstm = {}, {}, None
    for n, (start, end) in spans.items():
        if n == number:
            continue
        if (stream := _OBJSTM.match(pdf, start)) and int(stream.group(1)) == n and objstm is None:
            objstm, count, first, length = n, *map(int, stream.group(2, 3, 4))
            data = pdf[stream.end():stream.end() + length]
            if not _TAIL.fullmatch(pdf, stream.end() + length, end):
                raise NotSealed(f"object {n} does not end where its /Length says")
            packed = _unpacked(data, count, first)
            if any(rows[m] != (2, n, i) for i, m in enumerate(packed) if m < size):
                raise NotSealed("the object stream's objects are not where the table says")
            continue
        stream = _STREAM.match(pdf, start)
        lengths = _LENGTH.findall(stream.group(2)) if stream else []
        if not stream or int(stream.group(1)) != n or len(lengths) != 1 or _STRANGE.search(stream.group(2)):
            raise NotSealed(f"object {n} is not a stream of the cut's, without strings or a crypt filter")
        data_at = stream.end()
        if not _TAIL.fullmatch(pdf, data_at + int(lengths[0]), end):
            raise NotSealed(f"object {n} does not end where its /Length says")
        tops[n] = (stream.group(2), pdf[data_at:data_at + int(lengths[0])])
    if objstm is None or set(packed) != {n for n, (kind, _, _) in enumerate(rows) if kind == 2}:
        raise NotSealed("not one object stream holding every object that is not a stream")
    return tops, packed, objstm, (size, root, info, trailer.group(5))


def _unpacked(data: bytes, count: int, first: int) -> dict[int, bytes]:
    pairs = data[:first].split()
    if len(pairs) != 2 * count or not all(p.isdigit() for p in pairs):
        raise NotSealed("an object stream's head of another shape")
    numbers, offsets = [int(p) for p in pairs[::2]], [first + int(p) for p in pairs[1::2]]
    if len(set(numbers)) != count or offsets[:1] != [first] or \
            any(a >= b for a, b in zip(offsets, [*offsets[1:], len(data) + 1])):
        raise NotSealed("an object stream's head of another shape")
    return {n: data[start:end].strip() for n, start, end in zip(numbers, offsets, [*offsets[1:], len(data)])}


def _in(packed: dict[int, bytes], n: int) -> bytes:
    if n not in packed:
        raise NotSealed(f"object {n} is not in the object stream")
    return packed[n]


def _one(pattern: bytes, text: bytes, what: str) -> bytes:
    found = re.findall(pattern, text)
    if len(found) != 1:
        raise NotSealed(f"not one {what}")
    return found[0]


def _added(value: bytes, key: bytes, entry: bytes) -> bytes:
    """The dictionary `value` with `entry` first; NotSealed if it has `key` already."""
    if not (value.startswith(b"<<") and value.endswith(b">>")) or re.search(re.escape(key) + rb"(?![\w.-])", value):
        raise NotSealed(f"a dictionary that has {key.decode()} already, or is not one")
    return value[:2] + entry + value[2:]


def _chain(key: bytes) -> Callable[[bytes], bytes]:
    """AES-256-CBC of a string or stream, its IV before it and PKCS#5 padding after (ISO
    32000-2, 7.6.3), a note's all on one chain: each begins with a random block, whose
    encryption under the chain so far is as random and stands as its IV, so one OpenSSL
    context serves the note (a context each: 0.22 ms a note's writing, not 0.15)."""
    chain = Cipher(algorithms.AES(key), modes.CBC(bytes(16))).encryptor()

    def encrypted(data: bytes) -> bytes:
        pad = 16 - len(data) % 16
        return chain.update(os.urandom(16) + data + bytes([pad]) * pad)
    return encrypted


def _text(value: str) -> bytes:
    """A PDF text string's bytes: ASCII as it is, anything else UTF-16BE with its mark."""
    return value.encode() if value.isascii() else b"\xfe\xff" + value.encode("utf-16-be")
