/* The first notes' read of a chunk of whole lines (pipeline/day/split.py's _wanted_rows): whether
   the csv module would read it as one row a line, its newlines, and the lines that hold one of a
   few client codes or a mark in one field (a trade modified or cancelled: its move to another
   client), in one call. The same in Python took ten passes over the chunk (a count or a search
   each); the driver spent 0.55 s reading a 20,000-account day's 62 MB for its first notes. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

static int by_offset(const void *a, const void *b)
{
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

/* -1: not a row a line (a quote, a NUL, a CR not before an LF, a blank line, or a newline first),
   as split.py's _a_row_a_line says. -2: more than `cap` hits (a line once a code, or once for its
   field), with `*newlines` the hits: room to call again with. Otherwise the number of
   such lines: their starts in `starts` (in order, each once) and, in `rows`, the newlines before
   each; `*newlines` the chunk's. The codes are `needles`, `count` of them, one after the other,
   `lengths` long each; a line is held too when its field number `column` (from 0; -1: none)
   holds one of the `marks`, given the same way. */
long cn_wanted_lines(const char *data, long size, const char *needles, const long *lengths, long count,
                     long column, const char *marks, const long *mark_lengths, long mark_count,
                     long *starts, long *rows, long cap, long *newlines)
{
    const char *end = data + size, *p, *q;
    long lines = 0, found = 0;

    if (memchr(data, '"', size) || memchr(data, '\0', size))
        return -1;
    if (size && (data[0] == '\n' || (size > 1 && data[0] == '\r' && data[1] == '\n')))
        return -1;
    for (p = data; (q = memchr(p, '\r', end - p)); p = q + 1)
        if (q + 1 == end || q[1] != '\n')
            return -1;
    for (p = data; (q = memchr(p, '\n', end - p)); p = q + 1) {
        lines++;
        if (q + 1 < end && (q[1] == '\n' || (q[1] == '\r' && q + 2 < end && q[2] == '\n')))
            return -1;
    }
    *newlines = lines;

    for (long i = 0, at = 0; i < count; at += lengths[i++]) {
        const char *needle = needles + at;
        for (p = data; lengths[i] && p < end && (q = memmem(p, end - p, needle, lengths[i])); ) {
            const char *start = q, *eol = memchr(q, '\n', end - q);
            while (start > data && start[-1] != '\n')
                start--;
            if (found < cap)
                starts[found] = start - data;
            found++;
            p = eol ? eol + 1 : end;  /* the line is held: on to the next (each line once a code) */
        }
    }
    for (p = data; column >= 0 && p < end; p++) { /* a byte at a time: memchr's call a field cost more */
        const char *line = p, *field = column ? NULL : p, *last = NULL;
        for (long commas = 0; p < end && *p != '\n'; p++)
            if (*p == ',' && ++commas >= column) {
                if (field) {
                    last = last ? last : p;
                } else
                    field = p + 1;
            }
        if (!field)
            continue;
        last = last ? last : p;
        for (long i = 0, at = 0; i < mark_count; at += mark_lengths[i++])
            if (mark_lengths[i] && memmem(field, last - field, marks + at, mark_lengths[i])) {
                if (found < cap)
                    starts[found] = line - data;
                found++;
                break;
            }
    }
    if (found > cap) {
        *newlines = found; /* the room a call again needs */
        return -2;
    }
    qsort(starts, found, sizeof *starts, by_offset);
    long kept = 0, before = 0;
    for (long i = 0; i < found; i++) {
        if (kept && starts[kept - 1] == starts[i])
            continue;
        for (p = data + (kept ? starts[kept - 1] : 0); (q = memchr(p, '\n', data + starts[i] - p)); p = q + 1)
            before++;
        starts[kept] = starts[i];
        rows[kept++] = before;
    }
    return kept;
}
