/* ISO 32000-2 algorithm 2.B (the R6 password hash), built by pipeline/native.py. A document
 * runs it four times (U and UE from the user's password, O and OE from the owner's): 64 or
 * more rounds each of AES-128-CBC over up to 15 KB and a SHA-2 of the result, 0.3-0.7 ms a
 * hash, the largest part of a note's CPU after Typst's compile. One call hashes a whole
 * batch's (a shard's notes: hundreds), sixteen under way, a finished one's lane taking the
 * next hash at once:
 *   - CBC is a chain: one block's AES waits for the one before, so a lone chain leaves the
 *     AES unit idle most of the time; eight chains interleaved keep it busy (AES-NI, or
 *     OpenSSL's EVP one lane at a time where the CPU lacks it); with VAES, where more than
 *     eight are ready, sixteen, four in a register (their AES ~0.6 of AES-NI's CPU: a hash in
 *     a batch 0.89-0.91 of its CPU before). Fewer go to AES-NI: two registers' chains would
 *     wait on VAES's longer latency (a lone hash took 1.12x). Every lane runs to the longest
 *     lane's blocks: what a shorter lane computes past its own end is never read.
 *   - SHA-384 and SHA-512 share a compression function, which AVX-512 runs for eight lanes
 *     at once, each 64-bit word in a lane of its own (sha512_lanes); a lane past its last
 *     block keeps its state. A round takes one of the three SHA-2s by its data, so those
 *     waiting for a SHA-384 or SHA-512 wait, oldest first, until eight fill the lanes, when
 *     eight or more hashes are in flight; fewer than WIDE_FROM go to OpenSSL's one at a time.
 *     SHA-256 is OpenSSL's (SHA-NI where the CPU has it). The SHA-512 lanes need AVX-512
 *     (and AVX-512BW: Intel's Xeons since Skylake-SP, AMD's Zen 4: c6i, c7i, c7a; not c6a's
 *     Zen 3): with it a hash in a batch costs ~0.48 of the two-lane code's CPU before, without
 *     it ~0.88. A block's words are gathered from the eight lanes and byte-swapped in registers.
 * pdfcrypt.hash_2b_reference is the same algorithm in Python, and tests/test_r6_hash.py holds
 * the two and a published vector together.
 */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_PASSWORD 127 /* ISO 32000-2 7.6.4.3.3: the password's first 127 bytes */
#define MAX_UDATA 48     /* the U string, when hashing the owner's password */
#define MAX_SEQUENCE (MAX_PASSWORD + 64 + MAX_UDATA)
#define MAX_K1 (64 * MAX_SEQUENCE)
#define LANES 8
#define POOL (2 * LANES) /* hashes under way: their SHA-512s wait until they fill the lanes */
#define WIDE_FROM 3 /* SHA-512s in the lanes from this many: eight lanes cost ~2.7 of OpenSSL's one at a time */

typedef struct {
    size_t job; /* the hash this lane computes, of these: */
    const unsigned char *password, *salt, *udata;
    size_t password_len;
    unsigned char k[64];
    unsigned int k_len;
    int rounds, last, busy;
    int wide; /* its SHA-384 (1) or SHA-512 (2) is waiting for the lanes */
    size_t total; /* bytes of this round's input (64 times the sequence) */
    unsigned char k1[MAX_K1];
    unsigned char e[MAX_K1 + 256]; /* and SHA-512's padding after the input */
} lane;

static int running(const lane *l)
{
    return l->rounds < 64 || l->last > l->rounds - 32;
}

#if defined(__x86_64__)
#define AESNI __attribute__((target("aes,sse2")))

AESNI static __m128i expand(__m128i key, __m128i assist)
{
    assist = _mm_shuffle_epi32(assist, 0xff);
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    return _mm_xor_si128(key, assist);
}

#define EXPAND(rk, i, rcon) rk[i] = expand(rk[i - 1], _mm_aeskeygenassist_si128(rk[i - 1], rcon))

AESNI static void schedule(const unsigned char *key, __m128i rk[11])
{
    rk[0] = _mm_loadu_si128((const __m128i *)key);
    EXPAND(rk, 1, 0x01); EXPAND(rk, 2, 0x02); EXPAND(rk, 3, 0x04); EXPAND(rk, 4, 0x08); EXPAND(rk, 5, 0x10);
    EXPAND(rk, 6, 0x20); EXPAND(rk, 7, 0x40); EXPAND(rk, 8, 0x80); EXPAND(rk, 9, 0x1b); EXPAND(rk, 10, 0x36);
}

