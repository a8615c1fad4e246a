/* MD5 (RFC 1321) of up to eight messages at once, built by pipeline/native.py: the delivery
 * log's md5 of each note a mailer sends, which `verify` holds to S3's listing (an object's
 * ETag). A message's MD5 is a chain of 64 dependent steps a block, ~0.8 GB/s a core for
 * OpenSSL here: ~45 us of a 35 KB note, a ninth of a mail's CPU. Eight notes side by side fill
 * AVX2's eight 32-bit lanes, each step done on eight words at once. A lane whose message has
 * no block left keeps its state until the longest is done. Without AVX2 the call says so
 * (-1, asked once with no message) and the caller hashes one by one (pipeline/mail/md5s.py).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES 8

static const uint32_t K[64] = {
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391};

typedef struct {
    const unsigned char *data;
    size_t full;                /* whole 64-byte blocks of the message itself */
    size_t blocks;              /* with the one or two padded blocks after them */
    unsigned char tail[128];    /* the message's last bytes, 0x80, zeros, its length in bits */
} lane;

static void prepare(lane *l, const unsigned char *data, size_t len)
{
    size_t rest = len % 64, pad = rest < 56 ? 64 : 128;
    uint64_t bits = (uint64_t)len * 8;
    l->data = data;
    l->full = len / 64;
    l->blocks = l->full + pad / 64;
    memset(l->tail, 0, sizeof l->tail);
    memcpy(l->tail, data + l->full * 64, rest);
    l->tail[rest] = 0x80;
    for (int i = 0; i < 8; i++)
        l->tail[pad - 8 + i] = (unsigned char)(bits >> (8 * i));
}

static const unsigned char *block(const lane *l, size_t k)
{
    return k < l->full ? l->data + k * 64 : l->tail + (k - l->full) * 64;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i rotl(__m256i x, int s)
{
    return _mm256_or_si256(_mm256_slli_epi32(x, s), _mm256_srli_epi32(x, 32 - s));
}

/* r[j], eight words of lane j, become r[w], word w of each lane (an 8x8 transpose). */
AVX2 static inline void transpose(__m256i *r)
{
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);     /* rows i, i+1: words 0, 1 | 4, 5 */
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]); /* words 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);     /* rows i..i+3: word 0 | 4 */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]); /* word 1 | 5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]); /* word 2 | 6 */
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]); /* word 3 | 7 */
    }
    for (int w = 0; w < 4; w++) {
        r[w] = _mm256_permute2x128_si256(u[w], u[w + 4], 0x20);
        r[w + 4] = _mm256_permute2x128_si256(u[w], u[w + 4], 0x31);
    }
}

/* The four rounds' functions (RFC 1321 3.4), each on eight lanes. */
#define F(x, y, z) _mm256_xor_si256(z, _mm256_and_si256(x, _mm256_xor_si256(y, z)))
#define G(x, y, z) _mm256_xor_si256(y, _mm256_and_si256(z, _mm256_xor_si256(x, y)))
#define H(x, y, z) _mm256_xor_si256(_mm256_xor_si256(x, y), z)
#define I(x, y, z) _mm256_xor_si256(y, _mm256_or_si256(x, _mm256_xor_si256(z, ones)))

/* One step: a = b + rotl(a + f + K[i] + M[g], s). */
#define STEP(f, a, b, c, d, i, g, s)                                                              \
    a = _mm256_add_epi32(b, rotl(_mm256_add_epi32(_mm256_add_epi32(a, f),                          \
                                                  _mm256_add_epi32(_mm256_set1_epi32((int)K[i]), m[g])), s))

