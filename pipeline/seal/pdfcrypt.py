"""PDF standard security handler, revision 6 (AES-256): its keys computed over OpenSSL, the
objects encrypted by encrypt.py or qpdf.

Why not qpdf's own R6: the qpdf bundled with pikepdf has only its "native" crypto provider
(no AES-NI), and R6's deliberately slow password hash (ISO 32000-2, algorithm 2.B, run four
times per document) costs ~11 ms there against ~1 ms here (hash_2b.c, a batch's notes at
once). So we make the keys. encrypt.py writes a note of the render's cut under them itself:
its streams and its one object stream each encrypted whole, the signature's strings one by one.
Any other note has them `declare`d in an update appended to it, with identity crypt filters:
qpdf, opening it with the file key, reads the objects as they are and, saving it with its
encryption kept, encrypts every string and stream under our keys (~0.15 ms of its AES a note;
walking the objects in Python to encrypt them one by one cost ~0.6 ms). Either leaves a
signature's /Contents unencrypted (ISO 32000-2, 7.6.2).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pipeline.seal import compiled

HASHES = (hashlib.sha256, hashlib.sha384, hashlib.sha512)
# print (bit 3) and high-quality print (bit 12), accessibility extraction (bit 10);
# bits 7-8 and 13-32 are reserved and must be 1. As a signed 32-bit integer.
PRINT_ONLY_P = struct.unpack("<i", struct.pack("<I", 0xFFFFF000 | 0xC0 | 0x4 | 0x800 | 0x200))[0]


@dataclass(frozen=True)
class R6Keys:
    file_key: bytes
    o: bytes
    u: bytes
    oe: bytes
    ue: bytes
    perms: bytes
    p: int


def password_bytes(password: str) -> bytes:
    """SASLprep, UTF-8, the first 127 bytes. Printable ASCII (a PAN) is its own SASLprep: no
    mapping, normalisation or prohibition touches it, and pyhanko's saslprep cost ~20 us."""
    if password.isascii() and password.isprintable():
        return password.encode()[:127]
    # imported here: its module brings pyhanko's whole crypt package, ~75 ms of each worker's start
    from pyhanko.pdf_utils.crypt._saslprep import saslprep

    return saslprep(password).encode("utf-8")[:127] if password else b""


# The broker's one owner password, prepared once (SASLprep of it cost 0.17 ms a note); the
# clients' PANs are not kept.
_owner_bytes = functools.lru_cache(maxsize=2)(password_bytes)


def hash_2b(password: bytes, salt: bytes, udata: bytes = b"") -> bytes:
    """ISO 32000-2 algorithm 2.B, in C over OpenSSL (compiled.py) where it could be built."""
    return hash_2b_all([(password, salt, udata)])[0]


def hash_2b_all(jobs: Sequence[tuple[bytes, bytes, bytes]]) -> list[bytes]:
    """Algorithm 2.B for each (password, 8-byte salt, udata) in order: the C runs a batch's hashes
    eight at a time (hash_2b.c), so a shard's notes are hashed in one call."""
    for password, salt, udata in jobs:
        if len(password) > 127 or len(salt) != 8 or len(udata) not in (0, 48):
            raise ValueError(f"hash_2b: password {len(password)} bytes (at most 127), salt {len(salt)} (8), "
                             f"udata {len(udata)} (0 or 48)")
    fn = compiled.hash_2b()
    if fn is None:
        return [hash_2b_reference(*job) for job in jobs]
    out: list[bytes] = [b""] * len(jobs)
    for size in (0, 48):  # one call a udata length, as the C takes them
        which = [i for i, job in enumerate(jobs) if len(job[2]) == size]
        if not which:
            continue
        ends = list(itertools.accumulate(len(jobs[i][0]) for i in which))
        digests = ctypes.create_string_buffer(32 * len(which))
        if fn(len(which), b"".join(jobs[i][0] for i in which), (ctypes.c_size_t * len(which))(*ends),
              b"".join(jobs[i][1] for i in which), b"".join(jobs[i][2] for i in which), size, digests) != 0:
            raise ValueError("hash_2b: OpenSSL failed")
        raw = digests.raw
        for at, i in enumerate(which):
            out[i] = raw[32 * at:32 * at + 32]
    return out


def hash_2b_reference(password: bytes, salt: bytes, udata: bytes = b"") -> bytes:
    """ISO 32000-2 algorithm 2.B: at least 64 rounds of AES-128-CBC and SHA-2. The C version's
    reference (tests hold them together) and its stand-in where it cannot be built."""
    k = hashlib.sha256(password + salt + udata).digest()
    rounds = last = 0
    while rounds < 64 or last > rounds - 32:
        encryptor = Cipher(algorithms.AES(k[:16]), modes.CBC(k[16:32])).encryptor()
        e = encryptor.update((password + k + udata) * 64) + encryptor.finalize()
        k = HASHES[sum(e[:16]) % 3](e).digest()
        last = e[-1]
        rounds += 1
    return k[:32]


@dataclass(frozen=True)
class UserKeys:
    """A fresh file key with its U and UE: half of R6's four password hashes, made from the
    user password alone. The render stage makes them (it holds the PAN, and the plain note the
    file key protects), so the signer, one process per key, hashes only the owner's half."""
    file_key: bytes
    u: bytes
    ue: bytes

    def __repr__(self) -> str:  # never the file key in a log or a traceback
        return "UserKeys(...)"


