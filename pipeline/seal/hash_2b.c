/* ISO 32000-2 algorithm 2.B (the R6 password hash), built by pipeline/native.py. A document
 * runs it four times, in two pairs that share a password and differ in the salt (U and UE,
 * then O and OE): 64 or more rounds each of AES-128-CBC over up to 15 KB and a SHA-2 of the
 * result. CBC is a chain: one block's AES waits for the one before, so a lone hash leaves the
 * AES unit idle most of the time. cn_hash_2b runs up to two hashes in lockstep (two lanes), the
 * AES of one filling the other's waits (AES-NI where the CPU has it, OpenSSL's EVP where not);
 * the SHA-2 is OpenSSL's, fetched once a call rather than implicitly every round.
 * pdfcrypt.hash_2b_reference is the same algorithm in Python, and tests/test_r6_hash.py holds
 * the two and a published vector together.
 */
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_PASSWORD 127 /* ISO 32000-2 7.6.4.3.3: the password's first 127 bytes */
#define MAX_UDATA 48     /* the U string, when hashing the owner's password */
#define MAX_SEQUENCE (MAX_PASSWORD + 64 + MAX_UDATA)
#define LANES 2

typedef struct {
    unsigned char k[64];
    unsigned int k_len;
    int rounds, last;
    size_t total; /* bytes of this round's input (64 times the sequence) */
    unsigned char k1[64 * MAX_SEQUENCE], e[64 * MAX_SEQUENCE];
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

AESNI static __m128i block(const __m128i rk[11], __m128i x)
{
    for (int r = 1; r < 10; r++)
        x = _mm_aesenc_si128(x, rk[r]);
    return _mm_aesenclast_si128(x, rk[10]);
}

/* Each lane's k1 into its e, key k[0:16], IV k[16:32]: both lanes a block at a time while both
 * have blocks (the two chains independent, so their AES rounds overlap), then the longer alone. */
AESNI static void cbc_aesni(lane **lanes, int n)
{
    __m128i rk[LANES][11], c[LANES];
    size_t blocks[LANES], both;
    for (int i = 0; i < n; i++) {
        schedule(lanes[i]->k, rk[i]);
        c[i] = _mm_loadu_si128((const __m128i *)(lanes[i]->k + 16));
        blocks[i] = lanes[i]->total / 16;
    }
    both = n == 2 ? (blocks[0] < blocks[1] ? blocks[0] : blocks[1]) : 0;
    for (size_t b = 0; b < both; b++) {
        __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(lanes[0]->k1 + 16 * b)), c[0]);
        __m128i x1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(lanes[1]->k1 + 16 * b)), c[1]);
        x0 = _mm_xor_si128(x0, rk[0][0]);
        x1 = _mm_xor_si128(x1, rk[1][0]);
        for (int r = 1; r < 10; r++) {
            x0 = _mm_aesenc_si128(x0, rk[0][r]);
            x1 = _mm_aesenc_si128(x1, rk[1][r]);
        }
        c[0] = _mm_aesenclast_si128(x0, rk[0][10]);
        c[1] = _mm_aesenclast_si128(x1, rk[1][10]);
        _mm_storeu_si128((__m128i *)(lanes[0]->e + 16 * b), c[0]);
        _mm_storeu_si128((__m128i *)(lanes[1]->e + 16 * b), c[1]);
    }
    for (int i = 0; i < n; i++)
        for (size_t b = both; b < blocks[i]; b++) {
            __m128i x = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(lanes[i]->k1 + 16 * b)), c[i]);
            c[i] = block(rk[i], _mm_xor_si128(x, rk[i][0]));
            _mm_storeu_si128((__m128i *)(lanes[i]->e + 16 * b), c[i]);
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

/* `lanes` (1 or 2) hashes of one password, salt i at salts + 8 * i, hash i to out + 32 * i.
 * Returns 0, or -1 when an argument is out of range or OpenSSL fails. */
int cn_hash_2b(const unsigned char *password, size_t password_len, const unsigned char *salts, int lanes,
               const unsigned char *udata, size_t udata_len, unsigned char *out)
{
    if (password_len > MAX_PASSWORD || udata_len > MAX_UDATA || lanes < 1 || lanes > LANES)
        return -1;
    lane *all = malloc(LANES * sizeof(lane)); /* 60 KB: not on a thread's stack */
    EVP_MD *sha2[3] = {EVP_MD_fetch(NULL, "SHA256", NULL), EVP_MD_fetch(NULL, "SHA384", NULL),
                       EVP_MD_fetch(NULL, "SHA512", NULL)};
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    EVP_CIPHER *cipher = EVP_CIPHER_fetch(NULL, "AES-128-CBC", NULL);
    EVP_CIPHER_CTX *aes = EVP_CIPHER_CTX_new();
    int ok = all && sha2[0] && sha2[1] && sha2[2] && md && cipher && aes;
#if defined(__x86_64__)
    int aesni = __builtin_cpu_supports("aes");
#endif

    for (int i = 0; ok && i < lanes; i++) {
        all[i].rounds = all[i].last = 0;
        ok = EVP_DigestInit_ex2(md, sha2[0], NULL) && EVP_DigestUpdate(md, password, password_len)
             && EVP_DigestUpdate(md, salts + 8 * i, 8) && EVP_DigestUpdate(md, udata, udata_len)
             && EVP_DigestFinal_ex(md, all[i].k, &all[i].k_len);
    }
    while (ok) {
        lane *active[LANES];
        int n = 0;
        for (int i = 0; i < lanes; i++)
            if (running(&all[i]))
                active[n++] = &all[i];
        if (n == 0)
            break;
        for (int i = 0; i < n; i++) {
            lane *l = active[i];
            size_t sequence = password_len + l->k_len + udata_len;
            memcpy(l->k1, password, password_len);
            memcpy(l->k1 + password_len, l->k, l->k_len);
            memcpy(l->k1 + password_len + l->k_len, udata, udata_len);
            for (size_t at = sequence; at < 64 * sequence; at += sequence)
                memcpy(l->k1 + at, l->k1, sequence);
            l->total = 64 * sequence;
        }
#if defined(__x86_64__)
        if (aesni)
            cbc_aesni(active, n);
        else
#endif
            ok = cbc_evp(aes, cipher, active, n);
        for (int i = 0; ok && i < n; i++) {
            lane *l = active[i];
            int sum = 0;
            /* the first 16 bytes as a big-endian number, mod 3: 256 = 1 (mod 3), so the bytes' sum */
            for (int b = 0; b < 16; b++)
                sum += l->e[b];
            ok = EVP_DigestInit_ex2(md, sha2[sum % 3], NULL) && EVP_DigestUpdate(md, l->e, l->total)
                 && EVP_DigestFinal_ex(md, l->k, &l->k_len);
            l->last = l->e[l->total - 1];
            l->rounds++;
        }
    }
    for (int i = 0; ok && i < lanes; i++)
        memcpy(out + 32 * i, all[i].k, 32);
    for (int i = 0; i < 3; i++)
        EVP_MD_free(sha2[i]);
    EVP_MD_CTX_free(md);
    EVP_CIPHER_free(cipher);
    EVP_CIPHER_CTX_free(aes);
    free(all);
    return ok ? 0 : -1;
}