/* Each lane's k1 into its e, key k[0:16], IV k[16:32], the lanes' chains a block at a time
 * together, to the longest lane's end. */
AESNI static void cbc_aesni(lane **lanes, int n)
{
    __m128i rk[LANES][11], c[LANES], x[LANES];
    size_t blocks = 0;
    for (int i = 0; i < LANES; i++)
        x[i] = _mm_setzero_si128(); /* a lane past n is never used: said for the compiler */
    for (int i = 0; i < n; i++) {
        schedule(lanes[i]->k, rk[i]);
        c[i] = _mm_loadu_si128((const __m128i *)(lanes[i]->k + 16));
        if (lanes[i]->total / 16 > blocks)
            blocks = lanes[i]->total / 16;
    }
    for (size_t b = 0; b < blocks; b++) {
#pragma GCC unroll 8
        for (int i = 0; i < LANES; i++)
            if (i < n)
                x[i] = _mm_xor_si128(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(lanes[i]->k1 + 16 * b)), c[i]),
                                     rk[i][0]);
        for (int r = 1; r < 10; r++)
#pragma GCC unroll 8
            for (int i = 0; i < LANES; i++)
                if (i < n)
                    x[i] = _mm_aesenc_si128(x[i], rk[i][r]);
#pragma GCC unroll 8
        for (int i = 0; i < LANES; i++)
            if (i < n) {
                c[i] = _mm_aesenclast_si128(x[i], rk[i][10]);
                _mm_storeu_si128((__m128i *)(lanes[i]->e + 16 * b), c[i]);
            }
    }
}

#define VAES __attribute__((target("aes,avx512f,vaes")))
#define VAES_LANES 16 /* four lanes a register, four registers: one VAES instruction's latency covered */

/* cbc_aesni four lanes an instruction: up to sixteen lanes, their chains in four registers. A
 * lane past n repeats lane 0 (the same bytes written twice). */
VAES static void cbc_vaes(lane **lanes, int n)
{
    __m128i keys[11][VAES_LANES] __attribute__((aligned(64)));
    const unsigned char *in[VAES_LANES];
    unsigned char *out[VAES_LANES];
    __m512i c[VAES_LANES / 4], x[VAES_LANES / 4];
    int groups = (n + 3) / 4;
    size_t blocks = 0;
    for (int i = 0; i < 4 * groups; i++) {
        lane *l = lanes[i < n ? i : 0];
        __m128i rk[11];
        schedule(l->k, rk);
        for (int r = 0; r < 11; r++)
            keys[r][i] = rk[r];
        in[i] = l->k1;
        out[i] = l->e;
        if (l->total / 16 > blocks)
            blocks = l->total / 16;
    }
    __m128i iv[VAES_LANES] __attribute__((aligned(64)));
    for (int i = 0; i < VAES_LANES; i++)
        iv[i] = _mm_loadu_si128((const __m128i *)(lanes[i < n ? i : 0]->k + 16));
    for (int g = 0; g < VAES_LANES / 4; g++) {
        c[g] = _mm512_load_si512(&iv[4 * g]);
        x[g] = _mm512_setzero_si512();
    }
    for (size_t b = 0; b < blocks; b++) {
        size_t at = 16 * b;
#pragma GCC unroll 4
        for (int g = 0; g < VAES_LANES / 4; g++)
            if (g < groups) {
                __m512i p = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(in[4 * g] + at)));
                p = _mm512_inserti32x4(p, _mm_loadu_si128((const __m128i *)(in[4 * g + 1] + at)), 1);
                p = _mm512_inserti32x4(p, _mm_loadu_si128((const __m128i *)(in[4 * g + 2] + at)), 2);
                p = _mm512_inserti32x4(p, _mm_loadu_si128((const __m128i *)(in[4 * g + 3] + at)), 3);
                x[g] = _mm512_ternarylogic_epi64(p, c[g], _mm512_load_si512(&keys[0][4 * g]), 0x96);
            }
        for (int r = 1; r < 10; r++)