def user_keys_all(user_passwords: Sequence[str]) -> list[UserKeys]:
    """Algorithm 8 of ISO 32000-2 for each password: U and UE for a fresh file key, the
    passwords' hashes in one batch."""
    users = [password_bytes(password) for password in user_passwords]
    file_keys, salts = [os.urandom(32) for _ in users], [os.urandom(16) for _ in users]
    hashes = iter(hash_2b_all([(user, salt[i:i + 8], b"") for user, salt in zip(users, salts) for i in (0, 8)]))
    return [UserKeys(file_key, next(hashes) + salt, _aes256_no_iv(next(hashes), file_key))
            for file_key, salt in zip(file_keys, salts)]


def r6_keys(user_password: str, owner_password: str, p: int = PRINT_ONLY_P, made: UserKeys | None = None) -> R6Keys:
    """Algorithms 8, 9 and 10 of ISO 32000-2: U/UE (`made` for this user password, or new), O/OE
    and Perms."""
    return r6_keys_all([(user_password, made)], owner_password, p)[0]


def r6_keys_all(users: Sequence[tuple[str, UserKeys | None]], owner_password: str, p: int = PRINT_ONLY_P) -> list[R6Keys]:
    """r6_keys for each (user password, its `made` or None), their hashes in one batch or two."""
    new = iter(user_keys_all([user for user, made in users if made is None]))
    mades = [made or next(new) for _, made in users]
    owner, salts = _owner_bytes(owner_password), [os.urandom(16) for _ in mades]
    hashes = iter(hash_2b_all([(owner, salt[i:i + 8], made.u) for made, salt in zip(mades, salts) for i in (0, 8)]))
    return [_r6(made, next(hashes) + salt, next(hashes), p) for made, salt in zip(mades, salts)]


def _r6(made: UserKeys, o: bytes, oe_hash: bytes, p: int) -> R6Keys:
    perms_plain = struct.pack("<i", p) + b"\xff\xff\xff\xffTadb" + os.urandom(4)
    encryptor = Cipher(algorithms.AES(made.file_key), modes.ECB()).encryptor()
    perms = encryptor.update(perms_plain) + encryptor.finalize()
    return R6Keys(made.file_key, o, made.u, _aes256_no_iv(oe_hash, made.file_key), made.ue, perms, p)


def declare(pdf: bytes, keys: R6Keys) -> bytes:
    """`pdf` with an update appended whose trailer (the last one's /Root, /Info and /ID, and
    /Prev to it) declares R6 encryption under `keys` with identity crypt filters. Open it in
    pikepdf with password=keys.file_key.hex(), hex_password=True, and save with
    encryption=True: qpdf then writes AES-256 (it takes AES for V 5 whatever the filters say)
    with these O, U, OE, UE and Perms. ValueError when the last trailer cannot be read or
    already declares encryption."""
    try:
        prev = int(pdf[pdf.rindex(b"startxref") + 9:].split(maxsplit=1)[0])
    except (ValueError, IndexError):
        raise ValueError("no startxref") from None
    trailer = pdf[prev:pdf.rindex(b"startxref")].split(b"stream", 1)[0]  # a table's trailer, or an xref stream's dict
    size, root = re.search(rb"/Size\s+(\d+)", trailer), re.search(rb"/Root\s+(\d+\s+\d+\s+R)", trailer)
    if not (0 <= prev < len(pdf) and size and root) or b"/Encrypt" in trailer:
        raise ValueError("the last trailer has no /Size or /Root, or declares encryption already")
    info = re.search(rb"/Info\s+(\d+\s+\d+\s+R)", trailer)
    ids = re.search(rb"/ID\s*\[\s*<([0-9A-Fa-f]*)>\s*<([0-9A-Fa-f]*)>\s*\]", trailer)
    first, second = (ids.group(1), ids.group(2)) if ids else (os.urandom(16).hex().encode(),) * 2
    number, at = int(size.group(1)), len(pdf) + 1
    obj = (b"%d 0 obj\n<< /Filter /Standard /V 5 /R 6 /Length 256 /P %d /EncryptMetadata true /StmF /Identity "
           b"/StrF /Identity /O <%s> /U <%s> /OE <%s> /UE <%s> /Perms <%s> >>\nendobj\n"
           % (number, keys.p, *(v.hex().encode() for v in (keys.o, keys.u, keys.oe, keys.ue, keys.perms))))
    tail = b"xref\n%d 1\n%010d 00000 n \ntrailer\n<< /Size %d /Root %s" % (number, at, number + 1, root.group(1))
    if info:
        tail += b" /Info " + info.group(1)
    tail += b" /ID [<%s><%s>] /Encrypt %d 0 R /Prev %d >>\nstartxref\n%d\n%%%%EOF\n" % (
        first, second, number, prev, at + len(obj))
    return pdf + b"\n" + obj + tail


def _aes256_no_iv(key: bytes, data: bytes) -> bytes:
    encryptor = Cipher(algorithms.AES(key), modes.CBC(b"\x00" * 16)).encryptor()
    return encryptor.update(data) + encryptor.finalize()
