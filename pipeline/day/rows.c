/* A shard row's text fields into a trade's dict (pipeline/day/dumps.py's Trade.from_row), as a
 * CPython extension module built by pipeline/native.py. In Python each of a trade's 19 text
 * fields cost a subscript, a store and most an intern() call (~1.5 us a trade, a 2,000-page
 * note's 125,000 of them); here it is one call. dumps._filled is the Python twin, and does any
 * row this does not take (not a list of str, a column missing): filled() returns None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* filled(template, spec, row) -> a copy of the dict `template` (a split table stays one: its keys
 * shared), each (key, column, interned) of the tuple `spec` set to row[column], interned if
 * `interned` is true; None where `row` is not a list whose columns in `spec` are each a str. */
static PyObject *filled(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyList_CheckExact(args[2]))
        Py_RETURN_NONE;
    PyObject *spec = args[1], *row = args[2];
    Py_ssize_t fields = PyTuple_GET_SIZE(spec), columns = PyList_GET_SIZE(row);
    for (Py_ssize_t i = 0; i < fields; i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3)
            Py_RETURN_NONE;
        Py_ssize_t column = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
        if (column < 0 || column >= columns || !PyUnicode_CheckExact(PyList_GET_ITEM(row, column))) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    PyObject *d = PyDict_Copy(args[0]);
    for (Py_ssize_t i = 0; d != NULL && i < fields; i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec, i);
        PyObject *value = Py_NewRef(PyList_GET_ITEM(row, PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1))));
        int interned = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 2));
        if (interned > 0)
            PyUnicode_InternInPlace(&value);
        if (interned < 0 || PyDict_SetItem(d, PyTuple_GET_ITEM(entry, 0), value) < 0)
            Py_CLEAR(d);
        Py_DECREF(value);
    }
    return d;
}

static PyMethodDef METHODS[] = {
    {"filled", (PyCFunction)(void (*)(void))filled, METH_FASTCALL, "filled(template, spec, row): the row's fields"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "rows", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_rows(void)
{
    return PyModule_Create(&MODULE);
}
