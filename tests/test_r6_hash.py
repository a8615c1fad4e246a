"""The R6 password hash (ISO 32000-2 algorithm 2.B) in C: the vectors pdf.js tests its PDF 2.0
handler with, the Python reference on arbitrary passwords, and the build's own failure said.
That qpdf and pdfsig open what it encrypts is tests/test_sign.py's first test."""

from __future__ import annotations

import ctypes
import itertools
import os

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from pipeline import native
from pipeline.seal import compiled, pdfcrypt

# pdf.js, test/unit/crypto_spec.js, "PDF20Algorithm": a revision 6 file made by Acrobat
U = bytes([94, 230, 205, 75, 166, 99, 250, 76, 219, 128, 17, 85, 57, 17, 33, 164, 150, 46, 103, 176, 160, 156, 187,
           233, 166, 223, 163, 253, 147, 235, 95, 184, 83, 245, 146, 101, 198, 247, 34, 198, 191, 11, 16, 94, 237,
           216, 20, 175])
O_HASH = bytes([88, 232, 62, 54, 245, 26, 245, 209, 137, 123, 221, 72, 199, 49, 37, 217, 31, 74, 115, 167, 127, 158,
                176, 77, 45, 163, 87, 47, 39, 90, 217, 141])
O_VALIDATION_SALT = bytes([142, 232, 169, 208, 202, 214, 5, 185])
O_KEY_SALT = bytes([29, 208, 185, 46, 11, 76, 135, 149])
OE = bytes([209, 73, 224, 77, 103, 155, 201, 181, 190, 68, 223, 20, 62, 90, 56, 210, 5, 240, 178, 128, 238, 124, 68,
            254, 253, 244, 62, 108, 208, 135, 10, 251])
UE = bytes([121, 208, 2, 181, 230, 89, 156, 60, 253, 143, 212, 28, 84, 180, 196, 177, 173, 128, 221, 107, 46, 20, 94,
            186, 135, 51, 95, 24, 20, 223, 254, 36])
FILE_KEY = bytes([42, 218, 213, 39, 73, 91, 72, 79, 67, 38, 248, 133, 18, 189, 61, 34, 107, 79, 29, 56, 59, 181, 213,
                  118, 113, 34, 65, 210, 87, 174, 22, 239])


def _file_key(hash_2b, password: bytes, salt: bytes, encrypted: bytes, udata: bytes = b"") -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    decryptor = Cipher(algorithms.AES(hash_2b(password, salt, udata)), modes.CBC(bytes(16))).decryptor()
    return decryptor.update(encrypted) + decryptor.finalize()


def test_the_compiled_hash_is_the_one_in_use():
    assert compiled.hash_2b() is not None, "scripts/install.sh builds it: gcc and libssl-dev"


def test_the_compiled_hash_gives_the_published_vectors():
    for hash_2b in (pdfcrypt.hash_2b, pdfcrypt.hash_2b_reference):
        assert hash_2b(b"user", U[32:40]) == U[:32]
        assert hash_2b(b"owner", O_VALIDATION_SALT, U) == O_HASH
        assert _file_key(hash_2b, b"user", U[40:48], UE) == FILE_KEY
        assert _file_key(hash_2b, b"owner", O_KEY_SALT, OE, U) == FILE_KEY


@settings(max_examples=60, deadline=None)
@given(password=st.binary(max_size=127), salt=st.binary(min_size=8, max_size=8), owner=st.booleans())
def test_the_compiled_hash_equals_the_reference(password, salt, owner):
    udata = os.urandom(48) if owner else b""
    assert pdfcrypt.hash_2b(password, salt, udata) == pdfcrypt.hash_2b_reference(password, salt, udata)


@settings(max_examples=25, deadline=None)
@given(jobs=st.lists(st.tuples(st.binary(max_size=127), st.binary(min_size=8, max_size=8),
                               st.one_of(st.just(b""), st.binary(min_size=48, max_size=48))), min_size=1, max_size=30))
def test_a_batch_in_lanes_equals_the_reference_each(jobs):
    """Up to 30 hashes in one call, of either udata length: eight lanes end after different rounds,
    take different SHA-2s (the SHA-512s eight at once where the CPU has AVX-512) and take the next
    hash as each ends; none may disturb another."""
    assert pdfcrypt.hash_2b_all(jobs) == [pdfcrypt.hash_2b_reference(*job) for job in jobs]


