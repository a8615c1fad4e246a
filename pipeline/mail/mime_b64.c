/* Base64 for a MIME body (RFC 2045 6.8): 76-character lines joined by CRLF, none after the
 * last. One pass, where Python's b64encode and a cut into lines took two (~140 us for a note's
 * 36 KB on this VM, the largest part of building its e-mail). 76 is a multiple of 4, so lines
 * end between groups. */
#include <stddef.h>

static const char ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t cn_mime_b64_size(size_t n)
{
    size_t chars = (n + 2) / 3 * 4;
    return chars ? chars + (chars - 1) / 76 * 2 : 0;
}

size_t cn_mime_b64(const unsigned char *in, size_t n, char *out)
{
    char *o = out;
    size_t i = 0, column = 0;
    for (; i + 3 <= n; i += 3) {
        if (column == 76) {
            *o++ = '\r';
            *o++ = '\n';
            column = 0;
        }
        unsigned v = (unsigned)in[i] << 16 | (unsigned)in[i + 1] << 8 | in[i + 2];
        o[0] = ALPHABET[v >> 18];
        o[1] = ALPHABET[v >> 12 & 63];
        o[2] = ALPHABET[v >> 6 & 63];
        o[3] = ALPHABET[v & 63];
        o += 4;
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