AVX2 static void md5_avx2(lane *lanes, int n, unsigned char *out)
{
    static const unsigned char zero[64];
    const __m256i ones = _mm256_set1_epi32(-1);
    __m256i a = _mm256_set1_epi32(0x67452301), b = _mm256_set1_epi32((int)0xefcdab89);
    __m256i c = _mm256_set1_epi32((int)0x98badcfe), d = _mm256_set1_epi32(0x10325476);
    size_t most = 0;
    for (int j = 0; j < n; j++)
        most = lanes[j].blocks > most ? lanes[j].blocks : most;
    for (size_t k = 0; k < most; k++) {
        const unsigned char *p[LANES];
        int32_t live[LANES];
        for (int j = 0; j < LANES; j++) {
            int on = j < n && k < lanes[j].blocks;
            p[j] = on ? block(&lanes[j], k) : zero;
            live[j] = on ? -1 : 0;
        }
        __m256i m[16]; /* m[w]: word w (little-endian, as MD5 reads it) of each lane's block */
        for (int j = 0; j < LANES; j++) {
            m[j] = _mm256_loadu_si256((const __m256i *)p[j]);
            m[8 + j] = _mm256_loadu_si256((const __m256i *)(p[j] + 32));
        }
        transpose(m);
        transpose(m + 8);
        __m256i a0 = a, b0 = b, c0 = c, d0 = d;
        for (int i = 0; i < 16; i += 4) {
            STEP(F(b, c, d), a, b, c, d, i, i, 7);
            STEP(F(a, b, c), d, a, b, c, i + 1, i + 1, 12);
            STEP(F(d, a, b), c, d, a, b, i + 2, i + 2, 17);
            STEP(F(c, d, a), b, c, d, a, i + 3, i + 3, 22);
        }
        for (int i = 16; i < 32; i += 4) {
            STEP(G(b, c, d), a, b, c, d, i, (5 * i + 1) % 16, 5);
            STEP(G(a, b, c), d, a, b, c, i + 1, (5 * i + 6) % 16, 9);
            STEP(G(d, a, b), c, d, a, b, i + 2, (5 * i + 11) % 16, 14);
            STEP(G(c, d, a), b, c, d, a, i + 3, (5 * i + 16) % 16, 20);
        }
        for (int i = 32; i < 48; i += 4) {
            STEP(H(b, c, d), a, b, c, d, i, (3 * i + 5) % 16, 4);
            STEP(H(a, b, c), d, a, b, c, i + 1, (3 * i + 8) % 16, 11);
            STEP(H(d, a, b), c, d, a, b, i + 2, (3 * i + 11) % 16, 16);
            STEP(H(c, d, a), b, c, d, a, i + 3, (3 * i + 14) % 16, 23);
        }
        for (int i = 48; i < 64; i += 4) {
            STEP(I(b, c, d), a, b, c, d, i, (7 * i) % 16, 6);
            STEP(I(a, b, c), d, a, b, c, i + 1, (7 * i + 7) % 16, 10);
            STEP(I(d, a, b), c, d, a, b, i + 2, (7 * i + 14) % 16, 15);
            STEP(I(c, d, a), b, c, d, a, i + 3, (7 * i + 21) % 16, 21);
        }
        __m256i on = _mm256_loadu_si256((const __m256i *)live); /* a finished lane keeps its state */
        a = _mm256_blendv_epi8(a0, _mm256_add_epi32(a0, a), on);
        b = _mm256_blendv_epi8(b0, _mm256_add_epi32(b0, b), on);
        c = _mm256_blendv_epi8(c0, _mm256_add_epi32(c0, c), on);
        d = _mm256_blendv_epi8(d0, _mm256_add_epi32(d0, d), on);
    }
    uint32_t s[4][LANES];
    _mm256_storeu_si256((__m256i *)s[0], a);
    _mm256_storeu_si256((__m256i *)s[1], b);
    _mm256_storeu_si256((__m256i *)s[2], c);
    _mm256_storeu_si256((__m256i *)s[3], d);
    for (int j = 0; j < n; j++)
        for (int w = 0; w < 4; w++)
            memcpy(out + 16 * j + 4 * w, &s[w][j], 4);
}
#endif

/* Each of the n (at most 8) messages' digest, 16 bytes each into out; 0, or -1 where the CPU
 * has no AVX2 (nothing written). */
int cn_md5_lanes(const unsigned char *const *data, const size_t *lens, int n, unsigned char *out)
{
#if defined(__x86_64__)
    if (n < 0 || n > LANES || !__builtin_cpu_supports("avx2"))
        return -1;
    lane lanes[LANES];
    for (int j = 0; j < n; j++)
        prepare(&lanes[j], data[j], lens[j]);
    md5_avx2(lanes, n, out);
    return 0;
#else
    (void)data, (void)lens, (void)n, (void)out;
    return -1;
#endif
}