def test_a_shards_worth_fills_every_lane_and_each_hash_is_its_own():
    """Forty hashes of both kinds in a call, as a shard's notes make them: sixteen in flight, the
    SHA-512 lanes full, lanes retiring and taking the next hash; the same password with other
    salts gives other hashes, each the reference's."""
    for udata in (b"", os.urandom(48)):
        jobs = [(b"ABCPD%04dE" % (i % 7), os.urandom(8), udata) for i in range(40)]
        got = pdfcrypt.hash_2b_all(jobs)
        assert got == [pdfcrypt.hash_2b_reference(*job) for job in jobs]
        assert len(set(got)) == 40


def test_the_sha512_lanes_run_where_the_cpu_has_avx512():
    """Not only the one-at-a-time path: the lanes of the tests above are the ones a note uses."""
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    assert compiled.hash_2b()(0, None, None, None, None, 0, None) == ("avx512f" in flags and "avx512bw" in flags)


@pytest.mark.parametrize("variant,edit", [
    ("no VAES", ('__builtin_cpu_supports("vaes")', "0")),  # AES-NI's eight lanes beside the SHA-512 lanes
    ("no AVX-512", ('__builtin_cpu_supports("avx512f")', "0")),  # c6a's Zen 3: AES-NI, OpenSSL's SHA-512s
    ("not x86", ("defined(__x86_64__)", "0")),  # Graviton: EVP's AES, OpenSSL's SHA-2s
])
def test_the_paths_this_cpu_does_not_take_equal_the_reference(tmp_path, variant, edit):
    """The fleet's nodes may lack what this machine has: the source built as theirs is, its
    other paths are held to the reference over a shard's worth of hashes."""
    source = compiled.SOURCE.read_text()
    assert edit[0] in source, variant
    built = tmp_path / compiled.SOURCE.name  # the same name: the same libraries linked
    built.write_text(source.replace(*edit))
    assert native.build(built, tmp_path / "variant.so") == ""
    fn = ctypes.CDLL(str(tmp_path / "variant.so")).cn_hash_2b
    fn.argtypes = [ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p, ctypes.c_char_p,
                   ctypes.c_size_t, ctypes.c_char_p]
    lanes = variant == "no VAES" and compiled.hash_2b()(0, None, None, None, None, 0, None) == 1
    assert fn(0, None, None, None, None, 0, None) == lanes, "the SHA-512 lanes only where the variant keeps them"
    for udata in (b"", os.urandom(48)):
        jobs = [(os.urandom(i % 20), os.urandom(8), udata) for i in range(40)]
        out = ctypes.create_string_buffer(32 * len(jobs))
        ends = list(itertools.accumulate(len(job[0]) for job in jobs))
        assert fn(len(jobs), b"".join(j[0] for j in jobs), (ctypes.c_size_t * len(jobs))(*ends),
                  b"".join(j[1] for j in jobs), udata * len(jobs), len(udata), out) == 0
        assert [out.raw[32 * i:32 * i + 32] for i in range(len(jobs))] == [pdfcrypt.hash_2b_reference(*j) for j in jobs]


@given(password=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140))
def test_printable_ascii_is_its_own_saslprep(password):
    from pyhanko.pdf_utils.crypt._saslprep import saslprep

    assert pdfcrypt.password_bytes(password) == (saslprep(password).encode()[:127] if password else b"")


def test_out_of_range_input_is_refused_not_truncated():
    for password, salt, udata in ((b"x" * 128, bytes(8), b""), (b"x", bytes(7), b""), (b"x", bytes(8), bytes(49)),
                                  (b"x", bytes(16), b"")):
        try:
            pdfcrypt.hash_2b(password, salt, udata)
        except ValueError as e:
            assert "hash_2b" in str(e)
        else:
            raise AssertionError((len(password), len(salt), len(udata)))


def test_a_machine_that_cannot_build_it_is_told_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    assert "failed" in native.build(compiled.SOURCE, tmp_path / "x.so") and not (tmp_path / "x.so").exists()
    assert list(tmp_path.iterdir()) == [], "no half-built library left behind"
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "no C compiler" in native.build(compiled.SOURCE, tmp_path / "x.so")
