/* ISO 32000-2 algorithm 2.B (the R6 password hash) over OpenSSL's EVP, built by
 * pipeline/seal/compiled.py. A document runs it four times (U, UE, O, OE): 64 or more rounds
 * each of AES-128-CBC over up to 15 KB and a SHA-2 of the result. In Python each round paid
 * for a cipher object, a 64-fold concatenation and a sum in the interpreter; here a round is
 * the two primitives and nothing else. pdfcrypt.hash_2b_reference is the same algorithm in
 * Python, and tests/test_r6_hash.py holds the two and a published vector together.
 */
#include <openssl/evp.h>
#include <string.h>

#define MAX_PASSWORD 127 /* ISO 32000-2 7.6.4.3.3: the password's first 127 bytes */
#define MAX_UDATA 48     /* the U string, when hashing the owner's password */
#define MAX_SEQUENCE (MAX_PASSWORD + 64 + MAX_UDATA)

/* Returns 0, or -1 when an argument is out of range or OpenSSL fails. */
int cn_hash_2b(const unsigned char *password, size_t password_len, const unsigned char *salt,
               const unsigned char *udata, size_t udata_len, unsigned char *out)
{
    unsigned char k1[64 * MAX_SEQUENCE], e[64 * MAX_SEQUENCE]; /* 30 KB on the caller's stack: threads may share */
    const EVP_MD *sha2[3] = {EVP_sha256(), EVP_sha384(), EVP_sha512()};
    unsigned char k[64];
    unsigned int k_len = 0;
    int rounds = 0, last = 0, ok = 1;

    if (password_len > MAX_PASSWORD || udata_len > MAX_UDATA)
        return -1;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    EVP_CIPHER_CTX *aes = EVP_CIPHER_CTX_new();
    ok = md && aes && EVP_DigestInit_ex(md, sha2[0], NULL) && EVP_DigestUpdate(md, password, password_len)
         && EVP_DigestUpdate(md, salt, 8) && EVP_DigestUpdate(md, udata, udata_len)
         && EVP_DigestFinal_ex(md, k, &k_len);
    while (ok && (rounds < 64 || last > rounds - 32)) {
        size_t sequence = password_len + k_len + udata_len, total = 64 * sequence;
        int written = 0, sum = 0;
        memcpy(k1, password, password_len);
        memcpy(k1 + password_len, k, k_len);
        memcpy(k1 + password_len + k_len, udata, udata_len);
        for (size_t at = sequence; at < total; at += sequence)
            memcpy(k1 + at, k1, sequence);
        ok = EVP_EncryptInit_ex(aes, EVP_aes_128_cbc(), NULL, k, k + 16) && EVP_CIPHER_CTX_set_padding(aes, 0)
             && EVP_EncryptUpdate(aes, e, &written, k1, (int)total) && (size_t)written == total;
        /* the first 16 bytes as a big-endian number, mod 3: 256 = 1 (mod 3), so the bytes' sum */
        for (int i = 0; ok && i < 16; i++)
            sum += e[i];
        ok = ok && EVP_Digest(e, total, k, &k_len, sha2[sum % 3], NULL);
        last = e[total - 1];
        rounds++;
    }
    if (ok)
        memcpy(out, k, 32);
    EVP_MD_CTX_free(md);
    EVP_CIPHER_CTX_free(aes);
    return ok ? 0 : -1;
}