#pragma GCC unroll 4
            for (int g = 0; g < VAES_LANES / 4; g++)
                if (g < groups)
                    x[g] = _mm512_aesenc_epi128(x[g], _mm512_load_si512(&keys[r][4 * g]));
#pragma GCC unroll 4
        for (int g = 0; g < VAES_LANES / 4; g++)
            if (g < groups) {
                c[g] = _mm512_aesenclast_epi128(x[g], _mm512_load_si512(&keys[10][4 * g]));
                _mm_storeu_si128((__m128i *)(out[4 * g] + at), _mm512_castsi512_si128(c[g]));
                _mm_storeu_si128((__m128i *)(out[4 * g + 1] + at), _mm512_extracti32x4_epi32(c[g], 1));
                _mm_storeu_si128((__m128i *)(out[4 * g + 2] + at), _mm512_extracti32x4_epi32(c[g], 2));
                _mm_storeu_si128((__m128i *)(out[4 * g + 3] + at), _mm512_extracti32x4_epi32(c[g], 3));
            }
    }
}

#define AVX512 __attribute__((target("avx512f,avx512bw")))
#define ROR(x, n) _mm512_ror_epi64(x, n)
#define XOR3(a, b, c) _mm512_ternarylogic_epi64(a, b, c, 0x96)
#define CH(e, f, g) _mm512_ternarylogic_epi64(e, f, g, 0xCA)  /* e ? f : g */
#define MAJ(a, b, c) _mm512_ternarylogic_epi64(a, b, c, 0xE8) /* two of three */

static const uint64_t K512[80] = {
    0x428a2f98d728ae22, 0x7137449123ef65cd, 0xb5c0fbcfec4d3b2f, 0xe9b5dba58189dbbc, 0x3956c25bf348b538,
    0x59f111f1b605d019, 0x923f82a4af194f9b, 0xab1c5ed5da6d8118, 0xd807aa98a3030242, 0x12835b0145706fbe,
    0x243185be4ee4b28c, 0x550c7dc3d5ffb4e2, 0x72be5d74f27b896f, 0x80deb1fe3b1696b1, 0x9bdc06a725c71235,
    0xc19bf174cf692694, 0xe49b69c19ef14ad2, 0xefbe4786384f25e3, 0x0fc19dc68b8cd5b5, 0x240ca1cc77ac9c65,
    0x2de92c6f592b0275, 0x4a7484aa6ea6e483, 0x5cb0a9dcbd41fbd4, 0x76f988da831153b5, 0x983e5152ee66dfab,
    0xa831c66d2db43210, 0xb00327c898fb213f, 0xbf597fc7beef0ee4, 0xc6e00bf33da88fc2, 0xd5a79147930aa725,
    0x06ca6351e003826f, 0x142929670a0e6e70, 0x27b70a8546d22ffc, 0x2e1b21385c26c926, 0x4d2c6dfc5ac42aed,
    0x53380d139d95b3df, 0x650a73548baf63de, 0x766a0abb3c77b2a8, 0x81c2c92e47edaee6, 0x92722c851482353b,
    0xa2bfe8a14cf10364, 0xa81a664bbc423001, 0xc24b8b70d0f89791, 0xc76c51a30654be30, 0xd192e819d6ef5218,
    0xd69906245565a910, 0xf40e35855771202a, 0x106aa07032bbd1b8, 0x19a4c116b8d2d0c8, 0x1e376c085141ab53,
    0x2748774cdf8eeb99, 0x34b0bcb5e19b48a8, 0x391c0cb3c5c95a63, 0x4ed8aa4ae3418acb, 0x5b9cca4f7763e373,
    0x682e6ff3d6b2b8a3, 0x748f82ee5defb2fc, 0x78a5636f43172f60, 0x84c87814a1f0ab72, 0x8cc702081a6439ec,
    0x90befffa23631e28, 0xa4506cebde82bde9, 0xbef9a3f7b2c67915, 0xc67178f2e372532b, 0xca273eceea26619c,
    0xd186b8c721c0c207, 0xeada7dd6cde0eb1e, 0xf57d4f7fee6ed178, 0x06f067aa72176fba, 0x0a637dc5a2c898a6,
    0x113f9804bef90dae, 0x1b710b35131c471b, 0x28db77f523047d84, 0x32caab7b40c72493, 0x3c9ebe0a15c9bebc,
    0x431d67c49c100d4c, 0x4cc5d4becb3e42b6, 0x597f299cfc657e2a, 0x5fcb6fab3ad6faec, 0x6c44198c4a475817};
