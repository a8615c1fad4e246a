"""PDF standard security handler, revision 6 (AES-256), computed over OpenSSL.

Why not qpdf's own encryption: the qpdf bundled with pikepdf has only its "native" crypto
provider (no AES-NI), and R6's deliberately slow password hash (ISO 32000-2, algorithm
2.B, run four times per document) costs ~11 ms there against ~5.5 ms here. So qpdf
serialises the document unencrypted, we encrypt its strings and streams in place
(pikepdf objects), and the trailer, which follows the cross-reference table, is given its
/Encrypt entry after the write, so no object offset moves. A signature's /Contents is never
encrypted (ISO 32000-2, 7.6.2).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import struct
from dataclasses import dataclass

import pikepdf
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from pyhanko.pdf_utils.crypt._saslprep import saslprep

from pipeline.seal import compiled

HASHES = (hashlib.sha256, hashlib.sha384, hashlib.sha512)
# print (bit 3) and high-quality print (bit 12), accessibility extraction (bit 10);
# bits 7-8 and 13-32 are reserved and must be 1. As a signed 32-bit integer.
HELD_KEY = "/XEncrypt"
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
    return saslprep(password).encode("utf-8")[:127] if password else b""


# The broker's one owner password, prepared once (SASLprep of it cost 0.17 ms a note); the
# clients' PANs are not kept.
_owner_bytes = functools.lru_cache(maxsize=2)(password_bytes)


def hash_2b(password: bytes, salt: bytes, udata: bytes = b"") -> bytes:
    """ISO 32000-2 algorithm 2.B, in C over OpenSSL (compiled.py) where it could be built."""
    if len(salt) != 8:
        raise ValueError(f"hash_2b: salt {len(salt)} bytes (8)")
    return hash_2b_pair(password, salt, udata)[0]


def hash_2b_pair(password: bytes, salts: bytes, udata: bytes = b"") -> list[bytes]:
    """Algorithm 2.B for each 8-byte salt in `salts` (one or two) with the same password and
    udata, as R6 needs them (U and UE; O and OE): the C runs two at once, their AES interleaved,
    in ~0.82 of the CPU of two apart (the SHA-2s, two thirds of it, cannot be shared)."""
    fn = compiled.hash_2b()
    if fn is None:
        return [hash_2b_reference(password, salts[i:i + 8], udata) for i in range(0, len(salts), 8)]
    lanes = len(salts) // 8
    out = ctypes.create_string_buffer(32 * lanes)
    if len(salts) not in (8, 16) or fn(password, len(password), salts, lanes, udata, len(udata), out) != 0:
        raise ValueError(f"hash_2b: password {len(password)} bytes (at most 127), salt {len(salts)} (8, or 16 for "
                         f"two), udata {len(udata)} (0 or 48), or OpenSSL failed")
    return [out.raw[i:i + 32] for i in range(0, 32 * lanes, 32)]


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


def user_keys(user_password: str) -> UserKeys:
    """Algorithm 8 of ISO 32000-2: U and UE for a fresh file key."""
    user, file_key, u_salts = password_bytes(user_password), os.urandom(32), os.urandom(16)
    u_hash, ue_hash = hash_2b_pair(user, u_salts)
    return UserKeys(file_key, u_hash + u_salts, _aes256_no_iv(ue_hash, file_key))


def r6_keys(user_password: str, owner_password: str, p: int = PRINT_ONLY_P, made: UserKeys | None = None) -> R6Keys:
    """Algorithms 8, 9 and 10 of ISO 32000-2: U/UE (`made` for this user password, or new), O/OE
    and Perms."""
    made, owner = made or user_keys(user_password), _owner_bytes(owner_password)
    file_key, u = made.file_key, made.u
    o_salts = os.urandom(16)
    o_hash, oe_hash = hash_2b_pair(owner, o_salts, u)
    o, oe = o_hash + o_salts, _aes256_no_iv(oe_hash, file_key)
    perms_plain = struct.pack("<i", p) + b"\xff\xff\xff\xffTadb" + os.urandom(4)
    encryptor = Cipher(algorithms.AES(file_key), modes.ECB()).encryptor()
    perms = encryptor.update(perms_plain) + encryptor.finalize()
    return R6Keys(file_key, o, u, oe, made.ue, perms, p)


def encrypt_objects(pdf: pikepdf.Pdf, file_key: bytes, skip: pikepdf.Object | None = None) -> None:
    """Encrypts every string and stream of every indirect object, in place (AESV3).

    `skip` is the signature dictionary: its /Contents stays as it is. Streams keep their
    filters; save the file with stream_decode_level=none and compress_streams=False so
    qpdf writes the encrypted bytes untouched.
    """
    for obj in pdf.objects:
        if isinstance(obj, pikepdf.Stream):
            obj.write(_aes(file_key, obj.read_raw_bytes()), filter=obj.get("/Filter"),
                      decode_parms=obj.get("/DecodeParms"), type_check=False)
            if _holds_strings(obj.stream_dict):
                _encrypt_strings(obj.stream_dict, file_key, None)
        elif isinstance(obj, (pikepdf.Dictionary, pikepdf.Array)):
            if _holds_strings(obj):
                _encrypt_strings(obj, file_key, skip)
        elif isinstance(obj, pikepdf.String):
            raise ValueError(f"indirect string object {obj.objgen} is not supported")


def _holds_strings(obj) -> bool:
    """Whether a direct string is anywhere in `obj`, from its serialisation in one call: a
    string is written "(...)" or "<hex>" and nothing else writes "(" or a lone "<" (names
    escape them). Walking every value instead (a font's /W array has hundreds) cost ~2 ms a
    note, most of the encryption's time but the password hashes."""
    text = obj.unparse(resolved=True)  # its content, not "N 0 R"
    return b"(" in text or b"<" in text.replace(b"<<", b"")


def attach_encryption(pdf: pikepdf.Pdf, keys: R6Keys) -> None:
    """Adds the encryption dictionary as an indirect object, under a trailer key qpdf keeps
    when it writes an unencrypted file (it drops /Encrypt); `mark_encrypted` renames it."""
    pdf.trailer[HELD_KEY] = pdf.make_indirect(pikepdf.Dictionary(
        Filter=pikepdf.Name.Standard, V=5, R=6, Length=256, P=keys.p, EncryptMetadata=True,
        CF=pikepdf.Dictionary(StdCF=pikepdf.Dictionary(
            AuthEvent=pikepdf.Name.DocOpen, CFM=pikepdf.Name.AESV3, Length=32)),
        StmF=pikepdf.Name.StdCF, StrF=pikepdf.Name.StdCF,
        O=pikepdf.String(keys.o), U=pikepdf.String(keys.u), OE=pikepdf.String(keys.oe),
        UE=pikepdf.String(keys.ue), Perms=pikepdf.String(keys.perms)))


def mark_encrypted(data: bytes) -> bytes:
    """Renames the held key to /Encrypt in the last trailer: same length, after the xref."""
    start = data.rindex(b"trailer")
    at = data.index(HELD_KEY.encode(), start)
    return data[:at] + b" /Encrypt" + data[at + len(HELD_KEY):]


def _encrypt_strings(container, key: bytes, skip) -> None:
    items = container.items() if isinstance(container, pikepdf.Dictionary) else enumerate(container)
    is_sig = skip is not None and container.is_indirect and container.objgen == skip.objgen
    for k, v in list(items):
        if isinstance(v, pikepdf.String) and not (is_sig and k == "/Contents"):
            container[k] = pikepdf.String(_aes(key, bytes(v)))
        elif isinstance(v, (pikepdf.Dictionary, pikepdf.Array)) and not v.is_indirect and _holds_strings(v):
            _encrypt_strings(v, key, None)  # not into a font's /W: hundreds of numbers, 1.3 ms a note


def _aes(key: bytes, data: bytes) -> bytes:
    iv = os.urandom(16)
    pad = 16 - len(data) % 16
    encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return iv + encryptor.update(data + bytes([pad]) * pad) + encryptor.finalize()


def _aes256_no_iv(key: bytes, data: bytes) -> bytes:
    encryptor = Cipher(algorithms.AES(key), modes.CBC(b"\x00" * 16)).encryptor()
    return encryptor.update(data) + encryptor.finalize()
