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

static PyMethodDef METHODS[] = {
    {"lines", (PyCFunction)(void (*)(void))lines, METH_FASTCALL, "lines(rows, least, right, gap): widths, lines"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "padded", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_padded(void)
{
    return PyModule_Create(&MODULE);
}