static const uint64_t IV512[8] = {0x6a09e667f3bcc908, 0xbb67ae8584caa73b, 0x3c6ef372fe94f82b, 0xa54ff53a5f1d36f1,
                                  0x510e527fade682d1, 0x9b05688c2b3e6c1f, 0x1f83d9abfb41bd6b, 0x5be0cd19137e2179};
static const uint64_t IV384[8] = {0xcbbb9d5dc1059ed8, 0x629a292a367cd507, 0x9159015a3070dd17, 0x152fecd8f70e5939,
                                  0x67332667ffc00b31, 0x8eb44a8768581511, 0xdb0c2e0d64f98fa7, 0x47b5481dbefa4fa4};


/* SHA-384 (wide 1) or SHA-512 (wide 2) of each lane's e[0:total] into its k, n lanes at once. */
AVX512 static void sha512_lanes(lane **lanes, int n)
{
    uint64_t st[8][LANES] __attribute__((aligned(64)));
    const __m512i BSWAP64 = _mm512_set_epi8(56, 57, 58, 59, 60, 61, 62, 63, 48, 49, 50, 51, 52, 53, 54, 55, 40, 41, 42, 43,
                                            44, 45, 46, 47, 32, 33, 34, 35, 36, 37, 38, 39, 24, 25, 26, 27, 28, 29, 30, 31,
                                            16, 17, 18, 19, 20, 21, 22, 23, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    static const unsigned char idle[128];
    size_t blocks[LANES], most = 0;
    for (int j = 0; j < LANES; j++) {
        blocks[j] = 0;
        for (int i = 0; i < 8; i++)
            st[i][j] = j < n && lanes[j]->wide == 1 ? IV384[i] : IV512[i];
        if (j >= n)
            continue;
        lane *l = lanes[j]; /* the padding: 0x80, zeros, the length in bits as 128 bits big-endian */
        size_t len = l->total, padded = (len + 17 + 127) / 128 * 128;
        uint64_t bits = (uint64_t)len * 8;
        memset(l->e + len, 0, padded - len);
        l->e[len] = 0x80;
        for (int b = 0; b < 8; b++)
            l->e[padded - 1 - b] = (unsigned char)(bits >> (8 * b));
        blocks[j] = padded / 128;
        if (blocks[j] > most)
            most = blocks[j];
    }
    __m512i s[8];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_load_si512(st[i]);
    for (size_t b = 0; b < most; b++) {
        __mmask8 live = 0;
        long long at[LANES] __attribute__((aligned(64)));
        for (int j = 0; j < LANES; j++) {
            const unsigned char *p = idle;
            if (b < blocks[j]) {
                live |= (__mmask8)(1u << j);
                p = lanes[j]->e + 128 * b;
            }
            at[j] = (long long)(uintptr_t)p;
        }
        __m512i w[16], a = s[0], bb = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
        __m512i where = _mm512_load_si512(at);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            w[t] = _mm512_shuffle_epi8(_mm512_i64gather_epi64(_mm512_add_epi64(where, _mm512_set1_epi64(8 * t)), (void *)0, 1),
                                       BSWAP64);
#pragma GCC unroll 80 /* every w[] index a constant: the schedule stays in registers */
        for (int t = 0; t < 80; t++) {
            if (t >= 16) {
                __m512i w2 = w[(t - 2) & 15], w15 = w[(t - 15) & 15];
                __m512i s1 = XOR3(ROR(w2, 19), ROR(w2, 61), _mm512_srli_epi64(w2, 6));
                __m512i s0 = XOR3(ROR(w15, 1), ROR(w15, 8), _mm512_srli_epi64(w15, 7));
                w[t & 15] = _mm512_add_epi64(_mm512_add_epi64(w[t & 15], s0), _mm512_add_epi64(s1, w[(t - 7) & 15]));
            }
            __m512i t1 = _mm512_add_epi64(_mm512_add_epi64(h, XOR3(ROR(e, 14), ROR(e, 18), ROR(e, 41))),
                                          _mm512_add_epi64(CH(e, f, g), _mm512_add_epi64(_mm512_set1_epi64((long long)K512[t]), w[t & 15])));
            __m512i t2 = _mm512_add_epi64(XOR3(ROR(a, 28), ROR(a, 34), ROR(a, 39)), MAJ(a, bb, c));
            h = g; g = f; f = e; e = _mm512_add_epi64(d, t1);
            d = c; c = bb; bb = a; a = _mm512_add_epi64(t1, t2);
        }
        __m512i out[8] = {a, bb, c, d, e, f, g, h};
        for (int i = 0; i < 8; i++)
            s[i] = _mm512_mask_add_epi64(s[i], live, s[i], out[i]); /* a lane past its end keeps its state */
    }
    for (int i = 0; i < 8; i++)
        _mm512_store_si512(st[i], s[i]);
    for (int j = 0; j < n; j++) {
        lanes[j]->k_len = lanes[j]->wide == 1 ? 48 : 64;
        for (unsigned i = 0; i < lanes[j]->k_len / 8; i++)
            for (int b = 0; b < 8; b++)
                lanes[j]->k[8 * i + b] = (unsigned char)(st[i][j] >> (56 - 8 * b));
    }
}
#endif

static int cbc_evp(EVP_CIPHER_CTX *aes, const EVP_CIPHER *cipher, lane **lanes, int n)
{
    for (int i = 0; i < n; i++) {
        int written = 0;
        if (!EVP_EncryptInit_ex(aes, cipher, NULL, lanes[i]->k, lanes[i]->k + 16) || !EVP_CIPHER_CTX_set_padding(aes, 0)
            || !EVP_EncryptUpdate(aes, lanes[i]->e, &written, lanes[i]->k1, (int)lanes[i]->total)
            || (size_t)written != lanes[i]->total)
            return 0;
    }
    return 1;
}

static int digest(EVP_MD_CTX *md, const EVP_MD *sha2, lane *l)
{
    return EVP_DigestInit_ex2(md, sha2, NULL) && EVP_DigestUpdate(md, l->e, l->total)
           && EVP_DigestFinal_ex(md, l->k, &l->k_len);
}

/* n hashes: hash i of the password passwords[ends[i - 1]:ends[i]] (ends[-1] being 0), the salt
 * at salts + 8 * i and the udata at udata + udata_len * i, written to out + 32 * i. A call with
 * n == 0 says whether the SHA-512 lanes run on this CPU (1) or not (0). Returns 0, or -1 when an
 * argument is out of range or OpenSSL fails. */
int cn_hash_2b(size_t n, const unsigned char *passwords, const size_t *ends, const unsigned char *salts,
               const unsigned char *udata, size_t udata_len, unsigned char *out)
{
#if defined(__x86_64__)
    int aesni = __builtin_cpu_supports("aes");
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    int vaes = avx512 && __builtin_cpu_supports("vaes");
#else
    int avx512 = 0;
#endif
    if (n == 0)
        return avx512 != 0;
    if (udata_len > MAX_UDATA)
        return -1;
    for (size_t i = 0; i < n; i++)
        if (ends[i] < (i ? ends[i - 1] : 0) || ends[i] - (i ? ends[i - 1] : 0) > MAX_PASSWORD)
            return -1;
    int pool = n < POOL ? (int)n : POOL; /* a note's two hashes need not pay for sixteen lanes' memory */
    lane *all = calloc(pool, sizeof(lane)); /* up to 500 KB: not on a thread's stack */
    EVP_MD *sha2[3] = {EVP_MD_fetch(NULL, "SHA256", NULL), EVP_MD_fetch(NULL, "SHA384", NULL),
                       EVP_MD_fetch(NULL, "SHA512", NULL)};
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    EVP_CIPHER *cipher = EVP_CIPHER_fetch(NULL, "AES-128-CBC", NULL);
    EVP_CIPHER_CTX *aes = EVP_CIPHER_CTX_new();
    int ok = all && sha2[0] && sha2[1] && sha2[2] && md && cipher && aes;
    size_t next = 0;
    lane *waiting[POOL]; /* those whose SHA-384 or SHA-512 waits, oldest first */
    int n_waiting = 0;

    while (ok) {
        lane *ready[POOL];
        int n_ready = 0;
        for (int j = 0; ok && j < pool; j++) {
            lane *l = &all[j];
            if (l->busy && !l->wide && !running(l)) {
                memcpy(out + 32 * l->job, l->k, 32);
                l->busy = 0;
            }
            if (!l->busy && next < n) { /* the next hash: K = SHA-256(password, salt, udata) */
                size_t from = next ? ends[next - 1] : 0;
                l->job = next++;
                l->password = passwords + from;
                l->password_len = ends[l->job] - from;
                l->salt = salts + 8 * l->job;
                l->udata = udata + udata_len * l->job;
                l->busy = 1;
                l->rounds = l->last = 0;
                ok = EVP_DigestInit_ex2(md, sha2[0], NULL) && EVP_DigestUpdate(md, l->password, l->password_len)
                     && EVP_DigestUpdate(md, l->salt, 8) && EVP_DigestUpdate(md, l->udata, udata_len)
                     && EVP_DigestFinal_ex(md, l->k, &l->k_len);
            }
            if (l->busy && !l->wide)
                ready[n_ready++] = l;
        }
        if (!ok || (n_ready == 0 && n_waiting == 0))
            break; /* every hash written out */
        for (int i = 0; i < n_ready; i++) {
            lane *l = ready[i];
            size_t sequence = l->password_len + l->k_len + udata_len;
            memcpy(l->k1, l->password, l->password_len);
            memcpy(l->k1 + l->password_len, l->k, l->k_len);
            memcpy(l->k1 + l->password_len + l->k_len, l->udata, udata_len);
            for (size_t at = sequence; at < 64 * sequence; at += sequence)
                memcpy(l->k1 + at, l->k1, sequence);
            l->total = 64 * sequence;
        }
#if defined(__x86_64__)
        if (vaes && n_ready > LANES) /* fewer: AES-NI's eight lanes wait less on each other than two registers */
            for (int i = 0; i < n_ready; i += VAES_LANES)
                cbc_vaes(ready + i, n_ready - i < VAES_LANES ? n_ready - i : VAES_LANES);
        else
#endif
        for (int i = 0; ok && i < n_ready; i += LANES) {
            int group = n_ready - i < LANES ? n_ready - i : LANES;
#if defined(__x86_64__)
            if (aesni)
                cbc_aesni(ready + i, group);
            else
#endif
                ok = cbc_evp(aes, cipher, ready + i, group);
        }
        for (int i = 0; ok && i < n_ready; i++) {
            lane *l = ready[i];
            int sum = 0;
            /* the first 16 bytes as a big-endian number, mod 3: 256 = 1 (mod 3), so the bytes' sum */
            for (int b = 0; b < 16; b++)
                sum += l->e[b];
            l->last = l->e[l->total - 1];
            l->rounds++;
            if (sum % 3 && avx512) {
                l->wide = sum % 3; /* 1: SHA-384, 2: SHA-512, in the lanes */
                waiting[n_waiting++] = l;
            } else
                ok = digest(md, sha2[sum % 3], l);
        }
        /* lanes that will take the AES next (still running, or free for a hash left); with the
         * waiting ones, those in flight: fewer than eight in flight never fill the lanes, so then
         * none waits */
        int moving = 0, done = 0;
        for (int j = 0; j < pool; j++)
            if (!all[j].wide && ((all[j].busy && running(&all[j])) || next < n))
                moving++;
        while (ok && done < n_waiting) {
            int group = n_waiting - done < LANES ? n_waiting - done : LANES;
            if (group < LANES && moving && moving + n_waiting >= LANES)
                break; /* they wait for more to fill the lanes */
#if defined(__x86_64__)
            if (group >= WIDE_FROM)
                sha512_lanes(waiting + done, group);
            else
#endif
                for (int g = 0; ok && g < group; g++)
                    ok = digest(md, sha2[waiting[done + g]->wide], waiting[done + g]);
            for (int g = 0; g < group; g++)
                waiting[done + g]->wide = 0;
            done += group;
        }
        n_waiting -= done;
        memmove(waiting, waiting + done, n_waiting * sizeof(lane *));
    }
    for (int i = 0; i < 3; i++)
        EVP_MD_free(sha2[i]);
    EVP_MD_CTX_free(md);
    EVP_CIPHER_free(cipher);
    EVP_CIPHER_CTX_free(aes);
    if (all)
        OPENSSL_cleanse(all, pool * sizeof(lane)); /* the passwords, and the keys UE and OE are made with */
    free(all);
    return ok ? 0 : -1;
}
