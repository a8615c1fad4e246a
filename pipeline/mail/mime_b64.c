/* Base64 for a MIME body (RFC 2045 6.8): 76-character lines joined by CRLF, none after the
 * last. One pass, where Python's b64encode and a cut into lines took two (~140 us for a note's
 * 36 KB on this VM, the largest part of building its e-mail). 76 is a multiple of 4, so lines
 * end between groups: a line is 19 groups of 3 bytes. Each group's 24 bits are two 12-bit
 * halves looked up in a table of character pairs (8 KB, made when the library loads): half the
 * lookups of one character at a time, 23 -> ~10 us a note. */
#include <stddef.h>
#include <string.h>

static const char ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
static char PAIRS[4096][2];

__attribute__((constructor)) static void cn_mime_b64_pairs(void)
{
    for (int i = 0; i < 4096; i++) {
        PAIRS[i][0] = ALPHABET[i >> 6];
        PAIRS[i][1] = ALPHABET[i & 63];
    }
}

size_t cn_mime_b64_size(size_t n)
{
    size_t chars = (n + 2) / 3 * 4;
    return chars ? chars + (chars - 1) / 76 * 2 : 0;
}

static inline char *group(const unsigned char *in, char *o)
{
    unsigned v = (unsigned)in[0] << 16 | (unsigned)in[1] << 8 | in[2];
    memcpy(o, PAIRS[v >> 12], 2);
    memcpy(o + 2, PAIRS[v & 4095], 2);
    return o + 4;
}

size_t cn_mime_b64(const unsigned char *in, size_t n, char *out)
{
    char *o = out;
    size_t i = 0, column = 0;
    for (; i + 57 <= n; i += 57) { /* whole lines */
        if (i) {
            *o++ = '\r';
            *o++ = '\n';
        }
        for (int g = 0; g < 19; g++)
            o = group(in + i + 3 * g, o);
        column = 76;
    }
    for (; i + 3 <= n; i += 3) { /* the last line's whole groups */
        if (column == 76) {
            *o++ = '\r';
            *o++ = '\n';
            column = 0;
        }
        o = group(in + i, o);
        column += 4;
    }
    if (i < n) {
        if (column == 76) {
            *o++ = '\r';
            *o++ = '\n';
        }
        unsigned v = (unsigned)in[i] << 16 | (i + 1 < n ? (unsigned)in[i + 1] << 8 : 0);
        o[0] = ALPHABET[v >> 18];
        o[1] = ALPHABET[v >> 12 & 63];
        o[2] = i + 1 < n ? ALPHABET[v >> 6 & 63] : '=';
        o[3] = '=';
        o += 4;
    }
    return (size_t)(o - out);
}
