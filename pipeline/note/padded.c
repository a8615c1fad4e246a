/* A note's trade table as monospaced lines (pipeline/note/content.py's padded() is the rule and
 * its Python twin), as a CPython extension module built by pipeline/native.py. In Python a
 * note's rows were measured a column at a time (a len() a cell) and then each padded by a
 * %-template and stripped: ~1.2 us a row. Here the cells are measured and each line written in
 * one pass over them.
 *
 * Only ASCII cells are done here (a note's are: numbers, times, symbols, ASCII by the dumps'
 * rules); a row of any other shape, or a cell of any other text, is left to the twin: lines()
 * returns None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_COLUMNS 64

/* The cells of `row` (label, cells) if each is an ASCII str, with `columns` of them; else NULL. */
static PyObject *cells_of(PyObject *row, Py_ssize_t columns)
{
    if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 2)
        return NULL;
    PyObject *cells = PyTuple_GET_ITEM(row, 1);
    if (!PyTuple_CheckExact(cells) || PyTuple_GET_SIZE(cells) != columns)
        return NULL;
    for (Py_ssize_t c = 0; c < columns; c++) {
        PyObject *cell = PyTuple_GET_ITEM(cells, c);
        if (!PyUnicode_CheckExact(cell) || !PyUnicode_IS_ASCII(cell))
            return NULL;
    }
    return cells;
}

/* lines(rows, least, right, gap) -> (widths, [(label, line), ...]) or None.
 * rows: [(label, cells)], least: each column's least width, right: whether it is right-aligned,
 * gap: the ASCII text between two columns. A column is as wide as its widest cell, never
 * narrower than its least; a line's trailing whitespace is stripped, as str.rstrip() does. */
static PyObject *lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2]) ||
        !PyUnicode_CheckExact(args[3]) || !PyUnicode_IS_ASCII(args[3]))
        Py_RETURN_NONE;
    PyObject *rows = args[0], *gap = args[3];
    Py_ssize_t columns = PyTuple_GET_SIZE(args[1]), n = PyList_GET_SIZE(rows), gap_len = PyUnicode_GET_LENGTH(gap);
    if (columns < 1 || columns > MAX_COLUMNS || PyTuple_GET_SIZE(args[2]) != columns)
        Py_RETURN_NONE;
    Py_ssize_t widths[MAX_COLUMNS];
    int right[MAX_COLUMNS];
    for (Py_ssize_t c = 0; c < columns; c++) {
        widths[c] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[1], c));
        if (widths[c] < 0) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if ((right[c] = PyObject_IsTrue(PyTuple_GET_ITEM(args[2], c))) < 0)
            return NULL;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *cells = cells_of(PyList_GET_ITEM(rows, r), columns);
        if (cells == NULL)
            Py_RETURN_NONE;
        for (Py_ssize_t c = 0; c < columns; c++) {
            Py_ssize_t len = PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(cells, c));
            if (len > widths[c])
                widths[c] = len;
        }
    }
    Py_ssize_t total = gap_len * (columns - 1);
    for (Py_ssize_t c = 0; c < columns; c++)
        total += widths[c];
    char *line = PyMem_Malloc(total + 1);
    PyObject *out = PyList_New(n), *measured = PyList_New(columns);
    if (line == NULL || out == NULL || measured == NULL)
        goto fail;
    for (Py_ssize_t c = 0; c < columns; c++) {
        PyObject *w = PyLong_FromSsize_t(widths[c]);
        if (w == NULL)
            goto fail;
        PyList_SET_ITEM(measured, c, w);
    }
    const char *between = (const char *)PyUnicode_1BYTE_DATA(gap);
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r), *cells = PyTuple_GET_ITEM(row, 1);
        char *o = line;
        for (Py_ssize_t c = 0; c < columns; c++) {
            PyObject *cell = PyTuple_GET_ITEM(cells, c);
            Py_ssize_t len = PyUnicode_GET_LENGTH(cell), pad = widths[c] - len;
            if (c) {
                memcpy(o, between, gap_len);
                o += gap_len;
            }
            if (right[c]) {
                memset(o, ' ', pad);
                o += pad;
            }
            memcpy(o, PyUnicode_1BYTE_DATA(cell), len);
            o += len;
            if (!right[c]) {
                memset(o, ' ', pad);
                o += pad;
            }
        }
        while (o > line && Py_UNICODE_ISSPACE((unsigned char)o[-1]))
            o--;
        PyObject *text = PyUnicode_New(o - line, 127);
        if (text == NULL)
            goto fail;
        memcpy(PyUnicode_1BYTE_DATA(text), line, o - line);
        PyObject *pair = PyTuple_Pack(2, PyTuple_GET_ITEM(row, 0), text);
        Py_DECREF(text);
        if (pair == NULL)
            goto fail;
        PyList_SET_ITEM(out, r, pair);
    }
    PyMem_Free(line);
    PyObject *made = PyTuple_Pack(2, measured, out);
    Py_DECREF(measured);
    Py_DECREF(out);
    return made;
fail:
    PyMem_Free(line);
    Py_XDECREF(out);
    Py_XDECREF(measured);
    return NULL;
}

/* spaced(line) -> str or None: pipeline/note/spaced.py's spaced(), for an ASCII line (None for
 * any other): each run of two or more spaces as the wide spaces of its width, widest first
 * (WIDE: U+2002 to U+2006, 2 to 32 cells), an odd cell as a space. */
#define WIDE_FIRST 0x2002
#define WIDE_KINDS 5

static PyObject *spaced(PyObject *self, PyObject *line)
{
    if (!PyUnicode_CheckExact(line) || !PyUnicode_IS_ASCII(line))
        Py_RETURN_NONE;
    const unsigned char *in = PyUnicode_1BYTE_DATA(line);
    Py_ssize_t n = PyUnicode_GET_LENGTH(line), size = 0, runs = 0;
    for (Py_ssize_t i = 0; i < n;) {
        if (in[i] != ' ' || i + 1 == n || in[i + 1] != ' ') {
            size++, i++;
            continue;
        }
        Py_ssize_t run = 0;
        while (i < n && in[i] == ' ')
            run++, i++;
        size += run / (1 << WIDE_KINDS) + __builtin_popcountll(run % (1 << WIDE_KINDS));
        runs++;
    }
    if (runs == 0)
        return Py_NewRef(line);
    PyObject *out = PyUnicode_New(size, 0xffff);
    if (out == NULL)
        return NULL;
    Py_UCS2 *o = PyUnicode_2BYTE_DATA(out);
    for (Py_ssize_t i = 0; i < n;) {
        if (in[i] != ' ' || i + 1 == n || in[i + 1] != ' ') {
            *o++ = in[i++];
            continue;
        }
        Py_ssize_t run = 0;
        while (i < n && in[i] == ' ')
            run++, i++;
        for (; run >= (1 << WIDE_KINDS); run -= 1 << WIDE_KINDS)
            *o++ = WIDE_FIRST + WIDE_KINDS - 1;
        for (int k = WIDE_KINDS - 1; k >= 1; k--)
            if (run & (1 << k))
                *o++ = WIDE_FIRST + k - 1;
        if (run & 1)
            *o++ = ' ';
    }
    return out;
}

static PyMethodDef METHODS[] = {
    {"lines", (PyCFunction)(void (*)(void))lines, METH_FASTCALL, "lines(rows, least, right, gap): widths, lines"},
    {"spaced", spaced, METH_O, "spaced(line): its runs of spaces as wide spaces, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "padded", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_padded(void)
{
    return PyModule_Create(&MODULE);
}
